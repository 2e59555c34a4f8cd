"""The fused ``policy_loss`` kernel's JAX launch through Triton's CPU interpreter.

``backend="interpret"`` in JAX runs ``ratiokl.jax._triton_loss.policy_loss``'s launches through
the interpreter behind ``jax.pure_callback``: against the PyTorch launch of the same
kernel (``tests/torch/test_fused_loss_interpret.py``, the cases of
``tests/helpers/fused_loss_cases.py``) under ``jit``, ``grad`` and ``vmap``, a primal
that skips the gradient, and the in-place gradient aliasing the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from assertions import assert_close  # noqa: E402
from fused_loss_cases import LOSS_TOL, V, inputs, options, torch_call  # noqa: E402
from ratiokl import spec  # noqa: E402


def _fused_launches(launches):
    """The recorded launches of the fused kernel (not the backward's scale)."""
    return [launch for launch in launches if launch.kernel == "policy_loss_kernel"]


def test_jax_fused_launch_matches_torch_under_jit_grad_vmap():
    from ratiokl.jax import loss as jax_loss

    case = dict(clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.1,
                loss_agg="seq-mean-token-mean", packed=True)
    x = inputs(13, case)
    kwargs = options(case)
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits, ref, ids, mask, old, adv, segs):
        value, metrics = jax_loss.policy_loss(
            logits, ref, ids, mask, old, adv, segment_ids=segs, backend="interpret",
            check_ids=False, **kwargs)
        return -2.5 * value, metrics

    args = (j["policy_logits"], j["ref_logits"], j["action_ids"], j["mask"],
            j["old_logps"], j["advantages"], j["segment_ids"])
    (value, metrics), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(*args)
    t_loss, t_metrics, t_grad = torch_call(x, case, "interpret", -2.5)
    assert_close(value, -2.5 * t_loss, LOSS_TOL, "loss")
    for key, v in t_metrics.items():
        assert_close(metrics[key], v, LOSS_TOL, key)
    grad_tol = spec.paths_tolerance(V, float(t_grad.abs().max()))
    assert_close(grad, t_grad, grad_tol, "grad")
    assert np.all(np.asarray(grad)[~x["mask"]] == 0.0)
    # vmap over a batch of two problems folds into rows: each equals its own call.
    stacked = [jnp.stack([a, a]) for a in args]
    batched = jax.vmap(jax.grad(lambda *a: objective(*a)[0]))(*stacked)
    assert_close(batched[1], grad, grad_tol, "vmapped grad")


def test_jax_primal_reads_once_and_matches_value_and_grad():
    from ratiokl.jax import _interpret
    from ratiokl.jax import loss as jax_loss

    x = inputs(29, {})
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits):
        return jax_loss.policy_loss(logits, None, j["action_ids"], j["mask"], j["old_logps"],
                                    j["advantages"], backend="interpret", check_ids=False)[0]

    with _interpret.recording() as launches:
        primal = jax.block_until_ready(jax.jit(objective)(j["policy_logits"]))
        value, grad = jax.block_until_ready(
            jax.jit(jax.value_and_grad(objective))(j["policy_logits"]))
    written = [launch.constants["WRITE_GRAD"] for launch in _fused_launches(launches)]
    assert written == [False, True]
    assert float(primal) == float(value)
    assert np.all(np.asarray(grad)[~x["mask"]] == 0.0)


def test_jax_inplace_grad_aliases_the_logits_and_matches():
    from ratiokl.jax import _interpret
    from ratiokl.jax import loss as jax_loss

    x = inputs(43, {})
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits, inplace):
        return -1.5 * jax_loss.policy_loss(
            logits, None, j["action_ids"], j["mask"], j["old_logps"], j["advantages"],
            backend="interpret", check_ids=False, inplace_grad=inplace)[0]

    with _interpret.recording() as launches:
        want = jax.block_until_ready(
            jax.jit(jax.value_and_grad(lambda p: objective(p, False)))(j["policy_logits"]))
        got = jax.block_until_ready(
            jax.jit(jax.value_and_grad(lambda p: objective(p, True)), donate_argnums=0)(
                jnp.array(j["policy_logits"])))
    aliases = [launch.aliases for launch in _fused_launches(launches)]
    assert aliases == [{}, {0: 6}]  # the gradient: after the six per-row outputs
    assert float(got[0]) == float(want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
