"""TRL's VESPO loss (``loss_type="vespo"``) through ratiokl's ``policy_objective``.

TRL 1.16's VESPO term is ``-sg(phi) * A * logp``: ``phi = exp(lambda + k log w - lambda w)``
(``k``, ``lambda`` by the sign of the advantage) of the sequence's product of ratios
``w`` (vLLM's ratio folded in), a detached weight; it is not multiplied by vLLM's ratio.
That is CISPO's form on-policy (``old_logps=None``: its weight is ``sg(1)``) with ``phi``
times the masks as ``importance_weights``; ``phi`` is TRL's own ``get_gamma_weights``, as
the adapter uses TRL's own masks. TRL sums vLLM's log-ratio over every position (padded
ones hold 1 in its batches); this reads the active ones only.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ratiokl.torch.loss import policy_objective

__all__ = ["vespo_loss"]


def vespo_loss(trainer: Any, logp: torch.Tensor, entropy: torch.Tensor,
               weights: Optional[torch.Tensor], batch: Dict[str, Any], options: Dict[str, Any],
               common: Dict[str, Any]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of TRL's VESPO on the adapter's two-pass route: ``logp`` and
    ``entropy`` ``[B, T]`` (differentiable), ``weights`` the other masks or None,
    ``options`` the adapter's (``objective="cispo"``, ``clip_eps=1``,
    ``clip_eps_high=0``), ``common`` the reference log-probs and normalisers. TRL's
    bias-corrected KL weighs by the token ratio: then the KL is a second call on the
    behaviour log-probs (its policy term 0). ``metrics["vespo_phi"]``: ``phi`` (``[B, 1]``,
    or ``[B, T]`` with per-token advantages) for TRL's ``vespo/phi_seq_mean``."""
    mask, old, args = batch["mask"], batch["old_logps"], trainer.args
    detached = logp.detach()
    log_ratio = torch.zeros_like(detached) if old is None else torch.where(
        mask, detached - old, 0.0)
    ratio, adv = batch["vespo_ratio"], batch["advantages"]
    phi = trainer.get_gamma_weights(
        adv.unsqueeze(1) if adv.dim() == 1 else adv, log_ratio, mask.float(),
        ratio if ratio is None or ratio.shape[-1] == 1 else torch.where(mask, ratio, 1.0),
        k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
        lambda_neg=args.vespo_lambda_neg)
    weights = phi.expand(mask.shape) if weights is None else weights * phi
    kl_apart = options["kl_coef"] != 0.0 and options["kl_estimator"] == "k3-is" \
        and old is not None
    policy = {**options, "kl_coef": 0.0} if kl_apart else options
    loss, metrics = policy_objective(logp, None, adv, mask, entropy=entropy,
                                     importance_weights=weights, **common, **policy)
    if kl_apart:  # the ratio of k3-is is the token's own, off-policy
        kl_options = {k: v for k, v in options.items()
                      if k in ("kl_coef", "kl_estimator", "loss_agg", "ratio_level")}
        kl, kl_metrics = policy_objective(
            logp, old, torch.zeros_like(detached), mask, ref_logps=batch["ref_logps"],
            loss_normalizer=batch["normalizer"], **kl_options)
        loss, metrics = loss + kl, {**metrics, "kl_mean": kl_metrics["kl_mean"]}
    return loss, {**metrics, "vespo_phi": phi}
