"""PyTorch and JAX give the same answers on the same inputs.

Random inputs (with poisoned inactive rows) go through ``torch-native`` and
``jax-native`` (``policy_loss`` with an entropy bonus on a masked vocabulary too);
outputs and policy-logit gradients must agree within the case's tolerance, NaN in the same places, and inactive rows must hold
bit-identical neutral values with a zero gradient in both.
"""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl import harness
from ratiokl.harness._compare import Check, compare_close

PAIR = ("torch-native", "jax-native")

pytestmark = pytest.mark.skipif(
    any(harness.target_status(t) for t in PAIR),
    reason="needs both torch and jax: "
    + "; ".join(filter(None, (harness.target_status(t) for t in PAIR))),
)


def _case(op: str, dtype: str, lead, vocab: int, seed: int, temperature) -> harness.Case:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 3.0, (*lead, vocab))
    ids = rng.integers(0, vocab, lead)
    mask = rng.random(lead) < 0.6
    inactive = ~mask
    logits[inactive] = rng.choice([np.nan, np.inf, -np.inf], size=int(inactive.sum()))[:, None]
    ids[inactive] = rng.choice([-1, vocab, 2**31 - 1], size=int(inactive.sum()))
    per_row = temperature == "per-row"
    if per_row:
        temperature = np.where(mask, rng.uniform(0.5, 2.0, lead), 0.0)
    options = {} if per_row else {"temperature": temperature}
    if op == "selected_logprobs":
        inputs = {"logits": logits, "action_ids": ids, "mask": mask}
    elif op == "policy_loss":  # with the entropy bonus, on a masked (-inf) vocabulary
        active = np.argwhere(mask)
        logits[tuple(active[0])][1::2] = -np.inf
        ids[tuple(active[0])] = 0
        inputs = {"policy_logits": logits, "action_ids": ids, "mask": mask,
                  "old_logps": np.where(mask, rng.normal(-3.0, 1.0, lead), np.nan),
                  "advantages": rng.normal(size=lead)}
        options.update(entropy_coef=0.2, loss_agg=("token-mean", "seq-mean-token-mean")[seed % 2])
    else:
        ref = logits + rng.normal(0.0, 0.5, logits.shape)
        old = np.where(mask, rng.normal(-3.0, 1.0, lead), np.nan)
        inputs = {"policy_logits": logits, "ref_logits": ref, "action_ids": ids, "mask": mask,
                  "old_logps": old}
        options["kl_estimator"] = ("k1", "k2", "k3")[seed % 3]
    if per_row:
        inputs["temperature"] = temperature
    size = () if op == "policy_loss" else lead  # the loss is 0-d
    cot = {o: rng.normal(size=size) for o in harness.OPS[op].cotangents}
    return harness.build_case(f"cross_{op}_{seed}", "cross", op, dtype, inputs,
                                  options=options, cotangents=cot)


@pytest.mark.parametrize(
    "op, dtype, lead, vocab, seed, temperature",
    [
        ("ratio_kl", "float32", (7,), 33, 0, 1.0),
        ("ratio_kl", "float16", (3, 5), 128, 1, 0.7),
        ("ratio_kl", "bfloat16", (2, 3, 4), 17, 2, "per-row"),
        ("selected_logprobs", "float32", (2, 3, 4), 17, 3, "per-row"),
        ("selected_logprobs", "float16", (7,), 33, 4, 1.0),
        ("selected_logprobs", "bfloat16", (3, 5), 128, 5, 0.7),
        ("policy_loss", "float32", (3, 5), 33, 6, 0.8),
        ("policy_loss", "bfloat16", (2, 4), 64, 7, "per-row"),
    ],
)
def test_torch_and_jax_agree(op, dtype, lead, vocab, seed, temperature) -> None:
    case = _case(op, dtype, lead, vocab, seed, temperature)
    torch_out, jax_out = (harness.call_target(case, t) for t in PAIR)
    check = Check()
    inactive = ~case.row_mask
    for out in case.spec.outputs:
        a, b = torch_out.outputs[out], jax_out.outputs[out]
        compare_close(check, out, b, a.astype(np.float64), case.tolerances[out])
        if a.ndim:  # per-row outputs (a loss and its metrics are 0-d)
            assert a[inactive].tobytes() == b[inactive].tobytes(), f"{out}: inactive rows differ"
    compare_close(check, "grad", jax_out.grad, torch_out.grad.astype(np.float64), case.tolerances["grad"])
    assert torch_out.grad_dtype == jax_out.grad_dtype == dtype
    assert np.all(torch_out.grad[inactive] == 0) and np.all(jax_out.grad[inactive] == 0)
    assert check.passed, check.failures
    # Agreement with each other is only meaningful if both agree with the spec.
    for outcome in (torch_out, jax_out):
        assert harness.judge(case, outcome).passed


def _rollout_case(correction: str, dtype: str, seed: int) -> harness.Case:
    """A ``policy_loss`` case with the rollout correction on packed rows; poisoned inactive
    rows (NaN logits, old and rollout log-probs, bad ids)."""
    rng = np.random.default_rng(seed)
    lead, vocab = (3, 9), 29
    mask = rng.random(lead) < 0.7
    logits = rng.normal(0.0, 2.0, (*lead, vocab))
    ids = rng.integers(0, vocab, lead)
    old = np.where(mask, rng.normal(-3.0, 1.0, lead), np.nan)
    inputs = {"policy_logits": np.where(mask[..., None], logits, np.nan),
              "ref_logits": logits + rng.normal(0.0, 0.5, logits.shape),
              "action_ids": np.where(mask, ids, vocab + 3), "mask": mask, "old_logps": old,
              "advantages": rng.normal(size=lead[:-1]),
              "rollout_logps": old + rng.normal(0.0, 0.4, lead),
              "segment_ids": np.sort(rng.integers(0, 3, lead), axis=-1)}
    options = {"rollout_correction": correction, "rollout_bounds": (0.6, 1.7), "kl_coef": 0.1,
               "loss_agg": "seq-mean-token-sum"}
    return harness.build_case(f"cross_rollout_{seed}", "cross", "policy_loss_rollout", dtype,
                                  inputs, options=options,
                                  cotangents={"loss": np.float32(0.5)})


@pytest.mark.parametrize("correction, dtype, seed", [
    ("token-truncate", "float32", 10), ("token-mask", "bfloat16", 11),
    ("sequence-truncate", "float16", 12), ("sequence-mask", "float32", 13),
])
def test_torch_and_jax_agree_on_the_rollout_correction(correction, dtype, seed) -> None:
    case = _rollout_case(correction, dtype, seed)
    torch_out, jax_out = (harness.call_target(case, t) for t in PAIR)
    check = Check()
    for out in case.spec.outputs:
        compare_close(check, out, jax_out.outputs[out],
                      torch_out.outputs[out].astype(np.float64), case.tolerances[out])
    compare_close(check, "grad", jax_out.grad, torch_out.grad.astype(np.float64),
                  case.tolerances["grad"])
    inactive = ~case.row_mask
    assert np.all(torch_out.grad[inactive] == 0) and np.all(jax_out.grad[inactive] == 0)
    assert check.passed, check.failures
    for outcome in (torch_out, jax_out):
        assert harness.judge(case, outcome).passed
