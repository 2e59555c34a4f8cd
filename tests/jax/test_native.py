"""The native JAX backend against the float64 spec: values, gradients, edge rows, errors."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("lead", [(24,), (4, 6), (2, 3, 4)], ids=["N", "BT", "BTK"])
def test_selected_logprobs_matches_spec(dtype, lead):
    c = _case(lead, dtype)
    logp, vjp = jax.vjp(
        lambda x: loss.selected_logprobs(x, c["ids"], c["mask"], backend="native"),
        jnp.asarray(c["policy"]),
    )
    (grad,) = vjp(jnp.asarray(c["g1"]))
    want = spec.selected_logprobs(_f64(c["policy"]), c["ids"], c["mask"])
    want_grad = spec.selected_logprobs_grad(_f64(c["policy"]), c["ids"], c["mask"], c["g1"])
    scale = _scale(c["policy"])
    assert logp.dtype == jnp.float32 and logp.shape == lead
    assert grad.dtype == jnp.dtype(DTYPES[dtype])
    assert_close(logp, want, spec.forward_tolerance(scale))
    gscale = float(np.max(np.abs(want_grad)))
    assert_close(grad, want_grad, spec.grad_tolerance(dtype, scale, gscale))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_ratio_kl_matches_spec(dtype, kl):
    _check_ratio_kl(_case((4, 6), dtype, seed=1), dtype, kl=kl)


@pytest.mark.parametrize("lead", [(24,), (2, 3, 4)], ids=["N", "BTK"])
def test_ratio_kl_leading_shapes(lead):
    _check_ratio_kl(_case(lead, seed=2), "float32")


@pytest.mark.parametrize("temperature", ["scalar", "per_row"])
def test_temperature(temperature):
    rng = np.random.default_rng(3)
    t = 0.7 if temperature == "scalar" else rng.uniform(0.5, 1.5, (4, 6)).astype(np.float32)
    _check_ratio_kl(_case((4, 6), seed=3), "float32", temperature=t)


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_ref_logps_instead_of_ref_logits(kl):
    _check_ratio_kl(_case((4, 6), seed=4), "float32", kl=kl, use_ref_logps=True)


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


def test_nan_logit_poisons_only_its_row():
    c = _case((4, 6), seed=6, active=1.0)
    c["policy"][1, 2, 5] = np.nan
    ratio, kl_val, grad = _ratio_kl_grad(c)
    bad = np.zeros((4, 6), bool)
    bad[1, 2] = True
    assert np.all(np.isnan(ratio)[bad]) and np.all(np.isnan(kl_val)[bad])
    assert np.all(np.isnan(np.asarray(grad)[1, 2]))
    assert np.all(np.isfinite(ratio)[~bad]) and np.all(np.isfinite(np.asarray(grad)[~bad]))


def test_neg_inf_at_other_tokens_is_valid_masking():
    c = _case((4, 6), seed=7, active=1.0)
    others = np.arange(V)[None, None, :] != c["ids"][..., None]
    c["policy"] = np.where(others & (np.arange(V) % 3 == 0), -np.inf, c["policy"]).astype("f4")
    ratio, kl_val, grad = _ratio_kl_grad(c)
    assert np.all(np.isfinite(ratio)) and np.all(np.isfinite(kl_val))
    assert np.all(np.isfinite(np.asarray(grad)))
    _check_ratio_kl(c, "float32")


@pytest.mark.parametrize("bad_id", [-1, V])
def test_out_of_range_active_id_raises_naming_position(bad_id):
    c = _case((4, 6), seed=8, active=1.0)
    c["ids"][1, 2] = bad_id
    msg = re.escape(f"action_ids[1, 2] = {bad_id} is outside [0, {V})")
    with pytest.raises(ValueError, match=msg):
        loss.ratio_kl(c["policy"], c["ref"], c["ids"], c["mask"], c["old"], backend="native")
    with pytest.raises(ValueError, match=msg):
        loss.selected_logprobs(c["policy"], c["ids"], c["mask"], backend="native")


def test_check_ids_false_poisons_the_row_instead():
    c = _case((4, 6), seed=9, active=1.0)
    c["ids"][0, 1] = V + 7
    logp, vjp = jax.vjp(
        lambda x: loss.selected_logprobs(x, c["ids"], c["mask"], check_ids=False), c["policy"]
    )
    (grad,) = vjp(jnp.ones((4, 6), jnp.float32))
    nan_row = np.isnan(np.asarray(logp))
    assert nan_row[0, 1] and nan_row.sum() == 1
    assert np.all(np.isnan(np.asarray(grad)[0, 1]))
    assert np.all(np.isfinite(np.delete(np.asarray(grad).reshape(24, V), 1, axis=0)))


@pytest.mark.parametrize("lead", [(0,), (2, 0), (4, 6)], ids=["empty", "empty_BT", "inactive"])
def test_empty_and_all_inactive(lead):
    c = _case(lead, seed=10, active=0.0)

    @jax.jit  # one compile instead of one per eager op for these one-off shapes
    def run(policy, ref, ids, mask, old, g1, g2):
        f = lambda x: loss.ratio_kl(x, ref, ids, mask, old)  # noqa: E731
        (ratio, kl_val), vjp = jax.vjp(f, policy)
        return ratio, kl_val, vjp((g1, g2))[0]

    ratio, kl_val, grad = run(*(c[k] for k in ("policy", "ref", "ids", "mask", "old", "g1", "g2")))
    assert ratio.shape == kl_val.shape == lead and grad.shape == (*lead, V)
    assert np.all(np.asarray(ratio) == 1.0) and np.all(np.asarray(kl_val) == 0.0)
    assert np.all(np.asarray(grad) == 0.0)


def test_gradient_reaches_policy_logits_only():
    c = _case((4, 6), seed=11)
    t = np.full((4, 6), 0.9, np.float32)

    def total(policy, ref, old, temp):
        ratio, kl_val = loss.ratio_kl(policy, ref, c["ids"], c["mask"], old, temperature=temp)
        return jnp.sum(ratio) + jnp.sum(kl_val)

    grads = jax.grad(total, argnums=(0, 1, 2, 3))(c["policy"], c["ref"], c["old"], t)
    assert np.any(np.asarray(grads[0]) != 0.0)
    assert all(np.all(np.asarray(g) == 0.0) for g in grads[1:])
    ref_logps = jnp.zeros((4, 6))
    g_ref = jax.grad(
        lambda r: jnp.sum(loss.ratio_kl(c["policy"], None, c["ids"], c["mask"], c["old"],
                                        ref_logps=r)[1])
    )(ref_logps)
    assert np.all(np.asarray(g_ref) == 0.0)


def test_integer_mask_is_accepted():
    c = _case((4, 6), seed=12)
    want = loss.selected_logprobs(c["policy"], c["ids"], c["mask"])
    got = loss.selected_logprobs(c["policy"], c["ids"], c["mask"].astype(np.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


_BAD_ARGS = [
    ({"policy": np.zeros((4, 6, V), np.float64)}, TypeError, "`policy_logits` must be float32"),
    ({"policy": np.zeros((4, 6, 0), np.float32)}, ValueError, "`policy_logits` must have shape"),
    ({"ids": np.zeros((4, 6), np.float32)}, TypeError, "`action_ids` must be int32 or int64"),
    ({"ids": np.zeros((6, 4), np.int32)}, ValueError, "`action_ids` must have the logits'"),
    ({"mask": np.zeros((4, 6), np.float32)}, TypeError, "`mask` must be bool"),
    ({"mask": np.ones((2,), bool)}, ValueError, "`mask` must have the logits'"),
    ({"old": np.zeros((4, 6), np.int32)}, TypeError, "`old_logps` must be a floating"),
    ({"old": [0.0]}, TypeError, "`old_logps` must be a jax.Array"),
    ({"ref": np.zeros((4, 6, V + 1), np.float32)}, ValueError, "`ref_logits` must have the shape"),
    ({"ref": None}, ValueError, "pass exactly one of `ref_logits`"),
    ({"temperature": 0.0}, ValueError, "`temperature` must be a positive finite"),
    ({"temperature": float("nan")}, ValueError, "`temperature` must be a positive finite"),
    ({"temperature": np.ones((2,), np.float32)}, ValueError, "`temperature` must have the"),
    ({"temperature": "1"}, TypeError, "`temperature` must be a Python float"),
    ({"kl_estimator": "k4"}, ValueError, "`kl_estimator` must be one of"),
    ({"backend": "cuda"}, ValueError, "`backend` must be one of"),
    ({"backend": "triton"}, ValueError, "backend='triton' needs a GPU"),
    ({"check_ids": 1}, TypeError, "`check_ids` must be a Python bool"),
]


@pytest.mark.parametrize("change, error, message", _BAD_ARGS, ids=[m for _, _, m in _BAD_ARGS])
def test_validation_errors_name_the_argument(change, error, message):
    if change.get("backend") == "triton" and jax.default_backend() == "gpu":
        pytest.skip("triton may run on a GPU")
    c = {**_case((4, 6), seed=13), **change}
    opts = {k: c[k] for k in ("temperature", "kl_estimator", "backend", "check_ids") if k in c}
    with pytest.raises(error, match=re.escape(message)):
        loss.ratio_kl(c["policy"], c["ref"], c["ids"], c["mask"], c["old"], **opts)


def test_auto_backend_never_fails_for_want_of_a_gpu():
    c = _case((4, 6), seed=14)
    got = loss.selected_logprobs(c["policy"], c["ids"], c["mask"], backend="auto")
    want = spec.selected_logprobs(c["policy"], c["ids"], c["mask"])
    assert_close(got, want, spec.forward_tolerance(_scale(c["policy"])))
