"""NaN / inf sweep: a non-finite value in any active-row input of a public op is exactly as
visible as the float64 spec says, on every backend of both frameworks (issue 34).

For each scenario (an op with the options that route it differently), each input an
active token reads, and each poison (NaN, +inf, -inf; in logits at a token other than
the action's and at the action's), placed on one active token:

* the outputs are judged against ``ratiokl.spec`` run on the same poisoned inputs by the
  conformance rule (``ratiokl.harness.judge``): NaN exactly where the spec has NaN,
  equal infinities, finite values within the spec's tolerance, neutral inactive rows; the
  gradient row by row (:func:`_judge`: a row with NaN in the spec has NaN, one with only
  infinities a non-finite entry, a finite one is finite and within tolerance);
* every row whose spec outputs and gradient the poison leaves alone (all but the poisoned
  token, or its sequence with a sequence-level ratio or correction) is bitwise equal to
  the same backend's run without the poison.

Calls pass ``check_ids=False`` (PyTorch; JAX runs under ``jit``): a poisoned per-row
temperature then makes its row NaN instead of raising. ``linear_policy_loss`` has its own
module, ``test_nonfinite_sweep_linear.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from ratiokl import harness, spec
from ratiokl.harness import OPS, Case, build_case

B, T, V = 2, 4, 12
#: The poisoned token (active), and the inactive tokens (garbage in every input).
ROW = (0, 1)
MASK = np.array([[True, True, False, True], [True, False, True, True]])
POISONS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


@dataclasses.dataclass(frozen=True)
class Scenario:
    op: str  # a key of ratiokl.harness.OPS
    options: Dict[str, Any]
    inputs: Tuple[str, ...]  # the arrays passed; every one but ids and mask is poisoned
    per_sequence_advantages: bool = False


SCENARIOS: Dict[str, Scenario] = {
    "ratio_kl": Scenario("ratio_kl", {}, ("policy_logits", "ref_logits", "old_logps",
                                          "temperature")),
    "ratio_kl_ref_logps_k2": Scenario("ratio_kl", {"kl_estimator": "k2"},
                                      ("policy_logits", "ref_logps", "old_logps")),
    "selected_logprobs": Scenario("selected_logprobs", {}, ("logits", "temperature")),
    "selected_logprobs_entropy": Scenario("selected_logprobs_entropy", {},
                                          ("logits", "temperature")),
    "policy_loss_kl_dual_clip": Scenario(
        "policy_loss", {"kl_coef": 0.1, "dual_clip": 3.0},
        ("policy_logits", "ref_logits", "old_logps", "advantages", "importance_weights",
         "temperature")),
    "policy_loss_entropy_kl_logged": Scenario(
        "policy_loss", {"entropy_coef": 0.3},
        ("policy_logits", "ref_logits", "old_logps", "advantages", "temperature")),
    "policy_loss_ref_logps_k3_is": Scenario(
        "policy_loss", {"kl_coef": 0.2, "kl_estimator": "k3-is"},
        ("policy_logits", "ref_logps", "old_logps", "advantages")),
    "policy_loss_sequence_ratio": Scenario(
        "policy_loss", {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean",
                        "kl_coef": 0.1},
        ("policy_logits", "ref_logits", "old_logps", "advantages"),
        per_sequence_advantages=True),
    "policy_loss_rollout_token": Scenario(
        "policy_loss_rollout", {"rollout_correction": "token-truncate", "entropy_coef": 0.1},
        ("policy_logits", "old_logps", "advantages", "rollout_logps")),
    "policy_loss_rollout_sequence": Scenario(
        "policy_loss_rollout", {"rollout_correction": "sequence-mask",
                                "loss_agg": "seq-mean-token-sum"},
        ("policy_logits", "old_logps", "advantages", "rollout_logps")),
    "policy_loss_cispo": Scenario(
        "policy_loss", {"objective": "cispo", "kl_coef": 0.1, "entropy_coef": 0.1},
        ("policy_logits", "ref_logits", "old_logps", "advantages")),
    "policy_loss_sapo": Scenario(
        "policy_loss", {"objective": "sapo", "kl_coef": 0.1},
        ("policy_logits", "ref_logits", "old_logps", "advantages")),
    "policy_loss_per_token": Scenario(
        "policy_loss", {"loss_agg": "none", "kl_coef": 0.1, "entropy_coef": 0.1},
        ("policy_logits", "ref_logits", "old_logps", "advantages")),
    "policy_loss_on_policy": Scenario(
        "policy_loss", {"kl_coef": 0.1, "entropy_coef": 0.1},
        ("policy_logits", "ref_logits", "advantages")),
    "policy_loss_rollout_token_clip": Scenario(
        "policy_loss_rollout", {"rollout_correction": "token-clip",
                                "rollout_bounds": (0.9, 1.1)},
        ("policy_logits", "old_logps", "advantages", "rollout_logps")),
    "policy_loss_rollout_geomean_mask": Scenario(
        "policy_loss_rollout", {"rollout_correction": "sequence-geomean-mask",
                                "rollout_bounds": (0.9, 1.1)},
        ("policy_logits", "old_logps", "advantages", "rollout_logps")),
    "policy_loss_terms_apart_kl_clamp": Scenario(
        "policy_loss", {"loss_agg": "seq-mean-token-mean", "kl_coef": 0.1,
                        "entropy_coef": 0.1, "kl_agg": "token-mean",
                        "entropy_agg": "token-mean", "kl_clamp": 0.5},
        ("policy_logits", "ref_logits", "old_logps", "advantages")),
}


def _arrays(name: str) -> Dict[str, np.ndarray]:
    """The scenario's clean inputs; inactive tokens hold NaN logits / values and bad ids."""
    scenario = SCENARIOS[name]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    logits = rng.normal(0.0, 2.0, (B, T, V))
    ids = rng.integers(0, V, (B, T))
    temperature = rng.uniform(0.6, 1.5, (B, T))
    logp = spec.selected_logprobs(logits, ids, MASK, temperature=temperature)
    old = logp + rng.normal(0.0, 0.3, (B, T))
    ref = logits + rng.normal(0.0, 0.5, logits.shape)
    every = {
        "policy_logits": logits, "logits": logits, "ref_logits": ref,
        "ref_logps": spec.selected_logprobs(ref, ids, MASK, temperature=temperature),
        "old_logps": old, "rollout_logps": old + rng.normal(0.0, 0.2, (B, T)),
        "advantages": rng.normal(0.0, 1.0, (B,) if scenario.per_sequence_advantages
                                 else (B, T)),
        "importance_weights": rng.uniform(0.5, 1.5, (B, T)), "temperature": temperature,
    }
    x = {k: np.array(every[k], dtype=np.float64) for k in scenario.inputs}
    for key, value in x.items():
        if value.shape[:2] == MASK.shape:
            value[~MASK] = 0.0 if key == "temperature" else np.nan
    x["action_ids"] = np.where(MASK, ids, np.array([[0, 0, -1, 0], [0, V + 3, 0, 0]]))
    x["mask"] = MASK
    return x


