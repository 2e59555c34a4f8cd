"""The linear ops with the lm_head's rows sharded over a gloo group: one rank's checks.

Run on every rank by ``vocab_parallel_worker.py`` (``PATH:run_native`` /
``PATH:run_interpret``). Rank ``r`` holds rows ``[start_r, stop_r)`` of ``weight [V, H]``
and ``bias [V]`` (uneven blocks: ``V = 5 world + 3``); the hidden states and every
per-token input are global. ``linear_selected_logprobs`` (with and without the entropy)
and ``linear_policy_loss`` are compared with the unsharded call in the same process and
with the float64 spec: values, ``d hidden`` (the whole gradient on every rank), this rank's
rows of ``d weight`` and ``d bias``; inactive rows hold NaN / inf hidden states and
out-of-range ids. Also: the ranks' shape agreement, an empty block, bad ids, empty input
and the collectives a call makes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ratiokl import spec
from ratiokl.torch import loss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))  # a subprocess
from assertions import assert_close  # noqa: E402
from vocab_linear_case import OPTIONS, expected, make_case, shard_bounds  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WIDTH = 8


def _vocab(world: int) -> int:
    return 5 * world + 3


def _head(case, dtype: str, rows: slice):
    """``hidden``, this block of ``weight`` and ``bias``, as leaves requiring gradients."""
    to = DTYPES[dtype]
    return [torch.tensor(x, dtype=torch.float32).to(to).requires_grad_(True)
            for x in (case["hidden"], case["weight"][rows], case["bias"][rows])]


def _rows(case, *keys):
    return [torch.tensor(case[k], dtype=torch.float32 if case[k].dtype.kind == "f" else None)
            for k in keys]


def _logprobs(case, dtype: str, rows: slice, group, backend: str, entropy: bool):
    """``(outputs, (d hidden, d weight, d bias))`` of ``sum(g_logp logp + g_ent entropy)``."""
    hidden, weight, bias = _head(case, dtype, rows)
    ids, mask, temp, g_logp, g_ent = _rows(case, "ids", "mask", "temperature", "g_logp",
                                           "g_ent")
    out = loss.linear_selected_logprobs(hidden, weight, ids, mask, bias=bias, temperature=temp,
                                        return_entropy=entropy, backend=backend,
                                        vocab_group=group, **OPTIONS)
    outputs = {"logp": out[0], "entropy": out[1]} if entropy else {"logp": out}
    objective = (outputs["logp"] * g_logp).sum()
    if entropy:
        objective = objective + (outputs["entropy"] * g_ent).sum()
    objective.backward()
    return outputs, (hidden.grad, weight.grad, bias.grad)


def check_logprobs(world: int, group, backend: str, dtype: str, entropy: bool) -> None:
    """Sharded ``linear_selected_logprobs`` vs the spec and the unsharded call."""
    vocab = _vocab(world)
    case = make_case(3 + world, (3, 5), WIDTH, vocab, world, dtype)
    start, stop = shard_bounds(vocab, world)[dist.get_rank(group)]
    outputs, grads = _logprobs(case, dtype, slice(start, stop), group, backend, entropy)
    outputs_1, grads_1 = _logprobs(case, dtype, slice(None), None, backend, entropy)
    exp_outputs, exp_grads, tols = expected(case, dtype, entropy)
    for name, value in outputs.items():
        assert_close(value, exp_outputs[name], tols[name], name)
        assert_close(value, outputs_1[name], tols[name], f"{name} vs unsharded")
        assert bool((value[~torch.tensor(case["mask"])] == 0).all()), name
    blocks = (slice(None), slice(start, stop), slice(start, stop))
    for name, grad, grad_1, exp, block in zip(("hidden", "weight", "bias"), grads, grads_1,
                                              exp_grads, blocks):
        assert grad.dtype == DTYPES[dtype], (name, grad.dtype)
        assert_close(grad, exp[block], tols[name], f"d {name}")
        assert_close(grad, grad_1[block], tols[name], f"d {name} vs unsharded")
    inactive = ~torch.tensor(case["mask"])
    assert bool((grads[0][inactive] == 0).all()), "d hidden on inactive rows"
    assert all(bool(torch.isfinite(g).all()) for g in grads), "a NaN reached a gradient"


def _policy_loss(case, rows: slice, group, backend: str, options):
    hidden, weight, bias = _head(case, "float32", rows)
    ids, mask, old, adv, ref = _rows(case, "ids", "mask", "old", "adv", "ref_logps")
    value, metrics = loss.linear_policy_loss(
        hidden, weight, ids, mask, old, adv, ref_logps=ref, bias=bias, kl_coef=0.1,
        temperature=0.9, backend=backend, vocab_group=group, **OPTIONS, **options)
    value.backward()
    return value, metrics, (hidden.grad, weight.grad, bias.grad)


def check_policy_loss(world: int, group, backend: str, options) -> None:
    """Sharded ``linear_policy_loss`` equals the unsharded call: loss, metrics, gradients."""
    vocab = _vocab(world)
    case = make_case(11, (4, 5), WIDTH, vocab, world, "float32")
    start, stop = shard_bounds(vocab, world)[dist.get_rank(group)]
    if "rollout_correction" in options:  # the engine's log-probs, NaN on inactive rows
        options = dict(options, rollout_logps=torch.tensor(
            case["old"] + 0.3 * (case["ref_logps"] + 3.0), dtype=torch.float32))
    value, metrics, grads = _policy_loss(case, slice(start, stop), group, backend, options)
    value_1, metrics_1, grads_1 = _policy_loss(case, slice(None), None, backend, options)
    tol = spec.paths_tolerance(case["mask"].size)  # sums over the tokens
    assert bool(torch.isfinite(value)), value
    assert_close(value, value_1, tol, "linear policy loss")
    for key, exp in metrics_1.items():
        assert_close(metrics[key], exp, tol, key)
    for name, grad, grad_1, block in zip(("hidden", "weight", "bias"), grads, grads_1,
                                         (slice(None), slice(start, stop), slice(start, stop))):
        # d hidden sums over the vocabulary, d weight and d bias over the tokens
        terms = vocab if name == "hidden" else case["mask"].size
        grad_tol = spec.paths_tolerance(terms, float(grad_1.abs().max()))
        assert_close(grad, grad_1[block], grad_tol, f"policy loss d {name}")
    assert bool((grads[0][~torch.tensor(case["mask"])] == 0).all())


def check_shape_disagreement(world: int, group) -> None:
    """A rank whose hidden states or head differ in shape (one row fewer; another H; no
    bias; another dtype) makes every rank raise the same ValueError naming it; the group
    works afterwards."""
    rank, last = dist.get_rank(group), world - 1
    vocab = _vocab(world)
    start, stop = shard_bounds(vocab, world)[rank]
    case = make_case(5, (4, 5), WIDTH + 1, vocab, world, "float32")

    def call(rows=20, width=WIDTH, with_bias=True, dtype=torch.float32):
        hidden = torch.tensor(case["hidden"].reshape(20, -1)[:rows, :width]).to(dtype)
        weight = torch.tensor(case["weight"][start:stop, :width]).to(dtype)
        bias = torch.tensor(case["bias"][start:stop]).to(dtype) if with_bias else None
        ids, mask = (t.reshape(-1)[:rows] for t in _rows(case, "ids", "mask"))
        return loss.linear_selected_logprobs(hidden.requires_grad_(True), weight, ids, mask,
                                             bias=bias, vocab_group=group)

    first, end = shard_bounds(vocab, world)[last]
    width = end - first  # the last rank's block
    for change, named in (
            (dict(rows=19), f"hidden [19, {WIDTH}] float32 (19 rows), weight [{width}, {WIDTH}] "
                            "and bias"),
            (dict(width=WIDTH + 1), f"hidden [20, {WIDTH + 1}] float32 (20 rows), weight "
                                    f"[{width}, {WIDTH + 1}] and bias"),
            (dict(with_bias=False), f"weight [{width}, {WIDTH}], no bias"),
            (dict(dtype=torch.bfloat16), f"hidden [20, {WIDTH}] bfloat16 (20 rows)")):
        try:
            call(**(change if rank == last else {}))
        except ValueError as err:
            text = str(err)
            assert f"rank(s) {last} passed inputs whose shapes differ" in text, text
            assert f"rank {last}: hidden" in text and named in text, (named, text)
        else:
            raise AssertionError(f"rank {rank}: {change} on rank {last} was accepted")
    assert call().shape == (20,)  # nothing left half-done: the group runs the next call


def check_empty_block(world: int, group) -> None:
    """A rank holding no row of the head: every rank raises, naming ``weight``."""
    rank = dist.get_rank(group)
    rows = 1 if rank == 0 else 0
    try:
        loss.linear_selected_logprobs(torch.zeros(3, WIDTH), torch.zeros(rows, WIDTH),
                                      torch.zeros(3, dtype=torch.long), vocab_group=group)
    except ValueError as err:
        assert "`weight`: every rank's vocabulary block needs at least one token" in str(err)
    else:
        raise AssertionError("an empty vocabulary block was accepted")


def check_bad_ids_and_empty(world: int, group, backend: str) -> None:
    """Ids are checked against the global V (``ValueError`` on every rank); unchecked, a bad
    active id's row is NaN and the others are not. No rows: zeros, no NaN."""
    vocab = _vocab(world)
    case = make_case(7, (2, 3), WIDTH, vocab, world, "float32")
    start, stop = shard_bounds(vocab, world)[dist.get_rank(group)]
    case["hidden"] = np.where(case["mask"][..., None], case["hidden"], 0.5)
    case["ids"] = np.where(case["mask"], case["ids"], 1)
    case["mask"][:] = True
    case["ids"][1, 2] = vocab
    hidden, weight, _ = _head(case, "float32", slice(start, stop))
    ids, mask = _rows(case, "ids", "mask")
    try:
        loss.linear_selected_logprobs(hidden, weight, ids, mask, vocab_group=group,
                                      backend=backend)
    except ValueError as err:
        assert f"action_ids[1, 2] = {vocab} is outside [0, {vocab})" in str(err), err
    else:
        raise AssertionError("an out-of-range active id was accepted")
    logp = loss.linear_selected_logprobs(hidden, weight, ids, mask, vocab_group=group,
                                         backend=backend, check_ids=False)
    assert torch.isnan(logp).nonzero().tolist() == [[1, 2]], logp
    empty = torch.zeros((0, 4, WIDTH), requires_grad=True)
    ids = torch.zeros((0, 4), dtype=torch.long)
    value, _ = loss.linear_policy_loss(empty, weight, ids, ids == 0, None, ids.float(),
                                       vocab_group=group, backend=backend)
    value.backward()
    assert float(value) == 0.0 and empty.grad.shape == (0, 4, WIDTH)


