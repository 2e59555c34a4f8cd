"""The fused policy loss's row vectors in one launch each: aggregation weights and metrics.

``_kernels.loss_rows`` through jax-triton, the kernels that
``ratiokl.torch._loss_rows`` launches: ``token_weights_kernel`` turns the
mask into the weights ``w = mask / D`` where every active token weighs the
same (``loss_rows.token_denominator``; the other aggregations take
``_objective``'s ops), and ``policy_metrics_kernel`` gives the seven metrics and the loss
``sum(loss_rows)`` (XLA ran about 17 small fusions for them, 2-6 us of
device time each, on the H200). Neither is row-independent (a count, means),
so under ``vmap`` each mapped problem takes ``_objective``'s ops instead
(a ``custom_vmap`` rule), with the same values up to rounding.
"""

from __future__ import annotations

import functools
from typing import Dict, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._kernels import loss_rows as kernels
from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW
from ratiokl.jax import _objective, _triton
from ratiokl.spec import PolicyLossOptions

__all__ = ["aggregation_weights", "loss_and_metrics"]


def _vmapped(native, axis_size: int, in_batched: Sequence[bool], *args):
    """A ``custom_vmap`` rule: ``native`` mapped over the batched arguments."""
    del axis_size
    axes = [0 if b else None for b in in_batched]
    return jax.vmap(native, in_axes=axes)(*args), True


def _native_weights(denom: float, count: bool, mask: jax.Array) -> jax.Array:
    """``where(mask, 1 / D, 0)``, ``D`` the active count (at least 1) or ``denom``: what
    ``_objective.aggregation_weights`` computes where every active token weighs the same."""
    d = jnp.maximum(jnp.sum(mask, dtype=jnp.int32), 1) if count else denom
    return jnp.where(mask, 1.0 / d, 0.0).astype(jnp.float32)


def _weights_call(denom: float, count: bool, mask: jax.Array) -> jax.Array:
    """``token_weights_kernel``; ``denom`` a compile-time constant, as jax-triton passes
    every keyword (unused when ``count``)."""
    if not mask.size:
        return jnp.zeros(mask.shape, jnp.float32)
    w = _triton._triton_call(
        mask.reshape(-1), kernel=kernels.token_weights_kernel,
        out_shape=jax.ShapeDtypeStruct((mask.size,), jnp.float32), grid=(1,),
        num_warps=kernels.ROWS_WARPS, N=mask.size, denom=denom, COUNT=count,
        BLOCK=kernels.ROWS_BLOCK,
    )
    return w.reshape(mask.shape)


@functools.lru_cache(maxsize=None)
def _weights_op(denom: float, count: bool):
    op = jax.custom_batching.custom_vmap(functools.partial(_weights_call, denom, count))
    op.def_vmap(functools.partial(_vmapped, functools.partial(_native_weights, denom, count)))
    return op


def aggregation_weights(mask_rows: jax.Array, inputs: _objective.TokenInputs,
                        opts: PolicyLossOptions) -> jax.Array:
    """``_objective.aggregation_weights`` (float32 ``[R, T]``), one launch where it can be.

    Where every active token weighs the same (``token-mean``, ``token-sum``,
    ``seq-mean-token-sum-norm``; ``seq-mean-token-sum`` with a numeric
    ``loss_normalizer``): ``token_weights_kernel``. The others (sequence
    counts or lengths, an array normaliser) take ``_objective``'s ops. 0 on
    inactive tokens.
    """
    denom, count = kernels.token_denominator(opts, inputs.loss_normalizer,
                                             mask_rows.shape[-1])
    if denom is None and not count:
        return _objective.aggregation_weights(mask_rows, inputs, opts)
    return _weights_op(1.0 if denom is None else denom, count)(mask_rows.astype(jnp.bool_))


def _native_metrics(mask, logp, ratio, kl, bits, old, loss_rows) -> jax.Array:
    """The ``[8]`` vector of ``policy_metrics_kernel`` from ``_objective.token_metrics``."""
    metrics = _objective.token_metrics(
        mask, jnp.sum(mask, dtype=jnp.int32), (bits & CLIP_LOW.value) != 0,
        (bits & CLIP_HIGH.value) != 0, (bits & CLIP_CAPPED.value) != 0, ratio, kl,
        jnp.where(mask, old, 0.0) - logp,
    )
    total = jnp.sum(jnp.where(mask, loss_rows, 0.0))
    return jnp.stack([metrics[name] for name in kernels.METRIC_NAMES] + [total])


def _metrics_call(mask, logp, ratio, kl, bits, old, loss_rows) -> jax.Array:
    if not mask.shape[0]:
        return jnp.zeros((kernels.METRICS_OUT,), jnp.float32)
    return _triton._triton_call(
        mask, logp, ratio, kl, bits, old, loss_rows, kernel=kernels.policy_metrics_kernel,
        out_shape=jax.ShapeDtypeStruct((kernels.METRICS_OUT,), jnp.float32), grid=(1,),
        num_warps=kernels.ROWS_WARPS, N=mask.shape[0], BLOCK=kernels.ROWS_BLOCK,
    )


_metrics_op = jax.custom_batching.custom_vmap(_metrics_call)
_metrics_op.def_vmap(functools.partial(_vmapped, _native_metrics))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows_total(rows: int, loss_rows: jax.Array, total: jax.Array) -> jax.Array:
    """``sum(loss_rows)``, given already summed (``total``): the sum's gradient, no reduction.

    The backward hands every row the upstream value (a broadcast).
    """
    del rows, loss_rows
    return total


def _rows_total_fwd(rows, loss_rows, total):
    del rows, loss_rows
    return total, None


def _rows_total_bwd(rows, _, g):
    return jnp.broadcast_to(g, (rows,)), jnp.zeros_like(g)


_rows_total.defvjp(_rows_total_fwd, _rows_total_bwd)


def loss_and_metrics(loss_rows, mask, logp, ratio, kl, bits,
                     old) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The loss ``sum(loss_rows)`` and the metrics of ``_objective.token_metrics``, one launch.

    ``loss_rows``: the fused kernel's float32 ``[N]`` weighted losses (0 on
    inactive rows), differentiable; ``mask`` bool ``[N]``; ``logp``, ``ratio``,
    ``kl``, ``old`` float32 ``[N]``; ``bits`` int32 clip bits. Inactive rows'
    values are selected out (NaN there stays out). Returns the float32 0-d
    loss (its gradient flows to ``loss_rows``) and stop-gradient float32 0-d
    metrics.
    """
    rows = (mask, logp, ratio, kl, bits, old, loss_rows)
    out = _metrics_op(*(lax.stop_gradient(x) for x in rows))  # no derivative rule: none asked
    loss = _rows_total(loss_rows.shape[0], loss_rows, out[-1])
    return loss, {name: out[i] for i, name in enumerate(kernels.METRIC_NAMES)}
