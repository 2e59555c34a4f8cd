"""The PPO/GRPO objective on per-token log-probs: ``[R, T]``-sized ``jnp`` ops.

The two-pass ``policy_loss`` (``ratiokl.jax._route``) gets ``logp`` and the
entropy from a backend's differentiable ``logprobs_entropy`` and hands them here
with the other per-token inputs laid out as ``R`` rows of ``T`` tokens; JAX's autodiff
differentiates the result. :func:`token_ratio_kl` is the same epilogue for
``ratio_kl`` (``[N]``). The math is ``ratiokl.spec.policy_loss``'s and the
code mirrors ``ratiokl.torch._objective`` line for line.

Inactive tokens' inputs are replaced with neutral values *before* any
arithmetic and every intermediate stays finite on them, so a NaN there never
sits in an untaken ``jnp.where`` branch whose gradient would be ``0 * NaN``.
Options are static Python values; everything else may be traced (``jit``,
``grad``, ``vmap``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._codes import KL
from ratiokl.jax._checks import Normalizer, TokenInputs
from ratiokl.spec import LossAgg, PolicyLossOptions

__all__ = ["aggregation_weights", "policy_objective", "sequence_totals", "token_metrics",
           "token_ratio_kl"]


def token_ratio_kl(logp: jax.Array, logp_ref: jax.Array, old_logps: jax.Array,
                   mask: jax.Array, kl_code: int) -> Tuple[jax.Array, jax.Array]:
    """``(ratio, kl)`` float32 ``[N]`` from ``[N]`` log-probs and a bool ``[N]`` mask.

    Differentiable through ``logp`` only (the caller passes the others under
    ``lax.stop_gradient``). Inactive rows: ``ratio = 1``, ``kl = 0``, zero
    gradient. ``kl_code`` is a static Python int (1, 2, 3 for k1, k2, k3).
    """
    logp = jnp.where(mask, logp.astype(jnp.float32), 0.0)
    logp_ref = jnp.where(mask, logp_ref.astype(jnp.float32), 0.0)
    old = jnp.where(mask, old_logps.astype(jnp.float32), 0.0)
    ratio = jnp.exp(logp - old)
    kl = _kl(logp_ref - logp, kl_code, ratio, None)
    return jnp.where(mask, ratio, 1.0), jnp.where(mask, kl, 0.0)

def _bounded(x: jax.Array, bound: Optional[float]) -> jax.Array:
    """``clip(x, -bound, bound)`` with gradient 1 inside ``[-bound, bound]``, 0 outside."""
    if bound is None:
        return x
    return jnp.where(x > bound, bound, jnp.where(x < -bound, -bound, x))


def _straight_through(grad_like: jax.Array, value: jax.Array) -> jax.Array:
    """The value of ``value`` with the gradient of ``grad_like``."""
    return grad_like - lax.stop_gradient(grad_like) + lax.stop_gradient(value)


def _kl(d: jax.Array, code: int, ratio: jax.Array, bound: Optional[float]) -> jax.Array:
    """KL variant ``code`` (``ratiokl.spec.POLICY_KL_ESTIMATORS``) on ``d = logp_ref - logp``.

    Only the terms the variant uses are computed (``ratio`` is read by ``k3-is`` only).
    """
    if code == KL.K1:
        return -d
    k2 = 0.5 * d * d
    if code in (KL.K2, KL.K1_PLUS):
        return k2 if code == KL.K2 else _straight_through(k2, -d)
    d_b = _bounded(d, bound)
    k3 = jnp.expm1(d_b) - d_b
    if code == KL.K3:
        return k3
    return _straight_through(k2, k3) if code == KL.K3_PLUS else ratio * k3


def _shift_right(x: jax.Array, step: int, fill) -> jax.Array:
    """``x`` moved ``step`` positions along the last axis, ``fill`` entering on the left."""
    pad = jnp.full(x.shape[:-1] + (step,), fill, dtype=x.dtype)
    return jnp.concatenate([pad, x[..., :-step]], axis=-1)


def _segments(mask: jax.Array, segment_ids: Optional[jax.Array]):
    """Per token: the first and last position of its sequence, and sequence starts.

    A sequence starts at an active token that is the first active one of its
    row or whose segment id differs from the previous active token's. Inactive
    tokens join the sequence before them; their ids are never compared.
    """
    width = mask.shape[-1]
    if width == 0:
        empty = jnp.zeros(mask.shape, jnp.int32)
        return empty, empty, mask
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), mask.shape)
    seg = jnp.zeros_like(pos) if segment_ids is None else segment_ids.astype(jnp.int32)
    last_active = lax.cummax(jnp.where(mask, pos, -1), axis=1)
    prev_active = _shift_right(last_active, 1, -1)
    prev_seg = jnp.take_along_axis(seg, jnp.maximum(prev_active, 0), axis=1)
    starts = mask & ((prev_active < 0) | (seg != prev_seg))
    first = lax.cummax(jnp.where(starts, pos, 0), axis=1)
    next_start = lax.cummin(jnp.where(starts, pos, width), axis=1, reverse=True)
    last = jnp.concatenate([next_start[:, 1:], jnp.full_like(pos[:, :1], width)], axis=1) - 1
    return first, last, starts


def _segment_totals(x: jax.Array, first: jax.Array, last: jax.Array) -> jax.Array:
    """Per token, the sum of ``x`` over its sequence (a segmented scan, then a gather).

    Doubling steps (Hillis-Steele) keep it deterministic and free of scatters.
    """
    pos = jnp.arange(x.shape[-1], dtype=jnp.int32)
    acc, step = x, 1
    while step < x.shape[-1]:
        acc = jnp.where(pos - step >= first, acc + _shift_right(acc, step, 0.0), acc)
        step *= 2
    return jnp.take_along_axis(acc, last, axis=1)


def sequence_totals(x: jax.Array, mask: jax.Array,
                    segment_ids: Optional[jax.Array]) -> jax.Array:
    """Per token, the sum of ``x`` over its sequence (``loss_agg``'s sequences), ``[R, T]``.

    ``x`` must hold 0 on inactive tokens (they join the sequence before them). Used by
    the rollout correction's sequence-level log-weight.
    """
    first, last, _ = _segments(mask, segment_ids)
    return _segment_totals(x, first, last)


def _clipped_ratio(ratio, adv, opts: PolicyLossOptions):
    """The ratio the surrogate uses, and the low / high / dual-clip indicators."""
    high = (adv > 0) & (ratio > opts.ratio_high)
    low = (adv < 0) & (ratio < opts.ratio_low)
    capped = jnp.zeros_like(high)
    q = jnp.where(high, opts.ratio_high, jnp.where(low, opts.ratio_low, ratio))
    if opts.neg_cap is not None:
        capped = (adv < 0) & (ratio > opts.neg_cap)
        q = jnp.where(capped, opts.neg_cap, q)
    return q, low, high, capped


def _cispo_weight(ratio, opts: PolicyLossOptions):
    """CISPO's weight ``sg(clip(ratio, ratio_low, ratio_high))`` (every advantage) and its
    low / high / (never) dual-clip indicators."""
    high, low = ratio > opts.ratio_high, ratio < opts.ratio_low
    weight = jnp.where(high, opts.ratio_high, jnp.where(low, opts.ratio_low, ratio))
    return lax.stop_gradient(weight), low, high, jnp.zeros_like(high)


def _denominator(loss_agg: LossAgg, n_tok, n_seq, width: int, loss_normalizer: Normalizer):
    """``D`` of ``sum(a * loss) / D``; a count of 0 becomes 1 (its numerator is 0)."""
    if loss_agg == "none":  # per token: no denominator (a normaliser is refused with it)
        return 1.0
    if loss_normalizer is not None:
        return loss_normalizer
    if loss_agg == "token-mean":
        return jnp.maximum(n_tok, 1)
    if loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return jnp.maximum(n_seq, 1)
    return 1.0 if loss_agg == "token-sum" else float(width)


def aggregation_weights(mask: jax.Array, inputs: TokenInputs, opts: PolicyLossOptions) -> jax.Array:
    """Per-token weights ``a_t / D`` with ``loss = sum_t w_t * loss_t``: float32 ``[R, T]``.

    Depends only on the mask, the segment ids and the normaliser (never on
    log-probs), so fused kernels take it precomputed; 0 on inactive tokens.
    """
    weights = jnp.ones(mask.shape, jnp.float32)
    n_seq = None
    if opts.seq_aggregation:
        first, last, starts = _segments(mask, inputs.segment_ids)
        n_seq = jnp.sum(starts, dtype=jnp.int32)
        if opts.loss_agg == "seq-mean-token-mean":
            weights = 1.0 / jnp.maximum(
                _segment_totals(mask.astype(jnp.float32), first, last), 1.0
            )
    n_tok = jnp.sum(mask, dtype=jnp.int32)
    denom = _denominator(opts.loss_agg, n_tok, n_seq, mask.shape[-1], inputs.loss_normalizer)
    return jnp.where(mask, weights / denom, 0.0).astype(jnp.float32)


def policy_objective(
    logp: jax.Array,
    logp_ref: Optional[jax.Array],
    mask: jax.Array,
    inputs: TokenInputs,
    opts: PolicyLossOptions,
    entropy: jax.Array,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``(loss, metrics)`` from per-token inputs laid out ``[R, T]``.

    Args:
      logp: float32 ``[R, T]``, differentiable.
      logp_ref: float32 ``[R, T]`` (stop-gradient), or None (then the KL is 0).
      mask: bool ``[R, T]``.
      inputs: the other per-token inputs (:func:`token_inputs`).
      opts: validated options (``ratiokl.spec.policy_loss_options``).
      entropy: float32 ``[R, T]``, the tokens' entropies; differentiated only when
        ``opts.entropy_coef`` may be non-zero (``- entropy_coef * H`` joins each token's
        loss before the aggregation), else only averaged into ``entropy_mean``.

    Returns:
      The float32 0-d loss and a dict of float32 0-d metrics (stop-gradient).
    """
    logp = jnp.where(mask, logp, 0.0)
    # On-policy (no old_logps): old = sg(logp), r = 1 with the gradient of logp.
    old = lax.stop_gradient(logp) if inputs.old_logps is None else jnp.where(
        mask, inputs.old_logps, 0.0)
    adv = jnp.where(mask, inputs.advantages, 0.0)
    need_segments = opts.sequence_ratio or opts.seq_aggregation
    if need_segments:
        first, last, starts = _segments(mask, inputs.segment_ids)
        counts = jnp.maximum(_segment_totals(mask.astype(jnp.float32), first, last), 1.0)
    log_ratio = logp - old
    if opts.sequence_ratio:
        seq_mean = _segment_totals(lax.stop_gradient(log_ratio), first, last) / counts
        # GSPO-token form (verl): value sg(s_i), gradient on the token's own logp.
        # An infinite logp (its action masked out with -inf) adds 0, not inf - inf = NaN:
        # the value stays s_i (then beyond the bound: no gradient), as in the spec.
        own = jnp.where(jnp.isinf(logp), 0.0, logp - lax.stop_gradient(logp))
        log_ratio = jnp.where(mask, seq_mean + own, 0.0)
    ratio = jnp.exp(_bounded(log_ratio, opts.log_ratio_bound))
    if opts.cispo:  # the gradient goes through logp only, on every active token
        q, low, high, capped = _cispo_weight(ratio, opts)
        per_token = -adv * q * logp
    else:
        q, low, high, capped = _clipped_ratio(ratio, adv, opts)
        per_token = -adv * q
    if inputs.importance_weights is not None:
        per_token = per_token * jnp.where(mask, inputs.importance_weights, 0.0)
    kl = jnp.zeros(mask.shape, jnp.float32)
    if logp_ref is not None:
        d = jnp.where(mask, logp_ref, 0.0) - logp
        kl = _kl(d, opts.kl_code, ratio, opts.log_ratio_bound)
        if opts.uses_kl:  # kl_coef = 0: the KL is only logged (0 * inf would be NaN)
            weighted = per_token + opts.kl_coef * kl
            per_token = weighted if isinstance(opts.kl_coef, float) else jnp.where(
                opts.kl_coef != 0.0, weighted, per_token)
    entropy = jnp.where(mask, entropy, 0.0)
    if opts.uses_entropy:  # entropy_coef = 0: only logged, as the KL's
        bonus = per_token - opts.entropy_coef * entropy
        per_token = bonus if isinstance(opts.entropy_coef, float) else jnp.where(
            opts.entropy_coef != 0.0, bonus, per_token)
    if opts.loss_agg == "seq-mean-token-mean":
        per_token = per_token / counts
    n_tok = jnp.sum(mask, dtype=jnp.int32)
    n_seq = jnp.sum(starts, dtype=jnp.int32) if need_segments else None
    metrics = token_metrics(mask, n_tok, low, high, capped, ratio, kl, old - logp, entropy)
    if opts.per_token:  # loss_agg="none": the per-token loss [R, T], 0 on inactive tokens
        return jnp.where(mask, per_token, 0.0).astype(jnp.float32), metrics
    denom = _denominator(opts.loss_agg, n_tok, n_seq, mask.shape[-1], inputs.loss_normalizer)
    loss = jnp.sum(jnp.where(mask, per_token, 0.0)) / denom
    return loss.astype(jnp.float32), metrics


def token_metrics(mask, n_tok, low, high, capped, ratio, kl, approx_kl,
                  entropy) -> Dict[str, jax.Array]:
    """Means over active tokens (0 when there is none), under stop-gradient; any shape."""
    count = jnp.maximum(n_tok, 1).astype(jnp.float32)

    def mean(x: jax.Array) -> jax.Array:
        x = lax.stop_gradient(x).astype(jnp.float32)
        return jnp.sum(jnp.where(mask, x, 0.0)) / count

    return {
        "clip_fraction": mean(low | high),
        "clip_fraction_low": mean(low),
        "clip_fraction_high": mean(high),
        "dual_clip_fraction": mean(capped),
        "ratio_mean": mean(ratio),
        "kl_mean": mean(kl),
        "approx_kl": mean(approx_kl),
        "entropy_mean": mean(entropy),
    }
