"""The native JAX backend against the float64 spec: leading shapes, temperatures, inactive
rows holding garbage, the ``auto`` backend (the behaviours both frameworks share, errors
included: ``tests/test_native.py``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ratiokl import spec
from ratiokl.jax import loss
from assertions import assert_close  # noqa: E402

jax.config.update("jax_enable_x64", False)

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
V = 11


def _case(lead, dtype="float32", seed=0, active=0.7, scale=3.0):
    """Random numpy inputs of leading shape ``lead``; logits exactly representable in dtype."""
    rng = np.random.default_rng(seed)
    cast = lambda a: np.array(jnp.asarray(a, DTYPES[dtype]))  # noqa: E731
    return {
        "policy": cast(rng.normal(scale=scale, size=(*lead, V)).astype(np.float32)),
        "ref": cast(rng.normal(scale=scale, size=(*lead, V)).astype(np.float32)),
        "ids": rng.integers(0, V, size=lead).astype(np.int32),
        "mask": rng.random(lead) < active,
        "old": rng.normal(scale=2.0, size=lead).astype(np.float32) - 3.0,
        "g1": rng.normal(size=lead).astype(np.float32),
        "g2": rng.normal(size=lead).astype(np.float32),
    }


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _scale(logits, temperature=1.0):
    z = np.abs(_f64(logits) / np.asarray(temperature, np.float64)[..., None])
    return float(np.max(z[np.isfinite(z)], initial=1.0))


def _ratio_kl_grad(c, temperature=1.0, kl="k3", use_ref_logps=False):
    """``(ratio, kl, d(sum g1*ratio + g2*kl)/dpolicy)`` from the JAX loss."""
    ref_logits = None if use_ref_logps else c["ref"]
    ref_logps = spec.selected_logprobs(c["ref"], c["ids"], c["mask"], temperature=temperature)
    kwargs = dict(kl_estimator=kl, temperature=temperature, backend="native")
    if use_ref_logps:
        kwargs["ref_logps"] = jnp.asarray(ref_logps, jnp.float32)

    def f(policy):
        return loss.ratio_kl(policy, ref_logits, c["ids"], c["mask"], c["old"], **kwargs)

    (ratio, kl_val), vjp = jax.vjp(f, jnp.asarray(c["policy"]))
    (grad,) = vjp((jnp.asarray(c["g1"]), jnp.asarray(c["g2"])))
    return ratio, kl_val, grad


def _check_ratio_kl(c, dtype, temperature=1.0, kl="k3", use_ref_logps=False):
    ratio, kl_val, grad = _ratio_kl_grad(c, temperature, kl, use_ref_logps)
    args = (_f64(c["policy"]), _f64(c["ref"]), c["ids"], c["mask"], c["old"])
    opts = dict(kl_estimator=kl, temperature=temperature)
    want_ratio, want_kl = spec.ratio_kl(*args, **opts)
    want_grad = spec.ratio_kl_grad(*args, c["g1"], c["g2"], **opts)
    scale = _scale(c["policy"], temperature)
    assert ratio.dtype == kl_val.dtype == jnp.float32
    assert grad.dtype == jnp.dtype(DTYPES[dtype])
    assert_close(ratio, want_ratio, spec.forward_tolerance(scale))
    assert_close(kl_val, want_kl, spec.forward_tolerance(scale))
    gscale = float(np.max(np.abs(want_grad), initial=0.0))
    assert_close(grad, want_grad, spec.grad_tolerance(dtype, scale, gscale))


@pytest.mark.parametrize("lead", [(24,), (2, 3, 4)], ids=["N", "BTK"])
def test_ratio_kl_leading_shapes(lead):
    _check_ratio_kl(_case(lead, seed=2), "float32")


@pytest.mark.parametrize("temperature", ["scalar", "per_row"])
def test_temperature(temperature):
    rng = np.random.default_rng(3)
    t = 0.7 if temperature == "scalar" else rng.uniform(0.5, 1.5, (4, 6)).astype(np.float32)
    _check_ratio_kl(_case((4, 6), seed=3), "float32", temperature=t)


def _garbage_inactive_rows(c):
    """Make every inactive row hold NaN/+inf/-inf logits, NaN old_logps and bad ids."""
    off = ~c["mask"]
    fill = np.array([np.nan, np.inf, -np.inf])[np.arange(off.sum()) % 3]
    for key in ("policy", "ref"):
        c[key] = c[key].copy()
        c[key][off] = fill[:, None].astype(c[key].dtype)
    c["old"] = np.where(off, np.nan, c["old"]).astype(np.float32)
    odd = np.arange(off.size).reshape(off.shape) % 2 == 1
    c["ids"] = np.where(off, np.where(odd, -5, V + 3), c["ids"])
    c["g1"] = np.where(off, np.nan, c["g1"]).astype(np.float32)
    return c


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_inactive_rows_are_neutral_whatever_they_hold(dtype):
    c = _garbage_inactive_rows(_case((4, 6), dtype, seed=5, active=0.5))
    off = ~c["mask"]
    ratio, kl_val, grad = _ratio_kl_grad(c)
    assert np.all(np.asarray(ratio)[off] == 1.0) and np.all(np.asarray(kl_val)[off] == 0.0)
    assert np.all(_f64(grad)[off] == 0.0)
    assert np.all(np.isfinite(ratio)) and np.all(np.isfinite(_f64(grad)))
    logp = loss.selected_logprobs(c["policy"], c["ids"], c["mask"], backend="native")
    assert np.all(np.asarray(logp)[off] == 0.0)
    _check_ratio_kl(c, dtype)


def test_auto_backend_never_fails_for_want_of_a_gpu():
    c = _case((4, 6), seed=14)
    got = loss.selected_logprobs(c["policy"], c["ids"], c["mask"], backend="auto")
    want = spec.selected_logprobs(c["policy"], c["ids"], c["mask"])
    assert_close(got, want, spec.forward_tolerance(_scale(c["policy"])))
