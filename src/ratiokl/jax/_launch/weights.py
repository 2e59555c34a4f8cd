"""The row-weight launches: the token-mean aggregation weights and the rollout
correction's weights and metrics, each one single-program launch over the rows (and each
its framework twin, for ``vmap``).
"""

from __future__ import annotations

import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp

from ratiokl._core import rollout as _rollout
from ratiokl._core.sequences import log_weights
from ratiokl._kernels import loss_rows as row_kernels
from ratiokl._kernels.rollout import rollout_constexprs, rollout_weights_kernel
from ratiokl.jax._arrays import XP
from ratiokl.jax._launch.vmap import TritonCall, mapped
from ratiokl.spec import RolloutOptions

__all__ = ["native_weights", "rollout_op", "weights_op"]


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


def _rollout_call(call: TritonCall, opts: RolloutOptions, bound: float, seq_width: int,
                  sequence: bool, has_iw: bool, mask, old, rollout, seq,
                  iw) -> Tuple[jax.Array, jax.Array]:
    """``rollout_weights_kernel``: ``(w * iw, metrics)``, float32 ``[N]`` (0 on inactive
    rows) and ``[3]``; ``seq`` one sequence log-weight per ``seq_width`` rows (read with
    ``sequence``), ``iw`` the importance weights (read with ``has_iw``); each not read is a
    placeholder."""
    n = mask.shape[0]
    if not n:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((3,), jnp.float32)
    return tuple(call(
        mask, old, rollout, seq, iw, kernel=rollout_weights_kernel,
        out_shape=[jax.ShapeDtypeStruct((n,), jnp.float32),
                   jax.ShapeDtypeStruct((3,), jnp.float32)],
        grid=(1,), num_warps=row_kernels.ROWS_WARPS, N=n, seq_width=seq_width,
        **rollout_constexprs(opts.masks, opts.corrects, opts.low, opts.high, bound, sequence,
                             has_iw),
    ))


def _native_rollout(opts: RolloutOptions, bound: float, seq_width: int, sequence: bool,
                    has_iw: bool, mask, old, rollout, seq, iw):
    """What :func:`_rollout_call` computes, with ``ratiokl._core.rollout``'s ops."""
    per_token = jnp.repeat(seq, seq_width, total_repeat_length=mask.size) if sequence else None
    lw, _ = log_weights(XP, mask, old, rollout, None, False, False)
    w, metrics = _rollout.weights(XP, mask, lw, per_token, iw if has_iw else None, opts,
                                  bound or None)
    return w, jnp.stack(list(metrics.values()))


@functools.lru_cache(maxsize=None)
def rollout_op(call: TritonCall, opts: RolloutOptions, bound: float, seq_width: int,
               sequence: bool, has_iw: bool) -> Callable:
    """The rollout correction's weights and metrics through ``call`` (see
    :func:`_rollout_call`); vmapped: the framework ops."""
    static = (opts, bound, seq_width, sequence, has_iw)
    op = jax.custom_batching.custom_vmap(functools.partial(_rollout_call, call, *static))
    op.def_vmap(functools.partial(mapped, functools.partial(_native_rollout, *static)))
    return op
