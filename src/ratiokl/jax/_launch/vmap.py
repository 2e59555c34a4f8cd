"""The jax-triton launch function type and the ``vmap`` rules of the launches.

``triton_call`` has no batching rule: row-independent launches fold batch dimensions into
rows (:func:`row_op`); the reductions over rows (weights, metrics) map the framework ops
instead (:func:`mapped`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Tuple

import jax
import jax.numpy as jnp

__all__ = ["TritonCall", "mapped", "row_op"]


#: A launch function with ``jax_triton.triton_call``'s signature (kernel, ``out_shape``,
#: grid and compile-time keywords): the one difference between the Triton backends.
TritonCall = Callable[..., Any]


def _fold(axis_size: int, batched: bool, x: jax.Array, rows: int, is_temp: bool) -> jax.Array:
    """``x`` (``[B, ...]`` if batched) as rows ``[B * rows, ...]``.

    An unbatched scalar temperature (``[1]``, read with stride 0) stays as it is.
    """
    if is_temp and not batched and x.shape == (1,):
        return x
    x = x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
    if is_temp and x.shape[1] == 1:
        x = jnp.broadcast_to(x, (axis_size, rows))
    return x.reshape((axis_size * x.shape[1],) + x.shape[2:])


def row_op(call: Callable, temp_index: int, shared: Tuple[int, ...] = ()) -> Callable:
    """``call`` (rows first in every argument) with a vmap rule that folds the batch into rows.

    ``shared``: positions of arguments that are not per row (the fused loss's
    coefficients): passed as they are, and not batchable.
    """
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size: int, in_batched: Sequence[bool], *args):
        rows = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        if any(in_batched[i] for i in shared):
            raise ValueError(
                "policy_loss's coefficients (kl_coef, clip_eps, clip_eps_high) cannot be "
                "vmapped over on the triton backend; pass one value for the whole batch"
            )
        folded = [
            x if i in shared else _fold(axis_size, b, x, rows, i == temp_index)
            for i, (b, x) in enumerate(zip(in_batched, args))
        ]
        outs = op(*folded)
        unfold = lambda o: o.reshape((axis_size, rows) + o.shape[1:])  # noqa: E731
        unfolded = jax.tree_util.tree_map(unfold, outs)
        return unfolded, jax.tree_util.tree_map(lambda _: True, outs)

    return op


def mapped(native, axis_size: int, in_batched: Sequence[bool], *args):
    """A ``custom_vmap`` rule: ``native`` mapped over the batched arguments."""
    del axis_size
    axes = [0 if b else None for b in in_batched]
    out = jax.vmap(native, in_axes=axes)(*args)
    return out, jax.tree_util.tree_map(lambda _: True, out)
