"""JAX's array adapter for the framework-neutral core (:mod:`ratiokl._core`).

:data:`XP` offers the operations the core's docstring lists, as ``jnp`` / ``lax`` ops
(traceable under ``jit``, ``grad``, ``vmap`` and ``shard_map``).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["XP"]


class _Jax:
    """The adapter (static methods only: one shared instance, :data:`XP`)."""

    where = staticmethod(jnp.where)
    exp = staticmethod(jnp.exp)
    expm1 = staticmethod(jnp.expm1)
    isinf = staticmethod(jnp.isinf)
    stack = staticmethod(jnp.stack)
    zeros_like = staticmethod(jnp.zeros_like)
    ones_like = staticmethod(jnp.ones_like)
    broadcast_to = staticmethod(jnp.broadcast_to)
    maximum = staticmethod(jnp.maximum)
    clip = staticmethod(jnp.clip)
    stop_gradient = staticmethod(lax.stop_gradient)

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        return jnp.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def count(mask):
        return jnp.sum(mask, dtype=jnp.int32)

    @staticmethod
    def as_float(x):
        return jnp.asarray(x, jnp.float32)

    @staticmethod
    def as_index(x):
        return jnp.asarray(x, jnp.int32)

    @staticmethod
    def positions(like):
        return jnp.broadcast_to(jnp.arange(like.shape[-1], dtype=jnp.int32), like.shape)

    @staticmethod
    def cummax(x):
        return lax.cummax(x, axis=x.ndim - 1)

    @staticmethod
    def reverse_cummin(x):
        return lax.cummin(x, axis=x.ndim - 1, reverse=True)

    @staticmethod
    def shift(x, step: int, fill):
        pad = jnp.full(x.shape[:-1] + (abs(step),), fill, dtype=x.dtype)
        if step > 0:
            return jnp.concatenate([pad, x[..., :-step]], axis=-1)
        return jnp.concatenate([x[..., -step:], pad], axis=-1)

    @staticmethod
    def take(x, index):
        return jnp.take_along_axis(x, index, axis=-1)


XP = _Jax()
