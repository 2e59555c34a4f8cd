"""JAX ``selected_logprobs(return_entropy=True)`` under ``jit`` and ``vmap``, every backend.

On the Triton backends (on a CPU: ``backend="interpret"``) a vmapped call folds the
batch into rows, so each problem's results must be those of its own call, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import harness, spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

B, T, V = 2, 4, 37

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _grad_tol(x, temp, want):
    """The float32 logit gradient against the spec at the scaled logits' magnitude."""
    finite = np.where(np.isfinite(x["logits"]), np.abs(x["logits"]), 0.0)
    scale = float(finite.max() / np.min(np.asarray(temp)))
    return spec.grad_tolerance("float32", scale, float(np.abs(want).max()))


def _problems():
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 2.0, (2, B, T, V)).astype(np.float32)
    mask = rng.random((2, B, T)) < 0.7
    logits[0, 0, 1, :5] = -np.inf  # vocabulary masking on an active row
    mask[0, 0, 1] = True
    logits[~mask] = np.nan
    ids = np.where(mask, rng.integers(5, V, (2, B, T)), -1)
    temp = rng.uniform(0.5, 1.5, (2, B, T)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (logits, ids, mask, temp))


def test_vmapped_jit_entropy_and_gradient_are_each_problems_own(jax_target):
    backend = harness.TARGETS[jax_target].backend

    def value_and_grad(logits, ids, mask, temp):
        def f(z):
            logp, ent = loss.selected_logprobs(z, ids, mask, temperature=temp,
                                               backend=backend, check_ids=False,
                                               return_entropy=True)
            return jnp.sum(0.5 * logp - 1.5 * ent), (logp, ent)

        (_, outs), grad = jax.value_and_grad(f, has_aux=True)(logits)
        return outs, grad

    problems = _problems()
    (logp, ent), grad = jax.jit(jax.vmap(value_and_grad))(*problems)
    for i in range(2):
        (logp_i, ent_i), grad_i = jax.jit(value_and_grad)(*(p[i] for p in problems))
        for got, want in ((logp[i], logp_i), (ent[i], ent_i), (grad[i], grad_i)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    mask = np.asarray(problems[2])
    g = np.asarray(grad)
    assert np.all(g[~mask] == 0.0) and np.all(np.isfinite(g[mask]))
    assert np.all(np.asarray(ent)[~mask] == 0.0) and np.all(np.asarray(ent)[mask] > 0.0)


def test_the_backward_has_an_entropy_term_only_where_the_entropy_is_differentiated():
    """Two-pass ``policy_loss`` (GSPO) always computes the entropy for ``entropy_mean``; its
    backward kernel gets the entropy term only with a coefficient (a symbolic-zero
    cotangent otherwise), and ``selected_logprobs`` differentiated through the entropy alone
    drops the log-prob term. Gradients match the spec either way."""
    reason = harness.target_status("jax-interpret")
    if reason:
        pytest.skip(reason)
    from ratiokl.jax import _interpret

    def backward_flags(launches):
        return [(launch.constants["HAS_G_LOGP"], launch.constants["ENTROPY"])
                for launch in launches if launch.kernel == "logp_backward_kernel"]

    logits, ids, mask, temp = (p[0] for p in _problems())
    rng = np.random.default_rng(5)
    old = jnp.asarray(rng.normal(-3.0, 0.5, mask.shape), jnp.float32)
    adv = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
    x = {k: np.asarray(v) for k, v in dict(logits=logits, ids=ids, mask=mask, old=old,
                                           adv=adv).items()}
    for coef in (0.0, 0.2):
        options = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean",
                       entropy_coef=coef)
        with _interpret.recording() as launches:
            grad = jax.grad(lambda z: loss.policy_loss(z, None, ids, mask, old, adv,
                                                       backend="interpret", check_ids=False,
                                                       **options)[0])(logits)
            jax.block_until_ready(grad)
        assert backward_flags(launches) == [(True, coef != 0.0)], (coef, launches)
        want = spec.policy_loss_grad(x["logits"], None, x["ids"], x["mask"], x["old"],
                                     x["adv"], **options)
        assert_close(grad, want, _grad_tol(x, temp, want), "grad")
    with _interpret.recording() as launches:
        grad = jax.grad(lambda z: jnp.sum(loss.selected_logprobs(
            z, ids, mask, temperature=temp, backend="interpret", check_ids=False,
            return_entropy=True)[1]))(logits)
        jax.block_until_ready(grad)
    assert backward_flags(launches) == [(False, True)], launches
    want = spec.entropy_grad(x["logits"], x["mask"], np.ones(mask.shape),
                             temperature=np.asarray(temp))
    assert_close(grad, want, _grad_tol(x, temp, want), "entropy grad")
