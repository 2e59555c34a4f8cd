"""The ``backend="interpret"`` checks of one rank, run by ``vocab_parallel_worker.py`` on each rank.

The Triton kernels (``shard_stats_kernel``, ``logp_backward_kernel``) through
Triton's CPU interpreter on each rank's shard, over ``gloo``: sharded vs the
float64 spec and vs the unsharded native call, outputs and gradient slices,
with NaN/inf inactive rows inside one shard, uneven shards, a whole shard
of ``-inf`` in an active row, an active NaN in one shard, the entropy (its
``mu`` from the shard kernel, its gradient from the backward kernel's entropy
term), a few conformance fixtures (two of the linear op's, the lm_head's rows sharded)
and the collective count. Kept small: the interpreter
runs one Python program per row.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch.distributed as dist


def _sibling():
    path = Path(__file__).with_name("vocab_parallel_worker.py")
    module_spec = importlib.util.spec_from_file_location("_ratiokl_vp_worker_for_interpret", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


#: Fixtures that pin down the inactive-row, masking, NaN and id rules, in each dtype.
FIXTURES = (
    "inactive_rows_nan_logits_bf16",
    "inactive_rows_inf_logits_fp32",
    "inactive_rows_bad_ids_fp16",
    "active_row_nan_logit_fp32",
    "active_rows_masked_vocab_fp16",
    "active_id_out_of_range_fp32",
    "all_inactive_fp32",
    "empty_rows_bf16",
    "ref_logps_given_bf16",
    "temperature_per_row_fp32",
    "selected_logprobs_inactive_rows_fp32",
    "vocab_2_bf16",
    "entropy_masked_vocab_fp32",
    "entropy_temperature_per_row_bf16",
    "policy_entropy_masked_vocab_fp32",
    "policy_entropy_temperature_per_row_fp32",
    "policy_entropy_gspo_fp32",
    "linear_all_options_bf16",
    "linear_active_id_out_of_range_fp32",
)


def run_interpret(world: int) -> None:
    """Every interpret check on the WORLD group (called on each rank)."""
    worker = _sibling()
    group = dist.group.WORLD
    for seed, (lead, vocab, dtype, with_ref, per_row_t, kl) in enumerate([
        ((4, 5), 37, "float32", True, True, "k3"),
        ((3, 4), 29, "bfloat16", False, False, "k2"),
    ]):
        case = worker.make_case(seed, lead, vocab, dtype)
        bounds = worker.shard_bounds(vocab, world)
        worker.poison_inactive(case, slice(*bounds[seed % world]))
        worker.check_ratio_kl(case, dtype, bounds, group, with_ref=with_ref,
                              per_row_t=per_row_t, kl=kl, backend="interpret")
    worker.check_masking_and_nan(world, group, backend="interpret")
    worker.check_entropy(world, group, backend="interpret")
    worker.check_collective_count(world, group, backend="interpret")
    ran = worker.check_conformance(world, group, names=FIXTURES, backend="interpret")
    assert ran == len(FIXTURES), ran
