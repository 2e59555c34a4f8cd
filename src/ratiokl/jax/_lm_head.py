"""The linear ops' own GEMMs (JAX): a row chunk's logits from hidden states, their gradients.

The transform is ``ratiokl.spec.linear``'s (``x = softcap((h @ W.T + b) * scale)``, slope
``scale * (1 - (x / softcap)^2)``), applied in float32 to the GEMM's float32 result and
rounded once to the weight's dtype (XLA fuses the elementwise steps into the GEMM's
consumer). The rounding is a ``reduce_precision``: on the GPU, XLA may drop a float32 ->
bfloat16 -> float32 round trip inside a fusion (excess precision), which gave one consumer
(the entropy) unrounded logits beside another's (the log-prob) rounded ones (a float16
logit below 2^-14 in magnitude, a subnormal, becomes 0). Every ``dot_general`` here runs
at ``Precision.HIGHEST`` with float32 accumulation: float32 inputs get float32 GEMMs
whatever JAX's default matmul precision (TF32-class on GPUs), as the PyTorch op's
(``ratiokl.torch._lm_head.ieee_fp32``).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.jax._vocab_parallel import varying_axes
from ratiokl.spec import LogitTransform, transform_logits, transform_slope

__all__ = ["head_grads", "head_logits", "matmul", "vary_alike"]


def matmul(a: jax.Array, b: jax.Array, contract: Tuple[int, int]) -> jax.Array:
    """float32 ``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``
    (2-d operands), at ``Precision.HIGHEST``."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def _logits(kept: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
            transform: LogitTransform) -> jax.Array:
    u = matmul(kept, weight, (1, 1))
    if bias is not None:
        u = u + bias.astype(jnp.float32)
    x = transform_logits(u, transform, jnp.tanh)
    if weight.dtype != jnp.float32:
        info = jnp.finfo(weight.dtype)
        x = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(weight.dtype)


def vary_alike(hidden: jax.Array, weight: jax.Array, bias: Optional[jax.Array], *others):
    """``hidden``, ``weight`` and ``bias`` typed as varying over every mesh axis that any
    argument varies over (inside ``shard_map``; nothing changes outside it). Their
    gradients, sums over rows and vocabulary, vary over all of them; JAX transposes each
    ``pcast`` into the ``psum`` over the axes the input did not vary over: the whole
    ``d hidden`` of replicated hidden states over a vocabulary-sharded head, the whole
    ``d weight`` of a weight replicated over data-parallel rows."""
    arrays = (hidden, weight, bias)
    axes = frozenset().union(*(varying_axes(x) for x in arrays + others if x is not None))
    return tuple(x if x is None or axes <= varying_axes(x) else
                 lax.pcast(x, tuple(sorted(axes - varying_axes(x))), to="varying")
                 for x in arrays)


def head_logits(kept: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
                transform: LogitTransform) -> jax.Array:
    """``x = softcap((kept @ weight.T + bias) * scale)`` ``[C, V]`` in the weight's dtype
    (``kept`` has inactive rows zeroed already). Differentiable, through :func:`head_grads`
    (float32 accumulation): JAX's own transpose of a half-precision ``dot_general``
    accumulates ``d hidden`` in that precision (over the whole vocabulary: a float16
    ``d hidden`` 20 % off at V = 262,144 on the native route). Inside ``shard_map`` the
    three are cast alike first (:func:`vary_alike`), so each gradient is typed as its
    input."""
    return _head_logits(*vary_alike(kept, weight, bias), transform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_logits(kept, weight, bias, transform: LogitTransform) -> jax.Array:
    return _logits(kept, weight, bias, transform)


def _head_logits_fwd(kept, weight, bias, transform):
    x = _logits(kept, weight, bias, transform)
    return x, (kept, weight, bias, x if transform.softcap is not None else None)


def _head_logits_bwd(transform, residuals, dx):
    kept, weight, bias, x = residuals
    dh, dw, db = head_grads(dx, x, kept, weight, transform)
    return (dh.astype(kept.dtype), dw.astype(weight.dtype),
            None if bias is None else db.astype(bias.dtype))


_head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def head_grads(dx: jax.Array, x: Optional[jax.Array], kept: jax.Array, weight: jax.Array,
               transform: LogitTransform) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """float32 ``(du @ weight, du.T @ kept, column sums of du)`` with ``du = dx *
    slope(x)`` (``dx = d / d x`` ``[C, V]``; ``x`` may be None without a softcap), ``du``
    rounded to the weight's dtype for the GEMMs as the PyTorch op's."""
    du = dx.astype(jnp.float32) * transform_slope(
        None if x is None else x.astype(jnp.float32), transform)
    du_k = du.astype(weight.dtype)
    return matmul(du_k, weight, (1, 0)), matmul(du_k, kept, (0, 0)), jnp.sum(du, axis=0)
