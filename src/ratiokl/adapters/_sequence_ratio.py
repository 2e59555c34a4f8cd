r"""GSPO's PPO term as TRL and OpenRLHF differentiate it, for any advantages' shape.

Both trainers multiply each token's advantage :math:`A_t` (and its policy weight
:math:`w_t`: masks, vLLM's ratio) by the sequence ratio :math:`s = \exp(\text{masked mean
of the log-ratio})` and differentiate :math:`s` itself, so a sequence's policy term
reaches every one of its tokens equally:
:math:`\partial / \partial \log p_u = (s / L) \sum_t a\, w_t\, \partial \ell_t / \partial s`
(:math:`L` its active tokens, :math:`a` its aggregation weight, the same on each of its
tokens in every mode these trainers use). ratiokl's ``ratio_level="sequence"`` (the
GSPO-token form) gives token :math:`t`'s term the gradient of its own log-prob instead:
the same only when :math:`w_t A_t` is the same on every token.

Each token's clipped term is linear in :math:`A_t` on each side of 0,
:math:`\ell_t = -A_t\, q_\pm(s)` (:math:`q_+` for :math:`A_t \ge 0`: the ceiling and the
cap; :math:`q_-`: the floor and the dual clip). So a sequence's policy term is
:math:`-a\,(P\, q_+(s) + N\, q_-(s))`, with :math:`P` and :math:`N` the sums of
:math:`w_t A_t` over its tokens of positive and of negative advantage. The GSPO-token
term with the advantage :math:`P / L` on each token has that value's first half, and
gives every token the gradient :math:`-a\,(P / L)\, q_+'(s)\, s`: the trainers' own.
:func:`spread_objective` sums two calls of
:func:`~ratiokl.torch.loss.policy_objective`, one per side (the KL and the entropy
terms, per token in both trainers, in the first only). :func:`clip_indicators` are the
trainers' clip counts on the advantages as given.

TRL's bias-corrected KL (``use_bias_correction_kl``) weighs each token's k3 by the same
differentiated :math:`s`: :math:`a\, s\, k_t`, whose gradient on token :math:`u` is
:math:`a\, s\, k_u' + a\, (s / L) \sum_t k_t`. ratiokl's ``"k3-is"`` at the sequence level
has the value and the first part, and :math:`a\, s\, k_u` for the second.
:func:`sequence_kl_spread` adds the difference, :math:`a\, s\, (\bar k - k_u)` on token
:math:`u`, with value 0: the gradient of a CISPO term (weight :math:`\mathrm{sg}(s)`, never
clipped) with the advantage :math:`c_\mathrm{KL} (k_u - \bar k)`, minus its own value.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

import math

from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND
from ratiokl.torch.loss import policy_objective

__all__ = ["clip_indicators", "sequence_kl_spread", "split_advantages", "spread_objective"]

#: Options that belong to the KL and entropy terms (the first call's only).
_TERM_OPTIONS = ("kl_agg", "entropy_agg", "kl_entropy_normalizer", "kl_clamp")


def split_advantages(advantages: torch.Tensor, weights: Optional[torch.Tensor],
                     mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(positive, negative)`` ``[B, T]``: the mean over each sequence's active tokens of
    ``max(w * A, 0)`` and of ``min(w * A, 0)``, on each of its tokens (0 on a sequence
    without an active token). ``advantages`` ``[B]``, ``[B, 1]`` or ``[B, T]``;
    ``weights`` (non-negative) ``[B, T]`` or None. A NaN on an active token stays NaN (in
    both); inactive tokens are never read."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    weighted = advantages.expand(mask.shape).float()
    if weights is not None:
        weighted = weighted * weights
    count = mask.sum(-1, keepdim=True).clamp(min=1)

    def mean(values: torch.Tensor) -> torch.Tensor:
        total = torch.where(mask, values, 0.0).sum(-1, keepdim=True)
        return (total / count).expand(mask.shape)

    return mean(weighted.clamp(min=0.0)), mean(weighted.clamp(max=0.0))


def spread_objective(logps: torch.Tensor, old_logps: Optional[torch.Tensor],
                     advantages: torch.Tensor, mask: torch.Tensor,
                     weights: Optional[torch.Tensor], options: Dict[str, Any],
                     **inputs: Any) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The trainers' GSPO loss (the module docstring): ``policy_objective`` with
    ``options`` (``ratio_level="sequence"``, ``objective="ppo"``) on the positive side of
    ``weights * advantages`` with ``inputs`` (``ref_logps``, ``entropy``, the
    normalisers), plus the negative side's policy term alone. Returns the sum and the
    first call's metrics: its ``kl_mean``, ``entropy_mean``, ``approx_kl`` and
    ``ratio_mean`` are the batch's; its clip fractions are not (the caller counts them
    on the advantages it was given)."""
    positive, negative = split_advantages(advantages, weights, mask)
    loss, metrics = policy_objective(logps, old_logps, positive, mask, **inputs, **options)
    policy_only = {k: v for k, v in options.items() if k not in _TERM_OPTIONS}
    policy_only.update(kl_coef=0.0, entropy_coef=0.0)
    other, _ = policy_objective(logps, old_logps, negative, mask,
                                loss_normalizer=inputs.get("loss_normalizer"), **policy_only)
    return loss + other, metrics


