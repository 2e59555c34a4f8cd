"""The PPO/GRPO objective on per-token log-probs: ``[R, T]``-sized PyTorch ops.

``ratiokl.torch.loss.policy_loss`` gets ``logp`` from a backend's
differentiable ``selected_logprobs`` and hands it here with the other
per-token inputs laid out as ``R`` rows of ``T`` tokens; autograd
differentiates the result. The math is ``ratiokl.spec.policy_loss``'s.

Inactive tokens' inputs are replaced with neutral values *before* any
arithmetic and every intermediate stays finite on them, so a NaN there never
sits in an untaken ``torch.where`` branch whose gradient would be ``0 * NaN``.
No function here synchronises with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl.spec import PolicyLossOptions
from ratiokl.torch import _checks

__all__ = [
    "TokenInputs", "aggregation_weights", "as_rows", "policy_objective", "token_inputs",
    "token_metrics",
]

Normalizer = Union[None, float, torch.Tensor]


def as_rows(x: torch.Tensor, lead: Tuple[int, ...]) -> torch.Tensor:
    """A per-token tensor of leading shape ``[..., T]`` viewed as ``[R, T]``."""
    if not lead:
        return x.reshape(1, 1)
    return x.reshape(math.prod(lead[:-1]), lead[-1])  # explicit R: T may be 0


@dataclass(frozen=True)
class TokenInputs:
    """``policy_loss``'s per-token inputs, validated, detached, laid out ``[R, T]``."""

    old_logps: torch.Tensor  # float32
    advantages: torch.Tensor  # float32, broadcast over tokens
    segment_ids: Optional[torch.Tensor]  # integer
    importance_weights: Optional[torch.Tensor]  # float32
    loss_normalizer: Normalizer


