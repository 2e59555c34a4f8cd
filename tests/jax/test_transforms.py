"""``ratiokl.jax.loss`` under the transforms JAX trainers use: jit, grad, vjp, vmap, checkify."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from ratiokl import spec
from ratiokl.jax import loss
from assertions import assert_close  # noqa: E402

jax.config.update("jax_enable_x64", False)

V = 11
LEAD = (4, 6)
ARGS = ("policy", "ref", "ids", "mask", "old")


def _case(lead=LEAD, seed=0, active=0.7):
    rng = np.random.default_rng(seed)
    return {
        "policy": rng.normal(scale=3.0, size=(*lead, V)).astype(np.float32),
        "ref": rng.normal(scale=3.0, size=(*lead, V)).astype(np.float32),
        "ids": rng.integers(0, V, size=lead).astype(np.int32),
        "mask": rng.random(lead) < active,
        "old": rng.normal(size=lead).astype(np.float32) - 3.0,
        "temperature": rng.uniform(0.5, 1.5, size=lead).astype(np.float32),
        "g1": rng.normal(size=lead).astype(np.float32),
        "g2": rng.normal(size=lead).astype(np.float32),
    }


def _scale(c):
    """Largest scaled logit ``|logits / T|`` of the case (sets the tolerances)."""
    return float(np.max(np.abs(c["policy"] / c["temperature"][..., None])))


def _grad_tol(c, want):
    return spec.grad_tolerance("float32", _scale(c), float(np.max(np.abs(want))))


def _ratio_kl_vjp(policy, ref, ids, mask, old, temperature, g1, g2, kl_estimator="k3"):
    """``(ratio, kl, grad)`` with cotangents ``(g1, g2)``; every option a closed-over value."""
    f = lambda x: loss.ratio_kl(  # noqa: E731
        x, ref, ids, mask, old, kl_estimator=kl_estimator, temperature=temperature
    )
    (ratio, kl), vjp = jax.vjp(f, policy)
    return ratio, kl, vjp((g1, g2))[0]


def _spec_ratio_kl(c, kl_estimator="k3"):
    args = tuple(c[k] for k in ARGS)
    opts = dict(kl_estimator=kl_estimator, temperature=c["temperature"])
    ratio, kl = spec.ratio_kl(*args, **opts)
    return ratio, kl, spec.ratio_kl_grad(*args, c["g1"], c["g2"], **opts)


def test_jit_with_closed_over_options_traces_once():
    traces = []

    def f(*args):
        traces.append(1)
        return loss.ratio_kl(*args, kl_estimator="k2")

    jitted = jax.jit(f)
    for seed in (0, 1):
        c = _case(seed=seed)
        ratio, kl = jitted(*(c[k] for k in ARGS))
        want_ratio, want_kl = spec.ratio_kl(*(c[k] for k in ARGS), kl_estimator="k2")
        tol = spec.forward_tolerance(float(np.max(np.abs(c["policy"]))))
        assert_close(ratio, want_ratio, tol)
        assert_close(kl, want_kl, tol)
    assert len(traces) == 1


def test_jit_of_grad_matches_spec():
    c = _case(seed=2)

    def total(policy, ref, ids, mask, old, temperature):
        ratio, kl = loss.ratio_kl(policy, ref, ids, mask, old, temperature=temperature)
        return jnp.sum(ratio) + jnp.sum(kl)

    grad = jax.jit(jax.grad(total))(*(c[k] for k in ARGS), c["temperature"])
    ones = np.ones(LEAD, np.float32)
    want = spec.ratio_kl_grad(
        *(c[k] for k in ARGS), ones, ones, temperature=c["temperature"]
    )
    assert_close(grad, want, _grad_tol(c, want))


@pytest.mark.parametrize("kl_estimator", ["k1", "k3"])
def test_vjp_with_non_unit_cotangents_under_jit(kl_estimator):
    c = _case(seed=3)
    run = jax.jit(lambda *a: _ratio_kl_vjp(*a, kl_estimator=kl_estimator))
    got = run(*(c[k] for k in (*ARGS, "temperature", "g1", "g2")))
    want = _spec_ratio_kl(c, kl_estimator)
    tol = spec.forward_tolerance(_scale(c))
    assert_close(got[0], want[0], tol)
    assert_close(got[1], want[1], tol)
    assert_close(got[2], want[2], _grad_tol(c, want[2]))


def test_selected_logprobs_vjp_under_jit():
    c = _case(seed=4)

    @jax.jit
    def run(logits, ids, temperature, g):
        f = lambda x: loss.selected_logprobs(x, ids, temperature=temperature)  # noqa: E731
        logp, vjp = jax.vjp(f, logits)
        return logp, vjp(g)[0]

    logp, grad = run(c["policy"], c["ids"], c["temperature"], c["g1"])
    opts = dict(temperature=c["temperature"])
    tol = spec.forward_tolerance(_scale(c))
    assert_close(logp, spec.selected_logprobs(c["policy"], c["ids"], None, **opts), tol)
    want = spec.selected_logprobs_grad(c["policy"], c["ids"], None, c["g1"], **opts)
    assert_close(grad, want, _grad_tol(c, want))


def test_vmap_over_an_extra_axis_equals_unbatched():
    cases = [_case(seed=s) for s in (5, 6, 7)]
    keys = (*ARGS, "temperature", "g1", "g2")
    stacked = [np.stack([c[k] for c in cases]) for k in keys]
    batched = jax.jit(jax.vmap(_ratio_kl_vjp))(*stacked)
    unbatched = jax.jit(_ratio_kl_vjp)
    for i, c in enumerate(cases):
        ratio, kl, grad = unbatched(*(c[k] for k in keys))
        tol = spec.forward_tolerance(_scale(c))
        assert_close(batched[0][i], np.asarray(ratio), tol)
        assert_close(batched[1][i], np.asarray(kl), tol)
        assert_close(batched[2][i], np.asarray(grad), _grad_tol(c, np.asarray(grad)))


def _bad_id_case():
    c = _case(seed=8, active=1.0)
    c["ids"][2, 3] = V + 4
    return c


def test_checkify_raises_on_bad_active_id_under_jit():
    c = _bad_id_case()
    args = tuple(c[k] for k in ARGS)
    msg = re.escape(f"action_ids[2, 3] = {V + 4} is outside [0, {V})")
    outer, inner = checkify.checkify(jax.jit(loss.ratio_kl)), jax.jit(checkify.checkify(loss.ratio_kl))
    for wrapped in (outer, inner):
        err, _ = wrapped(*args)
        with pytest.raises(checkify.JaxRuntimeError, match=msg):
            err.throw()
    c["ids"][2, 3] = 0
    err, _ = checkify.checkify(jax.jit(loss.ratio_kl))(*(c[k] for k in ARGS))
    assert err.get() is None


def test_plain_jit_poisons_only_the_bad_row():
    c = _bad_id_case()
    ratio, kl, grad = jax.jit(_ratio_kl_vjp)(*(c[k] for k in (*ARGS, "temperature", "g1", "g2")))
    bad = np.zeros(LEAD, bool)
    bad[2, 3] = True
    for out in (ratio, kl):
        assert np.all(np.isnan(np.asarray(out)) == bad)
    assert np.all(np.isnan(np.asarray(grad)).any(axis=-1) == bad)


def test_bitwise_deterministic_on_repeat():
    c = _case(seed=9)
    args = tuple(c[k] for k in (*ARGS, "temperature", "g1", "g2"))
    for fn in (_ratio_kl_vjp, jax.jit(_ratio_kl_vjp)):
        first = [np.asarray(x).tobytes() for x in fn(*args)]
        second = [np.asarray(x).tobytes() for x in fn(*(np.copy(a) for a in args))]
        assert first == second


def test_jit_closing_over_concrete_ids_still_checks_on_the_host():
    c = _bad_id_case()
    ids, mask = jnp.asarray(c["ids"]), jnp.asarray(c["mask"])
    f = jax.jit(lambda x: loss.selected_logprobs(x, ids, mask))
    with pytest.raises(ValueError, match=re.escape(f"action_ids[2, 3] = {V + 4}")):
        f(c["policy"])
