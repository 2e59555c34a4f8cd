"""JAX ``policy_loss`` coefficients as traced 0-d arrays: the numbers' bits, one trace.

An adaptive KL controller hands ``kl_coef`` (and a schedule the clip bounds or
``entropy_coef``) to a jitted step as an array: new values must neither retrace nor change
what a Python number gives. On the Triton backends the fused kernel reads
them as run-time data (on a CPU: ``backend="interpret"``).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import harness, spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

B, T, V = 2, 5, 23

#: Inactive rows hold data the kernels never use; the interpreter's numpy warns on it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(B, T, V)) * 2, jnp.float32),
            jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32),
            jnp.asarray(rng.integers(0, V, (B, T))), jnp.asarray(rng.random((B, T)) < 0.8),
            jnp.asarray(rng.normal(size=(B, T)) * 0.3 - 3.0, jnp.float32),
            jnp.asarray(rng.normal(size=(B, T)), jnp.float32))


def test_traced_coefficients_match_numbers_in_one_trace(jax_target: str) -> None:
    backend = harness.TARGETS[jax_target].backend
    x = _inputs(0)
    traces = []

    def step(logits, ref, ids, mask, old, adv, kl_coef, clip_eps, entropy_coef):
        traces.append(1)
        value, metrics = loss.policy_loss(logits, ref, ids, mask, old, adv, kl_coef=kl_coef,
                                          clip_eps=clip_eps, dual_clip=3.0,
                                          entropy_coef=entropy_coef, backend=backend,
                                          check_ids=False)
        return value, (metrics["clip_fraction"], metrics["entropy_mean"])

    grad_step = jax.jit(jax.value_and_grad(step, has_aux=True))
    for coefs in ((0.0, 0.2, 0.0), (0.05, 0.1, 0.01), (0.3, 0.25, -0.2)):
        (value, (clip, ent)), grad = grad_step(*x, *map(jnp.float32, coefs))
        (want, (want_clip, want_ent)), want_grad = jax.value_and_grad(
            lambda p: step(p, *x[1:], *coefs), has_aux=True)(x[0])
        loss_tol = spec.paths_tolerance(B * T)  # jit: XLA's order
        assert_close(value, want, loss_tol, "loss")
        assert float(clip) == float(want_clip) and float(want_ent) > 0
        assert_close(ent, want_ent, loss_tol, "entropy_mean")
        grad_tol = spec.paths_tolerance(V, float(jnp.max(jnp.abs(want_grad))))
        assert_close(grad, want_grad, grad_tol, "grad")
    assert len(traces) == 1 + 3  # one trace of the jitted step, one per eager reference