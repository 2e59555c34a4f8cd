"""The linear ops' own GEMMs (JAX): a row chunk's logits from hidden states, their gradients.

The transform is ``ratiokl.spec.linear``'s (``x = softcap((h @ W.T + b) * scale)``, slope
``scale * (1 - (x / softcap)^2)``), applied in float32 to the GEMM's float32 result and
rounded once to the weight's dtype (XLA fuses the elementwise steps into the GEMM's
consumer). Every ``dot_general`` here runs at ``Precision.HIGHEST`` with float32
accumulation: float32 inputs get float32 GEMMs whatever JAX's default matmul precision
(TF32-class on GPUs), as the PyTorch op's (``ratiokl.torch._lm_head.ieee_fp32``).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.spec import LogitTransform, transform_logits, transform_slope

__all__ = ["head_grads", "head_logits", "matmul"]


def matmul(a: jax.Array, b: jax.Array, contract: Tuple[int, int]) -> jax.Array:
    """float32 ``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``
    (2-d operands), at ``Precision.HIGHEST``."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def head_logits(kept: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
                transform: LogitTransform) -> jax.Array:
    """``x = softcap((kept @ weight.T + bias) * scale)`` ``[C, V]`` in the weight's dtype
    (differentiable; ``kept`` has inactive rows zeroed already)."""
    u = matmul(kept, weight, (1, 1))
    if bias is not None:
        u = u + bias.astype(jnp.float32)
    return transform_logits(u, transform, jnp.tanh).astype(weight.dtype)


def head_grads(dx: jax.Array, x: jax.Array, kept: jax.Array, weight: jax.Array,
               transform: LogitTransform) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """float32 ``(du @ weight, du.T @ kept, column sums of du)`` with ``du = dx *
    slope(x)`` (``dx = d / d x`` ``[C, V]``), ``du`` rounded to the weight's dtype for the
    GEMMs as the PyTorch op's."""
    du = dx.astype(jnp.float32) * transform_slope(x.astype(jnp.float32), transform)
    du_k = du.astype(weight.dtype)
    return matmul(du_k, weight, (1, 0)), matmul(du_k, kept, (0, 0)), jnp.sum(du, axis=0)
