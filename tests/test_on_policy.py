"""``old_logps=None`` (on-policy: ``old_logp = sg(logp)``) against the float64 spec.

Every backend of both frameworks, the fused kernel (``interpret``: its ``ON_POLICY``
branch, in the plans the interpreter takes) and the two-pass path (``native``; GSPO's
sequence ratio on every backend), and ``linear_policy_loss``'s chunks. Loss, metrics
and gradient must match ``ratiokl.spec``'s on-policy loss; inactive rows hold NaN
logits and get an exact zero gradient. A call with ``rollout_logps`` and no
``old_logps`` is refused, naming both.
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import assert_close

from ratiokl import spec

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
pytest.importorskip("triton")

import jax.numpy as jnp  # noqa: E402

from ratiokl.jax import loss as jax_loss  # noqa: E402
from ratiokl.spec.policy_loss import policy_loss as spec_loss  # noqa: E402
from ratiokl.spec.policy_loss import policy_loss_grad as spec_grad  # noqa: E402
from ratiokl.torch import loss as torch_loss  # noqa: E402

B, T, V, H = 3, 7, 300, 8
#: The loss and metrics sum B*T float32 per-token terms.
LOSS_TOL = spec.reduction_tolerance(B * T)

CASES = {
    "ppo_k3_ref": {"kl_coef": 0.1},
    "ratio_weighted_kl_dual_clip": {"kl_coef": 0.2, "kl_estimator": "k3-is", "dual_clip": 2.0,
                                    "loss_agg": "seq-mean-token-mean"},
    "cispo_entropy": {"objective": "cispo", "clip_eps_high": 4.0, "entropy_coef": 0.01},
    "gspo_two_pass": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"},
}


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.75
    mask[0, 0] = True
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    logits[~mask] = np.nan  # an inactive row's garbage stays out
    return {
        "logits": logits,
        "ids": np.where(mask, rng.integers(0, V, (B, T)), -5),
        "mask": mask,
        "ref_logps": np.where(mask, rng.normal(-4.0, 1.0, (B, T)), np.nan).astype(np.float32),
        "adv": rng.normal(0.0, 1.0, (B, T)).astype(np.float32),
    }


def _expected(x, options):
    args = (x["logits"].astype(np.float64), None, x["ids"], x["mask"], None, x["adv"])
    loss, metrics = spec_loss(*args, ref_logps=x["ref_logps"], **options)
    return loss, metrics, spec_grad(*args, ref_logps=x["ref_logps"], **options)


def _torch(x, backend, options):
    logits = torch.from_numpy(x["logits"]).requires_grad_()
    loss, metrics = torch_loss.policy_loss(
        logits, None, torch.from_numpy(x["ids"]), torch.from_numpy(x["mask"]), None,
        torch.from_numpy(x["adv"]), ref_logps=torch.from_numpy(x["ref_logps"]),
        backend=backend, **options)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.item(), {k: m.item() for k, m in metrics.items()}, grad.numpy()


def _jax(x, backend, options):
    def fn(logits):
        return jax_loss.policy_loss(
            logits, None, jnp.asarray(x["ids"]), jnp.asarray(x["mask"]), None,
            jnp.asarray(x["adv"]), ref_logps=jnp.asarray(x["ref_logps"]), backend=backend,
            **options)

    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(x["logits"]))
    return float(loss), {k: float(m) for k, m in metrics.items()}, np.asarray(grad)


def _check(got, want, mask, logit_scale):
    loss, metrics, grad = got
    want_loss, want_metrics, want_grad = want
    assert_close(loss, want_loss, LOSS_TOL, "loss")
    for name, value in want_metrics.items():
        assert_close(metrics[name], value, LOSS_TOL, name)
    # On-policy every ratio is exp(0): the metrics of a ratio of 1, within the loss's bound.
    assert_close(metrics["ratio_mean"], 1.0, LOSS_TOL, "ratio_mean")
    assert_close(metrics["approx_kl"], 0.0, LOSS_TOL, "approx_kl")
    assert metrics["clip_fraction"] == 0.0  # a count of clipped tokens: exactly none
    assert np.all(grad[~mask] == 0.0), "an inactive row got a gradient"
    tol = spec.grad_tolerance("float32", logit_scale, float(np.abs(want_grad[mask]).max()))
    assert_close(grad[mask], want_grad[mask], tol, "grad")


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("case", list(CASES))
def test_on_policy_matches_spec(case, framework, backend):
    x = _inputs(seed=len(case))
    options = CASES[case]
    with np.errstate(all="ignore"):
        got = (_torch if framework == "torch" else _jax)(x, backend, dict(options))
    _check(got, _expected(x, dict(options)), x["mask"], float(np.nanmax(np.abs(x["logits"]))))


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_linear_on_policy_matches_logits(framework, backend):
    """``linear_policy_loss(old_logps=None)`` in chunks of 4 rows = the spec on ``h @ W.T``."""
    rng = np.random.default_rng(7)
    x = _inputs(seed=3)
    hidden = rng.normal(0.0, 1.0, (B, T, H)).astype(np.float32)
    hidden[~x["mask"]] = np.nan
    weight = rng.normal(0.0, 1.0, (V, H)).astype(np.float32)
    options = {"kl_coef": 0.1, "clip_eps_high": 0.28}
    logits = np.where(x["mask"][..., None], hidden, 0.0).astype(np.float64) @ weight.T
    want_loss, want_metrics = spec_loss(logits, None, x["ids"], x["mask"], None, x["adv"],
                                        ref_logps=x["ref_logps"], **options)
    g = spec_grad(logits, None, x["ids"], x["mask"], None, x["adv"],
                  ref_logps=x["ref_logps"], **options)
    want_dh = np.where(x["mask"][..., None], g @ weight, 0.0)
    want_dw = g.reshape(-1, V).T @ np.where(x["mask"][..., None], hidden, 0.0).reshape(-1, H)
    args = (x["ids"], x["mask"], None, x["adv"])
    with np.errstate(all="ignore"):
        if framework == "torch":
            h = torch.from_numpy(hidden).requires_grad_()
            w = torch.from_numpy(weight).requires_grad_()
            loss, metrics = torch_loss.linear_policy_loss(
                h, w, *(None if a is None else torch.from_numpy(a) for a in args),
                ref_logps=torch.from_numpy(x["ref_logps"]), chunk_rows=4, backend=backend,
                **options)
            dh, dw = (t.numpy() for t in torch.autograd.grad(loss, (h, w)))
            loss, metrics = loss.item(), {k: m.item() for k, m in metrics.items()}
        else:
            def fn(h, w):
                return jax_loss.linear_policy_loss(
                    h, w, *(None if a is None else jnp.asarray(a) for a in args),
                    ref_logps=jnp.asarray(x["ref_logps"]), chunk_rows=4, backend=backend,
                    **options)

            (loss, metrics), (dh, dw) = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(
                jnp.asarray(hidden), jnp.asarray(weight))
            loss, metrics = float(loss), {k: float(m) for k, m in metrics.items()}
            dh, dw = np.asarray(dh), np.asarray(dw)
    assert_close(loss, want_loss, LOSS_TOL, "loss")
    for name, value in want_metrics.items():
        assert_close(metrics[name], value, LOSS_TOL, name)
    # each entry sums V (d hidden) or B*T (d weight) products of |g| and the other factor
    scale = float(np.abs(logits).max())
    dh_mag = float((np.abs(g) @ np.abs(weight)).max())
    kept = np.abs(np.nan_to_num(hidden)).reshape(-1, H)
    dw_mag = float((np.abs(g).reshape(-1, V).T @ kept).max())
    assert_close(dh, want_dh, spec.linear_grad_tolerance("float32", scale, dh_mag), "d hidden")
    assert_close(dw, want_dw, spec.linear_grad_tolerance("float32", scale, dw_mag), "d weight")


@pytest.mark.parametrize("framework", ["torch", "jax", "spec"])
def test_rollout_logps_need_old_logps(framework):
    x = _inputs(seed=1)
    rollout = x["ref_logps"]
    with pytest.raises(ValueError, match="`rollout_logps` needs `old_logps`"):
        if framework == "torch":
            torch_loss.policy_loss(torch.from_numpy(x["logits"]), None,
                                   torch.from_numpy(x["ids"]), torch.from_numpy(x["mask"]),
                                   None, torch.from_numpy(x["adv"]),
                                   rollout_logps=torch.from_numpy(rollout))
        elif framework == "jax":
            jax_loss.policy_loss(jnp.asarray(x["logits"]), None, jnp.asarray(x["ids"]),
                                 jnp.asarray(x["mask"]), None, jnp.asarray(x["adv"]),
                                 rollout_logps=jnp.asarray(rollout))
        else:
            spec.policy_loss(x["logits"], None, x["ids"], x["mask"], None, x["adv"],
                             rollout_logps=rollout)