def _poisons(name: str) -> List[Tuple[str, str, str]]:
    """``(input, poison, where)`` of a scenario; ``where``: the logits' column."""
    out = []
    for key in SCENARIOS[name].inputs:
        if key in OPS[SCENARIOS[name].op].logit_args:
            out += [(key, p, col) for p in POISONS for col in ("other", "action")]
        else:
            out += [(key, p, "row") for p in POISONS]
    return out


@dataclasses.dataclass(frozen=True)
class _Unchecked(Case):
    """A case whose PyTorch call passes ``check_ids=False``."""

    @property
    def spec(self):
        op = OPS[self.op]
        return dataclasses.replace(op, fixed={**op.fixed, "check_ids": False})


def _case(name: str, arrays: Dict[str, np.ndarray]) -> Case:
    scenario = SCENARIOS[name]
    op = OPS[scenario.op]
    rng = np.random.default_rng(7)
    per_token = op.neutral or scenario.options.get("loss_agg") == "none"  # outputs [B, T]
    cot = ({"loss": np.float32(1.0)} if not per_token
           else {o: rng.normal(0.0, 1.0, (B, T)) for o in op.cotangents})
    case = build_case(name, name, scenario.op, "float32", arrays, options=scenario.options,
                      cotangents=cot)
    return _Unchecked(**{f.name: getattr(case, f.name) for f in dataclasses.fields(case)})


