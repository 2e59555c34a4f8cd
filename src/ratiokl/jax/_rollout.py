"""The rollout correction in JAX: ``ratiokl.spec.rollout``'s weight, folded into the
importance weights of every ``policy_loss`` path.

The weight depends on per-token values only (``old_logps``, ``rollout_logps``, the
mask, the sequences), never on the logits, so :func:`correct` computes it once per
call and hands ``w * importance_weights`` to the fused kernel, the two-pass objective
and the vocabulary-sharded route as their ``importance_weights``: no big kernel
changes. The ops below mirror ``ratiokl.torch._rollout``'s line for line; on every
backend they are ``jnp`` ops, which XLA fuses into a few elementwise kernels and
reductions under ``jit``. The sequence-level log-weight is a row sum, or with
``segment_ids`` the objective's segmented sum (``_objective.sequence_totals``).

Inactive tokens are selected out before any arithmetic (a NaN ``rollout_logps`` there
reaches nothing); everything is under ``stop_gradient``. The options are static
Python values; the arrays may be traced.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.jax import _objective
from ratiokl.jax._checks import TokenInputs, as_rows, check_row_values
from ratiokl.spec import ROLLOUT_METRIC_NAMES, RolloutOptions

__all__ = ["correct"]

Metrics = Dict[str, jax.Array]


def correct(mask: jax.Array, lead: Tuple[int, ...], inputs: TokenInputs,
            rollout_logps: jax.Array, opts: RolloutOptions,
            log_ratio_bound: Optional[float]) -> Tuple[TokenInputs, Metrics]:
    """``inputs`` with the rollout weight folded into ``importance_weights``, and the
    rollout metrics.

    ``mask``: the flattened bool ``[N]`` mask; ``lead``: the leading shape ``[...]``;
    ``opts``: ``spec.rollout_options`` of the call (the route calls this only where that
    is not None, i.e. where ``rollout_logps`` is given).
    """
    rollout = check_row_values("rollout_logps", rollout_logps, lead)
    rollout = as_rows(lax.stop_gradient(jnp.asarray(rollout, jnp.float32)), lead)
    rows = as_rows(mask, lead)
    seq = _sequence_log_weights(rows, inputs, rollout) if opts.sequence else None
    weights, metrics = _weights(rows, inputs, rollout, seq, opts, log_ratio_bound)
    if opts.corrects:
        inputs = dataclasses.replace(inputs, importance_weights=weights)
    return inputs, metrics


def _clip(x: jax.Array, bound: Optional[float]) -> jax.Array:
    """``clip(x, -bound, bound)`` (None: no bound); a NaN stays NaN (stop-gradient values)."""
    return x if bound is None else jnp.clip(x, -bound, bound)


def _sequence_log_weights(mask: jax.Array, inputs: TokenInputs,
                          rollout: jax.Array) -> jax.Array:
    """The sum of ``old - rollout`` over each token's sequence: ``[R, 1]`` (one sequence a
    row) or, with ``segment_ids``, ``[R, T]``."""
    lw = jnp.where(mask, inputs.old_logps - rollout, 0.0)
    if inputs.segment_ids is None:
        return jnp.sum(lw, axis=-1, keepdims=True)
    return _objective.sequence_totals(lw, mask, inputs.segment_ids)


def _weights(mask: jax.Array, inputs: TokenInputs, rollout: jax.Array,
             seq: Optional[jax.Array], opts: RolloutOptions,
             bound: Optional[float]) -> Tuple[jax.Array, Metrics]:
    """``where(mask, w * iw, 0)`` ``[R, T]`` and the metrics, in ``jnp`` ops."""
    lw_tok = jnp.where(mask, inputs.old_logps - rollout, 0.0)
    e = jnp.exp(_clip(lw_tok if seq is None else seq, bound))
    outside = jnp.zeros((), bool)
    w = jnp.ones((), jnp.float32)
    if opts.masks:  # NaN is not outside: it stays NaN
        outside = (e < opts.low) | (e > opts.high)
        w = jnp.where(outside, 0.0, e)
    elif opts.corrects:
        w = jnp.where(e > opts.high, opts.high, e)
    w, outside = jnp.broadcast_to(w, mask.shape), jnp.broadcast_to(outside, mask.shape)
    d = _clip(lw_tok, bound)
    count = jnp.maximum(jnp.sum(mask, dtype=jnp.int32), 1).astype(jnp.float32)
    means = [jnp.sum(jnp.where(mask, x, 0.0)) / count
             for x in (w, outside.astype(jnp.float32), jnp.expm1(d) - d)]
    iw = inputs.importance_weights
    weights = jnp.where(mask, w if iw is None else w * iw, 0.0).astype(jnp.float32)
    return weights, dict(zip(ROLLOUT_METRIC_NAMES, means))