def sequence_kl_spread(logps: torch.Tensor, old_logps: Optional[torch.Tensor],
                       ref_logps: torch.Tensor, mask: torch.Tensor, options: Dict[str, Any],
                       loss_normalizer: Any) -> torch.Tensor:
    """The 0-valued term that turns ``policy_objective``'s ``kl_estimator="k3-is"`` at
    ``ratio_level="sequence"`` (``options``: ``kl_coef``, ``loss_agg``) into TRL's
    ``k3 * s`` with ``s`` differentiated (the module docstring): ``[B, T]`` inputs, rows
    the sequences; ``old_logps`` None: on-policy."""
    detached = logps.detach()
    k3, _ = policy_objective(detached, old_logps, torch.zeros_like(detached), mask,
                             ref_logps=ref_logps, kl_coef=1.0, kl_estimator="k3",
                             loss_agg="none")  # each active token's k3, 0 elsewhere
    mean = k3.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    never = math.exp(DEFAULT_LOG_RATIO_BOUND)  # above any bounded ratio: no clip
    term, _ = policy_objective(
        logps, old_logps, options["kl_coef"] * (k3 - mean), mask, objective="cispo",
        clip_eps=1.0, clip_eps_high=never, ratio_level="sequence",
        loss_agg=options["loss_agg"], loss_normalizer=loss_normalizer)
    return term - term.detach()


def clip_indicators(logps: torch.Tensor, old_logps: Optional[torch.Tensor],
                    advantages: torch.Tensor, mask: torch.Tensor, clip_eps: float,
                    clip_eps_high: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` bool: where the sequence ratio ``s = exp(masked mean of logps -
    old_logps)`` (``old_logps`` None: ``s = 1``) is below ``1 - clip_eps`` beside a
    negative advantage, or above ``1 + clip_eps_high`` beside a positive one: TRL's
    ``is_low_clipped`` / ``is_high_clipped`` and OpenRLHF's ``surr2 < surr1``. ``[B]``
    for advantages ``[B]`` or ``[B, 1]``, ``[B, T]`` (read on active tokens only) for
    ``[B, T]``."""
    logps = logps.detach()
    old = logps if old_logps is None else old_logps
    log_ratio = torch.where(mask, logps - old, 0.0).sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp(log_ratio)
    if advantages.dim() == 2 and advantages.shape[-1] > 1:
        ratio = ratio.unsqueeze(-1)
    else:
        advantages = advantages.reshape(-1)
    return ((ratio < 1 - clip_eps) & (advantages < 0),
            (ratio > 1 + clip_eps_high) & (advantages > 0))
