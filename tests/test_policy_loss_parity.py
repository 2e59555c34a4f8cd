"""``policy_loss`` in PyTorch and in JAX agree on the same inputs.

Loss, metrics and policy-logit gradient within float32 rounding of each
other; inactive rows' gradient bitwise 0 in both, whatever the rows hold.
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import assert_close
from ratiokl import spec

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from ratiokl.jax import loss as jax_loss  # noqa: E402
from ratiokl.torch import loss as torch_loss  # noqa: E402

B, T, V = 4, 6, 23
#: Both frameworks round the same float32 math (sums of B*T terms) in another order.
LOSS_TOL = spec.paths_tolerance(B * T)

CASES = {
    "grpo_kl_k3": {"kl_coef": 0.1},
    "dapo_clip_higher_token_sum": {"clip_eps_high": 0.28, "loss_agg": "token-sum"},
    "dual_clip_k3_straight_through": {"dual_clip": 1.5, "kl_coef": 0.2, "kl_estimator": "k3+"},
    "dr_grpo_constant_normalizer": {"loss_agg": "seq-mean-token-sum-norm", "loss_normalizer": 64.0},
    "gspo_packed": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "packed": True},
    "ratio_weighted_kl_seq_mean": {"loss_agg": "seq-mean-token-sum", "kl_coef": 0.3,
                                   "kl_estimator": "k3-is", "ratio_cap": 1.4},
    "cispo_clip_higher_kl_k3": {"objective": "cispo", "clip_eps_high": 0.28, "kl_coef": 0.1},
    "cispo_gspo_packed": {"objective": "cispo", "ratio_level": "sequence",
                          "loss_agg": "seq-mean-token-mean", "packed": True},
}


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    mask = rng.random((B, T)) < 0.7
    logits[~mask] = np.nan
    return {
        "policy_logits": logits,
        "ref_logits": (logits + rng.normal(0.0, 0.5, logits.shape)).astype(np.float32),
        "action_ids": np.where(mask, rng.integers(0, V, (B, T)), -7),
        "mask": mask,
        "old_logps": np.where(mask, rng.normal(-3.0, 0.6, (B, T)), np.nan).astype(np.float32),
        "advantages": np.where(mask, rng.normal(0.0, 1.0, (B, T)), np.nan).astype(np.float32),
        "segment_ids": np.sort(rng.integers(0, 3, (B, T)), axis=-1),
    }


def _torch(x, options):
    t = {k: torch.from_numpy(v) for k, v in x.items()}
    logits = t.pop("policy_logits").requires_grad_()
    segs = t.pop("segment_ids") if options.pop("packed", False) else None
    value, metrics = torch_loss.policy_loss(
        logits, t["ref_logits"], t["action_ids"], t["mask"], t["old_logps"], t["advantages"],
        segment_ids=segs, **options,
    )
    (grad,) = torch.autograd.grad(value, logits)
    return value.item(), {k: m.item() for k, m in metrics.items()}, grad.numpy()


def _jax(x, options):
    j = {k: jnp.asarray(v) for k, v in x.items()}
    segs = j["segment_ids"] if options.pop("packed", False) else None

    def fn(logits):
        return jax_loss.policy_loss(
            logits, j["ref_logits"], j["action_ids"], j["mask"], j["old_logps"],
            j["advantages"], segment_ids=segs, **options,
        )

    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(j["policy_logits"])
    return float(value), {k: float(m) for k, m in metrics.items()}, np.asarray(grad)


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_and_jax_agree(name):
    x = _inputs(seed=len(name))
    t_loss, t_metrics, t_grad = _torch(x, dict(CASES[name]))
    j_loss, j_metrics, j_grad = _jax(x, dict(CASES[name]))
    assert_close(t_loss, j_loss, LOSS_TOL, "loss")
    assert set(t_metrics) == set(j_metrics)
    for key in t_metrics:
        assert_close(t_metrics[key], j_metrics[key], LOSS_TOL, key)
    assert_close(t_grad, j_grad, spec.paths_tolerance(V, float(np.abs(t_grad).max())), "grad")
    inactive = ~x["mask"]
    assert np.array_equal(t_grad[inactive], np.zeros_like(t_grad[inactive]))
    assert np.array_equal(j_grad[inactive], np.zeros_like(j_grad[inactive]))
    assert np.all(np.isfinite(t_grad)) and np.all(np.isfinite(j_grad))
