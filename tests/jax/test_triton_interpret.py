"""The JAX binding of the Triton kernels (``ratiokl.jax._triton``) through Triton's CPU
interpreter (JAX's ``backend="interpret"``): ``ratio_kl`` under ``jit``, ``vmap`` and
``grad`` against the float64 spec, and the log-probs bit for bit against the PyTorch
launch of the same kernel (the cases of ``tests/helpers/ratio_kl_cases.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from assertions import assert_close  # noqa: E402
from ratio_kl_cases import Case  # noqa: E402

from ratiokl import spec  # noqa: E402
from ratiokl.torch import _triton  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_wrapper_jit_vmap_grad(dtype):
    from ratiokl.jax import loss as jax_loss

    case = Case(6, 45, dtype, seed=21)
    case.temperature = 1.3
    x = jnp.asarray(case.np(case.policy).reshape(2, 3, 45), dtype=jnp.dtype(dtype))
    r = jnp.asarray(case.np(case.ref).reshape(2, 3, 45), dtype=jnp.dtype(dtype))
    rows = [jnp.asarray(t.numpy().reshape(2, 3)) for t in
            (case.ids, case.mask, case.old, case.g_ratio, case.g_kl)]
    ids, mask, old, g_ratio, g_kl = rows

    def per_sequence(x, r, ids, mask, old):
        return jax_loss.ratio_kl(x, r, ids, mask, old, kl_estimator="k3", temperature=1.3,
                                 backend="interpret", check_ids=False)

    def objective(x):
        ratio, kl = jax.vmap(per_sequence)(x, r, ids, mask, old)
        return jnp.sum(ratio * g_ratio + kl * g_kl), (ratio, kl)

    grad, (ratio, kl) = jax.jit(jax.grad(objective, has_aux=True))(x)
    assert grad.dtype == x.dtype
    e_ratio, e_kl, e_grad = case.expected(True, 3)
    fwd = spec.forward_tolerance(case.scale())
    assert_close(np.asarray(ratio).reshape(-1), e_ratio, fwd, "ratio")
    assert_close(np.asarray(kl).reshape(-1), e_kl, fwd, "kl")
    assert_close(np.asarray(grad, np.float32).reshape(6, 45), e_grad,
                  spec.grad_tolerance(dtype, case.scale(), np.abs(e_grad).max()), "grad")


def test_jax_wrapper_matches_torch_bitwise():
    from ratiokl.jax import loss as jax_loss

    case = Case(5, 30, "float32", seed=22)
    case.ids[2] = 99  # unchecked bad id: NaN in both
    torch_logp = _triton.selected_logprobs(case.policy, case.ids, case.mask, 0.7)
    jax_logp = jax.jit(lambda x: jax_loss.selected_logprobs(
        x, jnp.asarray(case.ids.numpy()), jnp.asarray(case.mask.numpy()), temperature=0.7,
        backend="interpret", check_ids=False))(jnp.asarray(case.policy.numpy()))
    assert np.isnan(np.asarray(jax_logp)[2])
    np.testing.assert_array_equal(np.asarray(jax_logp), torch_logp.numpy())
