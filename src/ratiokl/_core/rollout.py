"""The rollout correction's weight and metrics on ``[R, T]`` arrays, written once.

``ratiokl.spec.rollout`` has the formulas. The weight depends on per-token values only
(``old_logps``, ``rollout_logps``, the mask, the sequences), never on the logits, so
the route computes it once per call (``ratiokl._core.route.rollout_step``) and folds
``w * importance_weights`` into the inputs every ``policy_loss`` path reads as their
``importance_weights`` (the fused kernel, the two-pass objective, the vocabulary-sharded
route, ``policy_objective``): the weight multiplies the policy term only, as
``importance_weights`` does. A backend may compute the weights and the metrics in one
launch (``Backend.rollout_weights``: the Triton backends of both frameworks); elsewhere
:func:`weights` computes the same with the framework's ops. The log-weights, per token and
per sequence (a row sum, or with ``segment_ids`` a segmented sum), come from
:func:`ratiokl._core.sequences.log_weights`.

:func:`parity` gives the trainer/sampler parity metrics, which read the call's own log-probs
``logp`` (so the route computes them after the loss; the fused kernels' metrics launch
computes them there).

Inactive tokens are selected out before any arithmetic (a NaN ``rollout_logps`` or
``old_logps`` there reaches nothing); everything here is detached and never synchronises
with the host. ``xp`` is the framework's array adapter (:mod:`ratiokl._core`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ratiokl._core.objective import masked_means
from ratiokl.spec import (ROLLOUT_METRIC_NAMES, ROLLOUT_PARITY_NAMES, ROLLOUT_PARITY_TOLERANCES,
                          RolloutOptions)

__all__ = ["parity", "weights"]

Metrics = Dict[str, Any]


def _clip(xp, x, bound: Optional[float]):
    """``clip(x, -bound, bound)`` (None: no bound); a NaN stays NaN (detached values)."""
    return x if bound is None else xp.clip(x, -bound, bound)


def weights(xp, mask, lw_tok, seq: Optional[Any], iw: Optional[Any], opts: RolloutOptions,
            bound: Optional[float]) -> Tuple[Any, Metrics]:
    """``where(mask, w * iw, 0)`` float32 ``[R, T]`` and the metrics (``ROLLOUT_METRIC_NAMES``:
    the mean weight, the masked fraction and the k3 estimate of KL(engine || old)).

    ``lw_tok`` and ``seq``: ``ratiokl._core.sequences.log_weights`` (``seq`` at the sequence
    level, its mean with ``opts.geomean``; None per token).
    """
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


def parity(xp, mask, logp, rollout) -> Metrics:
    """``ROLLOUT_PARITY_NAMES`` (``ratiokl.spec.rollout_parity``): the detached fraction of
    active tokens whose ``exp(logp - rollout)`` lies outside ``[1 - tol, 1 + tol]`` (NaN:
    outside), one per ``ROLLOUT_PARITY_TOLERANCES``; ``mask``, ``logp`` and ``rollout`` of
    one shape."""
    e = xp.exp(xp.where(mask, xp.stop_gradient(logp), 0.0) - xp.where(mask, rollout, 0.0))
    means = masked_means(xp, mask, tuple(~((e >= 1.0 - tol) & (e <= 1.0 + tol))
                                         for tol in ROLLOUT_PARITY_TOLERANCES))
    return {name: means[i] for i, name in enumerate(ROLLOUT_PARITY_NAMES)}
