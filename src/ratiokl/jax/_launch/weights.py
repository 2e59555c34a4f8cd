"""The token-mean aggregation weights' launch (and its framework twin, for ``vmap``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ratiokl._kernels import loss_rows as row_kernels
from ratiokl.jax._launch.vmap import TritonCall, mapped

__all__ = ["native_weights", "weights_op"]


def native_weights(denom: float, count: bool, mask: jax.Array) -> jax.Array:
    """``where(mask, 1 / D, 0)``, ``D`` the active count (at least 1) or ``denom``: what
    ``_objective.aggregation_weights`` computes where every active token weighs the same."""
    d = jnp.maximum(jnp.sum(mask, dtype=jnp.int32), 1) if count else denom
    return jnp.where(mask, 1.0 / d, 0.0).astype(jnp.float32)


def _weights_call(call: TritonCall, mask: jax.Array) -> jax.Array:
    """``token_weights_kernel``: ``D`` the active count."""
    if not mask.size:
        return jnp.zeros(mask.shape, jnp.float32)
    w = call(
        mask.reshape(-1), kernel=row_kernels.token_weights_kernel,
        out_shape=jax.ShapeDtypeStruct((mask.size,), jnp.float32), grid=(1,),
        num_warps=row_kernels.ROWS_WARPS, N=mask.size, BLOCK=row_kernels.ROWS_BLOCK,
    )
    return w.reshape(mask.shape)


@functools.lru_cache(maxsize=None)
def weights_op(call: TritonCall) -> Callable:
    """The token-mean weights through ``call`` (see :func:`_weights_call`); vmapped: the
    framework ops."""
    op = jax.custom_batching.custom_vmap(functools.partial(_weights_call, call))
    op.def_vmap(functools.partial(mapped, functools.partial(native_weights, 1.0, True)))
    return op
