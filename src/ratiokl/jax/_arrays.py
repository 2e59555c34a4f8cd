"""JAX's array adapter for the framework-neutral core (:mod:`ratiokl._core`).

:data:`XP` offers the operations the core's docstring lists, as ``jnp`` / ``lax`` ops
(traceable under ``jit``, ``grad``, ``vmap`` and ``shard_map``), and the route's hooks
(:mod:`ratiokl._core.route`) and validation's questions (:mod:`ratiokl._core.checks`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ratiokl.jax._lm_head import head_logits
from ratiokl.spec import LOGIT_DTYPE_NAMES

__all__ = ["XP", "XP64"]


class _Jax:
    """The adapter, one instance per compute dtype: :data:`XP` (float32, every logits dtype
    but float64) and :data:`XP64` (float64 logits or log-probs under ``jax_enable_x64``, the
    native backend); :meth:`for_dtype` picks one from an input's dtype."""

    def __init__(self, float_dtype) -> None:
        #: The dtype ``as_float`` and ``flat`` give: the op's compute dtype.
        self.float_dtype = float_dtype

    @staticmethod
    def for_dtype(dtype) -> "_Jax":
        """:data:`XP64` for float64 inputs, else :data:`XP` (float32 math)."""
        return XP64 if dtype == jnp.float64 else XP

    where = staticmethod(jnp.where)
    exp = staticmethod(jnp.exp)
    expm1 = staticmethod(jnp.expm1)
    exp_temporary = staticmethod(jnp.exp)  # XLA reuses the buffer itself
    sub_temporary = staticmethod(jnp.subtract)
    isinf = staticmethod(jnp.isinf)
    stack = staticmethod(jnp.stack)
    zeros_like = staticmethod(jnp.zeros_like)
    ones_like = staticmethod(jnp.ones_like)
    broadcast_to = staticmethod(jnp.broadcast_to)
    maximum = staticmethod(jnp.maximum)
    maximum_temporary = staticmethod(jnp.maximum)
    clip = staticmethod(jnp.clip)
    stop_gradient = staticmethod(lax.stop_gradient)
    isfinite = staticmethod(jnp.isfinite)
    log = staticmethod(jnp.log)

    @staticmethod
    def max(x, axis):
        return jnp.max(x, axis=axis)

    @staticmethod
    def exp_sums(d):
        # Two passes, the second over p = exp(d - log s): in a whole jitted policy_loss
        # XLA's CPU backend ran one pass (sibling or variadic sums of one exp) slower.
        s = jnp.sum(jnp.exp(d), axis=-1)
        p = jnp.exp(d - jnp.log(s)[..., None])
        return s, s * jnp.sum(p * d, axis=-1)

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        return jnp.sum(x, axis=axis, keepdims=keepdims)

    @staticmethod
    def count(mask):
        return jnp.sum(mask, dtype=jnp.int32)

    def as_float(self, x):
        return jnp.asarray(x, self.float_dtype)

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

    # --- groups of samples (ratiokl._core.advantages) -------------------------------------

    @staticmethod
    def argsort(x):
        return jnp.argsort(x, stable=True)

    @staticmethod
    def cumsum(x):
        return jnp.cumsum(x, axis=-1)

    @staticmethod
    def unpermute(values, order):
        """``out[order] = values``."""
        return jnp.zeros_like(values).at[order].set(values)

    @staticmethod
    def gather(table, index):
        """``table[index]`` along the first axis."""
        return table[index]

    def flat(self, values):
        """An ``[N]`` copy in the compute dtype of a per-token array (None passes through)."""
        return None if values is None else values.reshape(-1).astype(self.float_dtype)

    # --- the route's hooks (ratiokl._core.route.loss_step) ---------------------------------

    no_grad = staticmethod(contextlib.nullcontext)  # JAX differentiates what it is asked to
    #: ``inplace_grad``: the host check is read after the call, as for every other launch.
    check_before_inplace = False

    @staticmethod
    def compiling() -> bool:
        return False

    @staticmethod
    def compiled_backward(logits) -> bool:
        """Never: under ``jax.jit`` the fused kernel's gradient is its own output."""
        return False

    @staticmethod
    def head_logits(hidden, mask, weight, bias, transform):
        """Every row's logits ``[N, V]`` from ``hidden [N, H]`` (``ratiokl.jax._lm_head``),
        inactive rows' hidden states zeroed."""
        kept = jnp.where(mask[:, None], hidden, jnp.zeros((), hidden.dtype))
        return head_logits(kept, weight, bias, transform)

    @staticmethod
    def once(loss, op: str):
        """``loss`` itself: a JAX gradient is a new computation each time."""
        return loss

    # --- validation's questions (ratiokl._core.checks) -----------------------------------

    array_type, any_array, noun = "jax.Array", "a jax.Array (or a NumPy array)", "array"
    logit_dtypes = tuple(jnp.dtype(name) for name in LOGIT_DTYPE_NAMES)
    #: The logits dtype only the native backend takes (computed in float64; needs x64).
    wide_dtype = jnp.dtype("float64")
    id_dtype_names = ("int32", "int64")
    id_dtypes = (jnp.int32, jnp.int64)
    casts = {"float": "{}.astype(jnp.float32)", "ids": "{}.astype(jnp.int32)",
             "bool": "{}.astype(bool)"}
    as_array = staticmethod(jnp.asarray)

    @staticmethod
    def is_array(value) -> bool:
        """A ``jax.Array``, a tracer or a NumPy array."""
        return isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer))

    @staticmethod
    def is_floating(dtype) -> bool:
        return jnp.issubdtype(dtype, jnp.floating)

    @staticmethod
    def is_integer(dtype) -> bool:
        return jnp.issubdtype(dtype, jnp.integer)

    @staticmethod
    def is_bool(dtype) -> bool:
        return dtype == jnp.bool_

    @staticmethod
    def same_device(**arrays) -> None:
        """Nothing to check: JAX places the arrays of one computation itself."""


XP = _Jax(jnp.dtype("float32"))
XP64 = _Jax(jnp.dtype("float64"))
