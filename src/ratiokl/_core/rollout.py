"""The rollout correction's weight and metrics on ``[R, T]`` arrays, written once.

``ratiokl.spec.rollout`` has the formulas. The weight depends on per-token values only
(``old_logps``, ``rollout_logps``, the mask, the sequences), never on the logits, so
:func:`correct` computes it once per call and folds ``w * importance_weights`` into the
inputs every ``policy_loss`` path reads as their ``importance_weights`` (the fused kernel,
the two-pass objective, the vocabulary-sharded route, ``policy_objective``): the weight
multiplies the policy term only, as ``importance_weights`` does. A backend may compute
the weights and the metrics in one launch (``Backend.rollout_weights``: PyTorch's Triton
backends); elsewhere :func:`weights` computes the same with the framework's ops. The
sequence-level log-weight is a row sum, or with ``segment_ids`` a segmented sum
(:func:`ratiokl._core.sequences.sequence_totals`).

Inactive tokens are selected out before any arithmetic (a NaN ``rollout_logps`` or
``old_logps`` there reaches nothing); everything here is detached and never synchronises
with the host. ``xp`` is the framework's array adapter (:mod:`ratiokl._core`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple

from ratiokl._core.objective import masked_means
from ratiokl._core.sequences import sequence_totals
from ratiokl.spec import ROLLOUT_METRIC_NAMES, RolloutOptions

__all__ = ["correct", "sequence_log_weights", "weights"]

Metrics = Dict[str, Any]


def correct(xp, mask, inputs, rollout, opts: RolloutOptions, bound: Optional[float],
            launch: Optional[Callable] = None) -> Tuple[Any, Metrics]:
    """``inputs`` with the rollout weight folded into ``importance_weights`` (where
    ``opts`` corrects), and the rollout metrics.

    ``mask``: bool ``[R, T]``; ``inputs``: the framework's ``TokenInputs`` (``[R, T]``,
    ``old_logps`` given); ``rollout``: float32 ``[R, T]`` without gradient. ``launch``: a
    backend's one-launch ``rollout_weights(mask, old, rollout, seq, iw, opts, bound)`` on
    flattened ``[N]`` arrays, or None (the ops of :func:`weights`; also for the modes the
    kernel lacks, ``"token-clip"`` and ``"sequence-geomean-mask"``).
    """
    seq = sequence_log_weights(xp, mask, inputs.old_logps, rollout, inputs.segment_ids,
                               opts.geomean) if opts.sequence else None
    if launch is not None and opts.in_kernel:
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        w, metrics = launch(flat(mask), flat(inputs.old_logps), flat(rollout), seq,
                            flat(inputs.importance_weights), opts, bound)
        w = w.reshape(mask.shape)
    else:
        w, metrics = weights(xp, mask, inputs.old_logps, rollout, seq,
                             inputs.importance_weights, opts, bound)
    if opts.corrects:
        inputs = dataclasses.replace(inputs, importance_weights=w)
    return inputs, metrics


def _clip(xp, x, bound: Optional[float]):
    """``clip(x, -bound, bound)`` (None: no bound); a NaN stays NaN (detached values)."""
    return x if bound is None else xp.clip(x, -bound, bound)


def _log_weights(xp, mask, old, rollout):
    """``lw = old - rollout`` per token, both selected first: 0 on inactive tokens."""
    return xp.where(mask, old, 0.0) - xp.where(mask, rollout, 0.0)


def sequence_log_weights(xp, mask, old, rollout, segment_ids: Optional[Any],
                         mean: bool = False):
    """The sum (``mean``: the mean) of ``old - rollout`` over each token's sequence:
    ``[R, 1]`` (one sequence a row) or, with ``segment_ids``, ``[R, T]``."""
    lw = _log_weights(xp, mask, old, rollout)
    count = xp.as_float(mask)
    if segment_ids is None:
        total, count = xp.sum(lw, axis=-1, keepdims=True), xp.sum(count, axis=-1, keepdims=True)
    else:
        total = sequence_totals(xp, lw, mask, segment_ids)
        count = sequence_totals(xp, count, mask, segment_ids) if mean else count
    return total / xp.maximum(count, 1.0) if mean else total


def weights(xp, mask, old, rollout, seq: Optional[Any], iw: Optional[Any],
            opts: RolloutOptions, bound: Optional[float]) -> Tuple[Any, Metrics]:
    """``where(mask, w * iw, 0)`` float32 ``[R, T]`` and the metrics (``ROLLOUT_METRIC_NAMES``:
    the mean weight, the masked fraction and the k3 estimate of KL(engine || old)).

    ``seq``: :func:`sequence_log_weights` at the sequence level (its mean with
    ``opts.geomean``), else None (per token).
    """
    lw_tok = _log_weights(xp, mask, old, rollout)
    e = xp.exp(_clip(xp, lw_tok if seq is None else seq, bound))
    outside = xp.zeros_like(mask)
    w = xp.ones_like(lw_tok)
    if opts.masks:  # NaN is not outside: it stays NaN
        outside = (e < opts.low) | (e > opts.high)
        w = xp.where(outside, 0.0, e)
        if opts.geomean:  # the gate keeps the token's own weight; a NaN gate stays NaN
            w = xp.where(outside, 0.0, xp.where(e == e, xp.exp(_clip(xp, lw_tok, bound)), e))
    elif opts.corrects:
        w = xp.where(e > opts.high, opts.high, e)
        if opts.floors:
            w = xp.where(e < opts.low, opts.low, w)
    d = _clip(xp, lw_tok, bound)
    means = masked_means(xp, mask, (w, outside, xp.expm1(d) - d))
    w = xp.broadcast_to(w, mask.shape)
    if iw is not None:
        w = w * xp.where(mask, iw, 0.0)
    weights = xp.as_float(xp.where(mask, w, 0.0))
    return weights, {name: means[i] for i, name in enumerate(ROLLOUT_METRIC_NAMES)}