def _check_advantages(advantages: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """Per token ``[...]``, or per sequence ``lead[:-1]`` / ``lead[:-1] + [1]``; ``[R, T]`` out."""
    if not isinstance(advantages, torch.Tensor) or not advantages.dtype.is_floating_point:
        raise TypeError("`advantages` must be a floating torch.Tensor (float32 recommended)")
    shape = tuple(advantages.shape)
    if shape != lead and not (lead and shape in (lead[:-1], lead[:-1] + (1,))):
        raise ValueError(
            f"`advantages` must have shape {list(lead)} (per token) or {list(lead[:-1])} "
            f"(per sequence); got {list(shape)}"
        )
    adv = advantages.detach().float()
    if shape != lead:
        adv = adv.reshape(lead[:-1] + (1,)).expand(lead)
    return as_rows(adv, lead)


def _check_normalizer(value: object) -> Normalizer:
    """None, a positive finite Python number, or a 0-d floating tensor (not inspected)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.dtype.is_floating_point:
            raise ValueError("`loss_normalizer` tensor must be a 0-d floating tensor")
        return value.detach().float()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("`loss_normalizer` must be None, a Python number or a 0-d tensor")
    if not 0.0 < float(value) < math.inf:  # comparisons: they trace with dynamic=True
        raise ValueError(f"`loss_normalizer` must be a positive finite number; got {value}")
    return float(value)


def token_inputs(
    lead: Tuple[int, ...],
    old_logps: object,
    advantages: object,
    segment_ids: object,
    importance_weights: object,
    loss_normalizer: object,
) -> TokenInputs:
    """Validate ``policy_loss``'s per-token arguments (errors name the argument)."""
    old = _checks.check_row_values("old_logps", old_logps, lead)
    weights = None
    if importance_weights is not None:
        weights = _checks.check_row_values("importance_weights", importance_weights, lead)
        weights = as_rows(weights.detach().float(), lead)
    segs = None
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype.is_floating_point \
                or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
            raise TypeError("`segment_ids` must be an integer torch.Tensor (e.g. int32)")
        if tuple(segment_ids.shape) != lead:
            raise ValueError(
                f"`segment_ids` must have the leading shape {list(lead)}; "
                f"got {list(segment_ids.shape)}"
            )
        segs = as_rows(segment_ids, lead)
    return TokenInputs(
        old_logps=as_rows(old.detach().float(), lead),
        advantages=_check_advantages(advantages, lead),
        segment_ids=segs,
        importance_weights=weights,
        loss_normalizer=_check_normalizer(loss_normalizer),
    )


def _bounded(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """``clip(x, -bound, bound)`` with gradient 1 inside ``[-bound, bound]``, 0 outside."""
    if bound is None:
        return x
    return torch.where(x > bound, bound, torch.where(x < -bound, -bound, x))


def _straight_through(grad_like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The value of ``value`` with the gradient of ``grad_like``."""
    return grad_like - grad_like.detach() + value.detach()


def _kl(d: torch.Tensor, code: int, ratio: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """KL variant ``code`` (``ratiokl.spec.POLICY_KL_ESTIMATORS``) on ``d = logp_ref - logp``."""
    d_b = _bounded(d, bound)
    k3 = torch.expm1(d_b) - d_b
    k2 = 0.5 * d * d
    if code == 1:
        return -d
    if code == 2:
        return k2
    if code == 3:
        return k3
    if code == 4:
        return _straight_through(k2, -d)
    if code == 5:
        return _straight_through(k2, k3)
    return ratio * k3


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


def _denominator(agg_code: int, n_tok, n_seq, width: int, loss_normalizer: Normalizer):
    """``D`` of ``sum(a * loss) / D``; a count of 0 becomes 1 (its numerator is 0)."""
    if loss_normalizer is not None:
        return loss_normalizer
    if agg_code == 0:
        return n_tok.clamp(min=1)
    if agg_code in (2, 3):
        return n_seq.clamp(min=1)
    return 1.0 if agg_code == 1 else float(width)


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
    if opts.agg_code in (2, 3):
        first, last, starts = _segments(mask, inputs.segment_ids)
        n_seq = starts.sum()
        if opts.agg_code == 2:
            weights = 1.0 / _segment_totals(mask.float(), first, last).clamp(min=1)
    denom = _denominator(opts.agg_code, mask.sum(), n_seq, mask.shape[-1], inputs.loss_normalizer)
    return torch.where(mask, weights / denom, zero)


def policy_objective(
    logp: torch.Tensor,
    logp_ref: Optional[torch.Tensor],
    mask: torch.Tensor,
    inputs: TokenInputs,
    opts: PolicyLossOptions,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` from per-token inputs laid out ``[R, T]``.

    Args:
      logp: float32 ``[R, T]``, differentiable (the only input that is).
      logp_ref: float32 ``[R, T]`` detached, or None (then the KL is 0).
      mask: bool ``[R, T]``.
      inputs: the other per-token inputs (:func:`token_inputs`).
      opts: validated options (``ratiokl.spec.policy_loss_options``).

    Returns:
      The float32 0-d loss and a dict of detached float32 0-d metrics.
    """
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp, zero)
    old = torch.where(mask, inputs.old_logps, zero)
    adv = torch.where(mask, inputs.advantages, zero)
    need_segments = opts.sequence_ratio or opts.agg_code in (2, 3)
    if need_segments:
        first, last, starts = _segments(mask, inputs.segment_ids)
        counts = _segment_totals(mask.float(), first, last).clamp(min=1)
    log_ratio = logp - old
    if opts.sequence_ratio:
        seq_mean = _segment_totals(log_ratio.detach(), first, last) / counts
        # GSPO-token form (verl): value sg(s_i), gradient on the token's own logp.
        log_ratio = torch.where(mask, seq_mean + (logp - logp.detach()), zero)
    ratio = torch.exp(_bounded(log_ratio, opts.log_ratio_bound))
    q, low, high, capped = _clipped_ratio(ratio, adv, opts)
    per_token = -adv * q
    if inputs.importance_weights is not None:
        per_token = per_token * torch.where(mask, inputs.importance_weights, zero)
    kl = zero.expand(mask.shape)
    if logp_ref is not None:
        d = torch.where(mask, logp_ref, zero) - logp
        kl = _kl(d, opts.kl_code, ratio, opts.log_ratio_bound)
        if opts.kl_coef != 0.0:  # kl_coef = 0: the KL is only logged (0 * inf would be NaN)
            per_token = per_token + opts.kl_coef * kl
    if opts.agg_code == 2:
        per_token = per_token / counts
    n_tok = mask.sum()
    n_seq = starts.sum() if need_segments else None
    denom = _denominator(opts.agg_code, n_tok, n_seq, mask.shape[-1], inputs.loss_normalizer)
    loss = torch.where(mask, per_token, zero).sum() / denom
    return loss, token_metrics(mask, n_tok, low, high, capped, ratio, kl, old - logp)


def token_metrics(
    mask, n_tok, low, high, capped, ratio, kl, approx_kl
) -> Dict[str, torch.Tensor]:
    """Detached means over active tokens (0 when there is none); per-token inputs, any shape.

    The seven sums are one masked reduction of a stacked ``[7, ...]`` tensor
    (a handful of launches, not one chain per metric: host time is what a
    few-token step pays for).
    """
    per_token = (low | high, low, high, capped, ratio, kl, approx_kl)
    with torch.no_grad():
        parts = torch.stack([x.float() for x in per_token])
        zero = torch.zeros((), dtype=torch.float32, device=mask.device)
        sums = torch.where(mask, parts, zero).reshape(len(per_token), -1).sum(dim=1)
        means = sums / n_tok.clamp(min=1).float()
    clip_m, low_m, high_m, capped_m, ratio_m, kl_m, approx_m = means.unbind()
    return {
        "clip_fraction": clip_m,
        "clip_fraction_low": low_m,
        "clip_fraction_high": high_m,
        "dual_clip_fraction": capped_m,
        "ratio_mean": ratio_m,
        "kl_mean": kl_m,
        "approx_kl": approx_m,
    }
