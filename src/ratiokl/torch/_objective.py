"""The PPO/GRPO objective on per-token log-probs: ``[R, T]``-sized PyTorch ops.

The two-pass ``policy_loss`` (``ratiokl.torch._route``) gets ``logp`` and the
entropy from a backend's differentiable ``logprobs_entropy`` and hands them here
with the other per-token inputs laid out as ``R`` rows of ``T`` tokens; autograd
differentiates the result. The math is ``ratiokl.spec.policy_loss``'s.
:func:`token_ratio_kl` is the same epilogue for ``ratio_kl`` (``[N]``).

Inactive tokens' inputs are replaced with neutral values *before* any
arithmetic and every intermediate stays finite on them, so a NaN there never
sits in an untaken ``torch.where`` branch whose gradient would be ``0 * NaN``.
No function here synchronises with the host.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ratiokl._codes import KL
from ratiokl.spec import LossAgg, PolicyLossOptions
from ratiokl.torch._checks import Normalizer, TokenInputs

__all__ = ["aggregation_weights", "policy_objective", "sequence_totals", "token_metrics",
           "token_ratio_kl"]


def token_ratio_kl(logp: torch.Tensor, logp_ref: torch.Tensor, old_logps: torch.Tensor,
                   mask: torch.Tensor, kl_code: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, kl)`` float32 ``[N]`` from float32 ``[N]`` log-probs and a bool mask.

    Differentiable through ``logp`` only (the caller passes the others
    detached). Inactive rows: ``ratio = 1``, ``kl = 0``, zero gradient.
    """
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp, zero)
    logp_ref = torch.where(mask, logp_ref.float(), zero)
    old = torch.where(mask, old_logps.float(), zero)
    ratio = torch.exp(logp - old)
    kl = _kl(logp_ref - logp, kl_code, ratio, None)
    return torch.where(mask, ratio, zero + 1.0), torch.where(mask, kl, zero)