def check_collectives(world: int, group, backend: str) -> None:
    """Forward: the shape agreement, then one MAX and one SUM all-reduce of ``[C]``-sized
    rows per chunk (the entropy one more row of the SUM); backward: one ``[N, H]`` float32
    SUM of the partial ``d hidden`` (bfloat16 hidden states too), nothing else."""
    vocab = _vocab(world)
    case = make_case(13, (3, 5), WIDTH, vocab, world, "float32")
    start, stop = shard_bounds(vocab, world)[dist.get_rank(group)]
    calls, dtypes, real = [], [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(tuple(args[0].shape))
        dtypes.append(args[0].dtype)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        for dtype in DTYPES:
            for entropy in (False, True):
                calls.clear()
                _logprobs(case, dtype, slice(start, stop), group, backend, entropy)
                chunks = [4, 4, 4, 3]  # 15 rows, chunk_rows = 4
                forward = [(world, 10)] + [s for c in chunks
                                           for s in ((c + world,), (2 + entropy, c))]
                assert calls == forward + [(15, WIDTH)], (dtype, entropy, calls)
                assert dtypes[-1] == torch.float32, (dtype, entropy, dtypes[-1])
    finally:
        dist.all_reduce = real


def run_native(world: int) -> None:
    """Every check on the native backend (run on each rank)."""
    group = dist.group.WORLD
    for dtype in ("float32", "bfloat16"):
        for entropy in (False, True):
            check_logprobs(world, group, "native", dtype, entropy)
    for options in (dict(), dict(entropy_coef=0.2, loss_agg="seq-mean-token-mean"),
                    dict(objective="cispo", clip_eps_high=0.28),
                    dict(rollout_correction="token-truncate", rollout_bounds=(0.0, 1.2))):
        check_policy_loss(world, group, "native", options)
    check_shape_disagreement(world, group)
    check_bad_ids_and_empty(world, group, "native")
    check_collectives(world, group, "native")
    if world == 2:
        check_empty_block(world, group)


def run_interpret(world: int) -> None:
    """The Triton kernels (interpreted) on each rank's block: a smaller set."""
    group = dist.group.WORLD
    check_logprobs(world, group, "interpret", "bfloat16", True)
    check_logprobs(world, group, "interpret", "float32", False)
    check_policy_loss(world, group, "interpret", dict(entropy_coef=0.2))
    check_bad_ids_and_empty(world, group, "interpret")
    check_collectives(world, group, "interpret")
