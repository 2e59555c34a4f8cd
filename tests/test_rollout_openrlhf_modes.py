"""``rollout_correction="token-clip"`` (TIS with a floor) and ``"sequence-geomean-mask"``
(the geometric-mean sequence gate) against OpenRLHF 0.11.2's ``PolicyLoss`` formula
(``is_correction_mode="clip"`` at token level; ``"mask"`` at ``is_correction_level="seq"``),
written here independently in float64 PyTorch (autograd gives its gradient), on both
frameworks' ``policy_objective`` with NaN / inf on inactive tokens.

The fixtures ``policy_rollout_token_clip``, ``policy_rollout_sequence_geomean_mask*`` and
``objective_rollout_{token_clip,geomean_mask_packed}`` pin the float64 values on every
backend (the PyTorch Triton backends' one-launch rollout kernel lacks these two modes: they
take the framework ops of ``ratiokl._core.rollout``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from assertions import assert_close

_SPEC = importlib.util.spec_from_file_location(
    "_policy_objective_tests", Path(__file__).with_name("test_policy_objective.py"))
_OBJ = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_OBJ)

torch = pytest.importorskip("torch")

B, T = 4, 7
EPS = 0.2


def _openrlhf(logp, old, adv, mask, rollout, *, mode, level, low, high):
    """OpenRLHF 0.11.2 ``PolicyLoss.forward`` (ppo, ratio gating, token-level loss)."""
    ratio = (logp - old).clamp(-20.0, 20.0).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv
    loss = -torch.min(surr1, surr2)
    is_log_ratio = (old - rollout).detach()
    token_is = is_log_ratio.exp()
    if level == "seq":
        stat = ((is_log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).exp()
    else:
        stat = is_log_ratio.exp()
    if mode == "clip":
        coef = stat.clamp(min=low, max=high)
    else:
        coef = torch.where((stat >= low) & (stat <= high), token_is, 0.0)
    loss = coef * loss
    return (loss * mask).sum() / mask.sum()


def _data(seed, noise):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.8
    mask[:, 0] = True  # no empty row (OpenRLHF's row mean would be 0 / 0)
    logp = -rng.gamma(2.0, 1.0, (B, T))
    old = logp + rng.normal(0.0, 0.3, (B, T))
    arrays = {"logps": logp, "old_logps": old,
              "rollout_logps": old + rng.normal(0.0, noise, (B, T)),
              "advantages": rng.normal(0.0, 1.0, (B, T))}
    clean = {k: np.where(mask, v, 0.0) for k, v in arrays.items()}
    garbage = np.choose(np.arange(B * T).reshape(B, T) % 3, [np.nan, np.inf, -np.inf])
    poisoned = {k: np.where(mask, v, garbage).astype(np.float32) for k, v in arrays.items()}
    return mask, clean, poisoned


@pytest.mark.parametrize("correction, mode, level, bounds, noise", [
    ("token-clip", "clip", "token", (0.6, 1.5), 0.6),
    ("sequence-geomean-mask", "mask", "seq", (0.8, 1.25), 0.8),
])
def test_openrlhf_is_correction(native_target, correction, mode, level, bounds, noise):
    fw = _OBJ._framework(native_target)
    mask, clean, poisoned = _data(31, noise)
    t = {k: torch.tensor(v) for k, v in clean.items()}
    t["logps"].requires_grad_()
    want = _openrlhf(t["logps"], t["old_logps"], t["advantages"],
                     torch.tensor(mask, dtype=torch.float64), t["rollout_logps"], mode=mode,
                     level=level, low=bounds[0], high=bounds[1])
    want.backward()
    p = {k: fw.tensor(v) for k, v in poisoned.items()}

    def fn(logps):
        return fw.loss.policy_objective(
            logps, p["old_logps"], p["advantages"], fw.tensor(mask),
            rollout_logps=p["rollout_logps"], rollout_correction=correction,
            rollout_bounds=bounds, clip_eps=EPS)

    value, metrics, (grad,) = fw.run(fn, [poisoned["logps"]], None)
    assert_close(value, want.item(), _OBJ.LOSS_TOL, "loss")
    assert_close(grad, t["logps"].grad.numpy(), _OBJ.GRAD_TOL, "grad")
    assert np.all(grad[~mask] == 0)
    # The data reaches what the mode pins down: both bounds (clip), a gated row (mask).
    e = np.exp(clean["old_logps"] - clean["rollout_logps"])[mask]
    if mode == "clip":
        assert (e < bounds[0]).any() and (e > bounds[1]).any()
    else:
        assert 0.0 < float(metrics["rollout_masked_fraction"]) < 1.0