def _bounded(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """``clip(x, -bound, bound)`` with gradient 1 inside ``[-bound, bound]``, 0 outside."""
    if bound is None:
        return x
    return torch.where(x > bound, bound, torch.where(x < -bound, -bound, x))


def _straight_through(grad_like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The value of ``value`` with the gradient of ``grad_like``."""
    return grad_like - grad_like.detach() + value.detach()


def _kl(d: torch.Tensor, code: int, ratio: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """KL variant ``code`` (``ratiokl.spec.POLICY_KL_ESTIMATORS``) on ``d = logp_ref - logp``.

    Only the terms the variant uses are computed (``ratio`` is read by ``k3-is`` only).
    """
    if code == KL.K1:
        return -d
    k2 = 0.5 * d * d
    if code in (KL.K2, KL.K1_PLUS):
        return k2 if code == KL.K2 else _straight_through(k2, -d)
    d_b = _bounded(d, bound)
    k3 = torch.expm1(d_b) - d_b
    if code == KL.K3:
        return k3
    return _straight_through(k2, k3) if code == KL.K3_PLUS else ratio * k3


def _segments(mask: torch.Tensor, segment_ids: Optional[torch.Tensor]):
    """Per token: the first and last position of its sequence, and sequence starts.

    A sequence starts at an active token that is the first active one of its
    row or whose segment id differs from the previous active token's. Inactive
    tokens join the sequence before them; their ids are never compared.
    """
    width = mask.shape[-1]
    if width == 0:
        empty = torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
        return empty, empty, mask
    pos = torch.arange(width, device=mask.device).expand(mask.shape)
    seg = torch.zeros_like(pos) if segment_ids is None else segment_ids.long()
    last_active = torch.cummax(torch.where(mask, pos, -1), dim=-1).values
    prev_active = torch.nn.functional.pad(last_active[:, :-1], (1, 0), value=-1)
    prev_seg = torch.gather(seg, -1, prev_active.clamp(min=0))
    starts = mask & ((prev_active < 0) | (seg != prev_seg))
    first = torch.cummax(torch.where(starts, pos, 0), dim=-1).values
    next_start = torch.where(starts, pos, width).flip(-1).cummin(dim=-1).values.flip(-1)
    last = torch.nn.functional.pad(next_start[:, 1:], (0, 1), value=width) - 1
    return first, last, starts


def _segment_totals(x: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Per token, the sum of ``x`` over its sequence (a segmented scan, then a gather).

    Doubling steps (Hillis-Steele) keep it deterministic and free of scatters.
    """
    pos = torch.arange(x.shape[-1], device=x.device)
    acc, step = x, 1
    while step < x.shape[-1]:
        shifted = torch.nn.functional.pad(acc[:, :-step], (step, 0))
        acc = torch.where(pos - step >= first, acc + shifted, acc)
        step *= 2
    return torch.gather(acc, -1, last)


def sequence_totals(x: torch.Tensor, mask: torch.Tensor,
                    segment_ids: Optional[torch.Tensor]) -> torch.Tensor:
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
    capped = torch.zeros_like(high)
    q = torch.where(high, opts.ratio_high, torch.where(low, opts.ratio_low, ratio))
    if opts.neg_cap is not None:
        capped = (adv < 0) & (ratio > opts.neg_cap)
        q = torch.where(capped, opts.neg_cap, q)
    return q, low, high, capped


def _cispo_weight(ratio, opts: PolicyLossOptions):
    """CISPO's weight ``sg(clip(ratio, ratio_low, ratio_high))`` (every advantage) and its
    low / high / (never) dual-clip indicators."""
    high, low = ratio > opts.ratio_high, ratio < opts.ratio_low
    weight = torch.where(high, opts.ratio_high, torch.where(low, opts.ratio_low, ratio))
    return weight.detach(), low, high, torch.zeros_like(high)


def _denominator(loss_agg: LossAgg, n_tok, n_seq, width: int, loss_normalizer: Normalizer):
    """``D`` of ``sum(a * loss) / D``; a count of 0 becomes 1 (its numerator is 0)."""
    if loss_agg == "none":  # per token: no denominator (a normaliser is refused with it)
        return 1.0
    if loss_normalizer is not None:
        return loss_normalizer
    if loss_agg == "token-mean":
        return n_tok.clamp(min=1)
    if loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        return n_seq.clamp(min=1)
    return 1.0 if loss_agg == "token-sum" else float(width)


def aggregation_weights(
    mask: torch.Tensor, inputs: TokenInputs, opts: PolicyLossOptions
) -> torch.Tensor:
    """Per-token weights ``a_t / D`` with ``loss = sum_t w_t * loss_t``: float32 ``[R, T]``.

    Depends only on the mask, the segment ids and the normaliser (never on
    log-probs), so fused kernels take it precomputed; 0 on inactive tokens.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    weights = torch.ones(mask.shape, dtype=torch.float32, device=mask.device)
    n_seq = None
    if opts.seq_aggregation:
        first, last, starts = _segments(mask, inputs.segment_ids)
        n_seq = starts.sum()
        if opts.loss_agg == "seq-mean-token-mean":
            weights = 1.0 / _segment_totals(mask.float(), first, last).clamp(min=1)
    denom = _denominator(opts.loss_agg, mask.sum(), n_seq, mask.shape[-1], inputs.loss_normalizer)
    return torch.where(mask, weights / denom, zero)


def policy_objective(
    logp: torch.Tensor,
    logp_ref: Optional[torch.Tensor],
    mask: torch.Tensor,
    inputs: TokenInputs,
    opts: PolicyLossOptions,
    entropy: torch.Tensor,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` from per-token inputs laid out ``[R, T]``.

    Args:
      logp: float32 ``[R, T]``, differentiable.
      logp_ref: float32 ``[R, T]`` detached, or None (then the KL is 0).
      mask: bool ``[R, T]``.
      inputs: the other per-token inputs (:func:`token_inputs`).
      opts: validated options (``ratiokl.spec.policy_loss_options``).
      entropy: float32 ``[R, T]``, the tokens' entropies; differentiated only when
        ``opts.entropy_coef`` may be non-zero (``- entropy_coef * H`` joins each token's
        loss before the aggregation), else only averaged into ``entropy_mean``.

    Returns:
      The float32 0-d loss (``loss_agg="none"``: the per-token loss ``[R, T]``, 0 on
      inactive tokens) and a dict of detached float32 0-d metrics.
    """
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp, zero)
    # On-policy (no old_logps): old = sg(logp), r = 1 with the gradient of logp.
    old = logp.detach() if inputs.old_logps is None else torch.where(
        mask, inputs.old_logps, zero)
    adv = torch.where(mask, inputs.advantages, zero)
    need_segments = opts.sequence_ratio or opts.seq_aggregation
    if need_segments:
        first, last, starts = _segments(mask, inputs.segment_ids)
        counts = _segment_totals(mask.float(), first, last).clamp(min=1)
    log_ratio = logp - old
    if opts.sequence_ratio:
        seq_mean = _segment_totals(log_ratio.detach(), first, last) / counts
        # GSPO-token form (verl): value sg(s_i), gradient on the token's own logp. An
        # infinite logp (its action masked out with -inf) adds 0, not inf - inf = NaN: the
        # value stays s_i (then beyond the bound: no gradient), as in the spec.
        own = torch.where(torch.isinf(logp), zero, logp - logp.detach())
        log_ratio = torch.where(mask, seq_mean + own, zero)
    ratio = torch.exp(_bounded(log_ratio, opts.log_ratio_bound))
    if opts.cispo:  # the gradient goes through logp only, on every active token
        q, low, high, capped = _cispo_weight(ratio, opts)
        per_token = -adv * q * logp
    else:
        q, low, high, capped = _clipped_ratio(ratio, adv, opts)
        per_token = -adv * q
    if inputs.importance_weights is not None:
        per_token = per_token * torch.where(mask, inputs.importance_weights, zero)
    kl = zero.expand(mask.shape)
    if logp_ref is not None:
        d = torch.where(mask, logp_ref, zero) - logp
        kl = _kl(d, opts.kl_code, ratio, opts.log_ratio_bound)
        if isinstance(opts.kl_coef, torch.Tensor):  # 0: the KL is only logged (0 * inf: NaN)
            per_token = torch.where(opts.kl_coef != 0.0, per_token + opts.kl_coef * kl,
                                    per_token)
        elif opts.uses_kl:
            per_token = per_token + opts.kl_coef * kl
    entropy = torch.where(mask, entropy, zero)
    if isinstance(opts.entropy_coef, torch.Tensor):  # 0: only logged, as the KL's
        per_token = torch.where(opts.entropy_coef != 0.0,
                                per_token - opts.entropy_coef * entropy, per_token)
    elif opts.uses_entropy:
        per_token = per_token - opts.entropy_coef * entropy
    if opts.loss_agg == "seq-mean-token-mean":
        per_token = per_token / counts
    n_tok = mask.sum()
    n_seq = starts.sum() if need_segments else None
    metrics = token_metrics(mask, n_tok, low, high, capped, ratio, kl, old - logp, entropy)
    if opts.per_token:
        return torch.where(mask, per_token, zero), metrics
    denom = _denominator(opts.loss_agg, n_tok, n_seq, mask.shape[-1], inputs.loss_normalizer)
    loss = torch.where(mask, per_token, zero).sum() / denom
    return loss, metrics


def token_metrics(
    mask, n_tok, low, high, capped, ratio, kl, approx_kl, entropy
) -> Dict[str, torch.Tensor]:
    """Detached means over active tokens (0 when there is none); per-token inputs, any shape.

    The eight sums are one masked reduction of a stacked ``[8, ...]`` tensor
    (a handful of launches, not one chain per metric: host time is what a
    few-token step pays for).
    """
    per_token = (low | high, low, high, capped, ratio, kl, approx_kl, entropy)
    with torch.no_grad():
        parts = torch.stack([x.float() for x in per_token])
        zero = torch.zeros((), dtype=torch.float32, device=mask.device)
        sums = torch.where(mask, parts, zero).reshape(len(per_token), -1).sum(dim=1)
        means = sums / n_tok.clamp(min=1).float()
    clip_m, low_m, high_m, capped_m, ratio_m, kl_m, approx_m, entropy_m = means.unbind()
    return {
        "clip_fraction": clip_m,
        "clip_fraction_low": low_m,
        "clip_fraction_high": high_m,
        "dual_clip_fraction": capped_m,
        "ratio_mean": ratio_m,
        "kl_mean": kl_m,
        "approx_kl": approx_m,
        "entropy_mean": entropy_m,
    }