@functools.lru_cache(maxsize=None)
def _clean(name: str, target: str) -> Tuple[Case, harness.Outcome]:
    case = _case(name, _arrays(name))
    outcome = harness.call_target(case, target)
    check = harness.judge(case, outcome)
    assert check.passed, f"{target} {name} without poison: " + "; ".join(check.failures)
    return case, outcome


def _judge(case: Case, outcome: harness.Outcome) -> List[str]:
    """The conformance rule on the outputs; on the gradient, row by row: a row finite in
    the spec is finite and within tolerance; a row with NaN in the spec has NaN, one with
    only infinities a non-finite entry (where ``+-inf`` meets ``0 * inf`` the kernels'
    one-product forms and the spec's ``c * (onehot - p)`` place NaN and inf differently)."""
    expected = case.arrays["expected_grad"]
    finite = np.isfinite(expected).all(axis=-1)
    without_grad = dataclasses.replace(
        outcome, grad=np.where(finite[..., None], outcome.grad, expected).astype(np.float32))
    check = harness.judge(case, without_grad)
    got = outcome.grad.astype(np.float64)
    for row in map(tuple, np.argwhere(~finite)):
        if np.isnan(expected[row]).any() and not np.isnan(got[row]).any():
            check.fail(f"grad{list(row)}: no NaN where the spec has {expected[row]}: {got[row]}")
        elif np.isfinite(got[row]).all():
            check.fail(f"grad{list(row)}: finite where the spec has {expected[row]}: {got[row]}")
    return check.failures


def _row_changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[B, T]``: where two per-row arrays (trailing axes reduced) differ, NaN equal to NaN."""
    differ = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    return differ.reshape(B, T, -1).any(axis=-1)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


PARAMS = [pytest.param(name, *p, id=f"{name}-{p[0]}-{p[1]}-{p[2]}")
          for name in SCENARIOS for p in _poisons(name)]


@pytest.mark.parametrize("scenario,key,poison,where", PARAMS)
def test_poisoned_active_token(target: str, scenario: str, key: str, poison: str,
                               where: str) -> None:
    clean_case, clean = _clean(scenario, target)
    arrays = _arrays(scenario)
    if where == "row":
        arrays[key][ROW if arrays[key].ndim == 2 else ROW[:1]] = POISONS[poison]
    else:
        action = arrays["action_ids"][ROW]
        column = action if where == "action" else (action + 5) % V
        arrays[key][ROW + (column,)] = POISONS[poison]
    case = _case(scenario, arrays)
    outcome = harness.call_target(case, target)
    failures = _judge(case, outcome)
    assert not failures, f"{target} {scenario}, {poison} in {key} ({where}): " + "; ".join(
        failures)
    # Rows the spec leaves alone are bitwise those of the unpoisoned run.
    op = case.spec
    changed = _row_changed(case.arrays["expected_grad"], clean_case.arrays["expected_grad"])
    for out in op.neutral:
        changed |= _row_changed(case.arrays[f"expected_{out}"],
                                clean_case.arrays[f"expected_{out}"])
    changed[ROW] = True  # (its zeros may change sign: a clipped token's 0 * (onehot - p))
    keep = ~changed
    pairs = [("grad", outcome.grad, clean.grad)] + [
        (o, outcome.outputs[o], clean.outputs[o]) for o in op.neutral]
    for what, got, want in pairs:
        assert np.array_equal(_bits(got)[keep], _bits(want)[keep]), (
            f"{target} {scenario}, {poison} in {key} ({where}): {what} changed on rows the "
            f"poison does not reach ({np.argwhere(keep).tolist()})")
