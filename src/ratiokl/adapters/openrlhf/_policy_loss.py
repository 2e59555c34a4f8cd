"""``PolicyLoss``: OpenRLHF's policy-loss module computed by ``policy_objective``."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ratiokl.adapters._sequence_ratio import clip_indicators, spread_objective
from ratiokl.adapters.openrlhf._options import (CorrectionGating, CorrectionLevel,
                                                CorrectionMode, PolicyLossType,
                                                loss_normalizer, loss_options)
from ratiokl.torch.loss import policy_objective

__all__ = ["PolicyLoss"]


class PolicyLoss(torch.nn.Module):
    """OpenRLHF 0.11's ``openrlhf.models.PolicyLoss`` (same constructor, same forward, same
    five outputs) on :func:`ratiokl.torch.loss.policy_objective`.

    The arguments resolve once, here (:func:`~ratiokl.adapters.openrlhf._options.
    loss_options`): ``clip_eps_low`` / ``clip_eps_high`` are ``clip_eps`` /
    ``clip_eps_high``, ``dual_clip`` is ``dual_clip``, ``token_level_loss`` picks
    ``token-mean`` over ``batch_num_tokens / dp_size`` or ``seq-mean-token-mean`` over
    ``global_batch_size / dp_size``, ``policy_loss_type="gspo"`` is
    ``ratio_level="sequence"`` at the sequence level (its sequence ratio differentiated
    as OpenRLHF does, for any advantages: ``ratiokl.adapters._sequence_ratio``), and the
    correction is ``token-mask`` (``is_correction_mode="mask"``, IcePop), ``token-clip``
    (``"clip"``, TIS with its floor) or ``sequence-geomean-mask``
    (``is_correction_level="seq"``); the ``binary_kl`` / ``tv`` gates, which ratiokl's
    corrections do not compute (they gate on the ratio), give their weight as
    ``importance_weights`` (:func:`_divergence_weights`). A ``ValueError`` naming the
    argument refuses whatever OpenRLHF's own constructor refuses.

    Inactive tokens (``action_mask`` false) are selected out before any arithmetic:
    whatever they hold, they reach neither the loss, the logged values nor a gradient
    (exactly 0 there), where OpenRLHF multiplies by the mask (a NaN there is NaN).
    """

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                 dual_clip: Optional[float] = None, token_level_loss: bool = True,
                 policy_loss_type: PolicyLossType = "ppo",
                 is_correction_level: CorrectionLevel = "off",
                 is_correction_mode: CorrectionMode = "mask",
                 is_correction_gating: CorrectionGating = "ratio",
                 is_correction_threshold: Sequence[float] = (0.5, 5.0)) -> None:
        super().__init__()
        self.opts = loss_options(clip_eps_low, clip_eps_high, dual_clip, token_level_loss,
                                 policy_loss_type, is_correction_level, is_correction_mode,
                                 is_correction_gating, is_correction_threshold)

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                advantages: torch.Tensor, action_mask: Optional[torch.Tensor] = None,
                rollout_log_probs: Optional[torch.Tensor] = None, dp_size: int = 1,
                batch_num_tokens: Optional[float] = None,
                global_batch_size: Optional[float] = None) -> Tuple[torch.Tensor, ...]:
        """``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` as OpenRLHF's.

        Args:
          log_probs: ``[B, T]`` floating action log-probs with autograd (``Actor.forward``'s).
          old_log_probs, rollout_log_probs: ``[B, T]`` floating, detached; the rollout
            ones needed with a correction level on.
          advantages: ``[B, T]`` floating (with ``policy_loss_type="gspo"`` they may vary
            within a sequence: OpenRLHF differentiates the sequence ratio, whose gradient
            reaches each of its tokens alike; ``ratiokl.adapters._sequence_ratio`` computes
            that with two ``policy_objective`` calls).
          action_mask: ``[B, T]`` bool or 0/1; None: all active.
          dp_size, batch_num_tokens, global_batch_size: ``get_loss_batch_info``'s.

        Returns:
          the float32 0-d loss; detached 0-d ``clip_ratio`` (the fraction of active
          tokens whose clipped surrogate is the smaller), ``ppo_kl`` (mean of ``old -
          logp``); with a correction on, ``vllm_kl`` (mean of ``rollout - old``) and
          ``is_filter_ratio`` (the fraction of tokens, or at the sequence level of rows,
          whose weight is outside ``[low, high]``), else None and None. Means over active
          tokens, 0 without one.
        """
        mask = torch.ones_like(log_probs, dtype=torch.bool) if action_mask is None \
            else action_mask.bool()
        opts = self.opts
        reference = rollout_log_probs if opts.ratio_to_rollout else old_log_probs
        if reference is None:  # policy_objective would read None as on-policy
            name = "rollout_log_probs" if opts.ratio_to_rollout else "old_log_probs"
            raise ValueError(
                f"ratiokl.adapters.openrlhf.PolicyLoss needs `{name}` (got None): OpenRLHF's "
                "ratio is taken against it (GSPO with is_correction_level on: the rollout "
                "log-probs); pass the batch's tensor")
        if opts.divergence is not None and rollout_log_probs is None:
            raise ValueError(
                "ratiokl.adapters.openrlhf.PolicyLoss needs `rollout_log_probs` (got None): "
                f"the is_correction_gating={opts.divergence!r} gate compares them with "
                "old_log_probs; pass the batch's tensor")
        normalizer = loss_normalizer(opts, dp_size, batch_num_tokens, global_batch_size)
        if opts.options["ratio_level"] == "sequence":  # GSPO: no rollout correction
            loss, metrics = spread_objective(log_probs, reference, advantages, mask, None,
                                             opts.options, loss_normalizer=normalizer)
            clipped = clip_indicators(log_probs, reference, advantages, mask,
                                      opts.options["clip_eps"], opts.options["clip_eps_high"])
            either = (clipped[0] | clipped[1]).float().reshape(mask.shape[0], -1)
            metrics = dict(metrics, clip_fraction=_mean(either.expand(mask.shape), mask))
        elif opts.divergence is not None:
            weights, filtered = _divergence_weights(old_log_probs, rollout_log_probs, mask, opts)
            loss, metrics = policy_objective(
                log_probs, reference, advantages, mask, loss_normalizer=normalizer,
                importance_weights=weights, **opts.options)
        else:
            loss, metrics = policy_objective(
                log_probs, reference, advantages, mask, loss_normalizer=normalizer,
                rollout_logps=rollout_log_probs if opts.corrects else None, **opts.options)
        ppo_kl = metrics["approx_kl"] if not opts.ratio_to_rollout else _mean(
            torch.where(mask, old_log_probs, 0.0) - torch.where(mask, log_probs.detach(), 0.0),
            mask)
        if not opts.corrects:
            return loss, metrics["clip_fraction"], ppo_kl, None, None
        old = torch.where(mask, old_log_probs.float(), 0.0)
        rollout = torch.where(mask, rollout_log_probs.float(), 0.0)
        if opts.divergence is None:
            filtered = _filter_ratio(old - rollout, mask, opts.bounds, opts.sequence_gate)
        return loss, metrics["clip_fraction"], ppo_kl, _mean(rollout - old, mask), filtered


def _mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Detached float32 mean of ``values`` over active tokens (0 without one)."""
    total = torch.where(mask, values.detach().float(), 0.0).sum()
    return total / mask.sum().clamp(min=1)


def _divergence_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       mask: torch.Tensor, opts) -> Tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's ``is_correction_gating="binary_kl"`` / ``"tv"`` (PPO): ``(weights,
    is_filter_ratio)``, detached float32.

    Per active token, with the sampled token's probabilities ``p = exp(rollout)`` and
    ``q = exp(old)``, each clamped to ``[1e-6, 1 - 1e-6]``, the statistic is the binary KL
    ``p log(p / q) + (1 - p) log((1 - p) / (1 - q))`` or the total variation ``|p - q|``;
    at the sequence level, its mean over the sequence's active tokens. A unit whose
    statistic is outside ``[low, high]`` weighs 0, a kept token its ratio
    ``exp(old - rollout)`` (unbounded, as OpenRLHF's). ``is_filter_ratio``: the fraction of
    active tokens (sequence level: of rows; an empty row counts) outside. A NaN log-prob on
    an active token gives a NaN weight (OpenRLHF's gate drops the token: a NaN compares
    false), as ratiokl's own corrections do; inactive tokens are never read.
    """
    low, high = opts.bounds
    old = torch.where(mask, old_log_probs.detach().float(), 0.0)
    rollout = torch.where(mask, rollout_log_probs.detach().float(), 0.0)
    p = rollout.exp().clamp(1e-6, 1 - 1e-6)
    q = old.exp().clamp(1e-6, 1 - 1e-6)
    if opts.divergence == "binary_kl":
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    else:  # "tv"
        stat = (p - q).abs()
    stat = torch.where(mask, stat, 0.0)
    if opts.sequence_gate:
        count = mask.sum(-1, keepdim=True)
        stat = stat.sum(-1, keepdim=True) / count.clamp(min=1)
        outside = (stat < low) | (stat > high)
        filtered = (outside | (count == 0)).float().mean()
    else:
        outside = (stat < low) | (stat > high)
        filtered = _mean(outside.float(), mask)
    return torch.where(mask & ~outside, (old - rollout).exp(), 0.0), filtered


def _filter_ratio(log_weight: torch.Tensor, mask: torch.Tensor, bounds, sequence: bool):
    """OpenRLHF's ``is_filter_ratio``: the fraction of active tokens whose weight
    ``exp(log_weight)`` is outside ``bounds``, or at the sequence level the fraction of all
    rows whose geometric-mean weight is (a row without an active token counts: OpenRLHF's
    gate is NaN there)."""
    low, high = bounds
    if not sequence:
        weight = torch.exp(log_weight)
        return _mean(((weight < low) | (weight > high)).float(), mask)
    count = mask.sum(-1)
    gate = torch.exp(log_weight.sum(-1) / count.clamp(min=1))
    kept = (gate >= low) & (gate <= high) & (count > 0)
    return (~kept).float().mean()
