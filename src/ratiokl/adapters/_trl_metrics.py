"""TRL's logged metrics from ratiokl's, under TRL's names and definitions.

Token metrics (``entropy``, ``kl``, ``clip_ratio/*_mean``) are means over every process's
active tokens; with GSPO TRL's clip ratios are means over the sequences (every row of
every process), recomputed here from the pass's log-probs (the entropy bonus's
``policy_loss`` and ``entropy_coef``: ``_trl_bonus``). Each function takes the adapter's
trainer (``ratiokl.adapters.trl.GRPOTrainer``) and appends to its ``_metrics``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ratiokl.adapters._sequence_ratio import clip_indicators
from ratiokl.adapters._trl_options import PPO_TYPES

__all__ = ["log_metrics", "sequence_clips"]

#: TRL's clip-ratio metrics and ratiokl's names for them.
_CLIP_METRICS = (("clip_ratio/low_mean", "clip_fraction_low"),
                 ("clip_ratio/high_mean", "clip_fraction_high"),
                 ("clip_ratio/region_mean", "clip_fraction"))


def _counts_high(trainer: Any) -> bool:
    """Whether TRL can count a ratio as clipped high: it compares the ratio already capped
    at ``delta`` with ``1 + epsilon_high``, so never where ``delta`` is not above it."""
    delta = trainer.args.delta
    return delta is None or delta > 1.0 + trainer.epsilon_high


def sequence_clips(trainer: Any, logp: Optional[torch.Tensor],
                   batch: Dict[str, Any]) -> Optional[List[torch.Tensor]]:
    """GSPO's clip indicators (low, high, either), TRL's definition: ``r = exp(masked mean
    of logp - old)`` per sequence, clipped where it leaves ``[1 - epsilon, 1 +
    epsilon_high]`` on the advantage's side (never high where ``delta``, which caps ``r``
    first, is not above ``1 + epsilon_high``). Float ``[B]`` each (one per sequence) for
    advantages ``[B]`` or ``[B, 1]``; float ``[B, T]`` for per-token advantages ``[B, T]``,
    whose indicators TRL averages over the active tokens (:func:`log_metrics` counts each
    as it is shaped). None at the token level or for ``cispo`` (``logp`` None: the one-pass
    route)."""
    options = trainer._ratiokl_options
    if logp is None or options["ratio_level"] != "sequence" \
            or trainer.args.loss_type not in PPO_TYPES:
        return None
    low, high = clip_indicators(logp, batch["old_logps"], batch["advantages"], batch["mask"],
                                trainer.epsilon_low, trainer.epsilon_high)
    if not _counts_high(trainer):
        high = torch.zeros_like(high)
    return [low.float(), high.float(), (low | high).float()]


def log_metrics(trainer: Any, mode: str, metrics: Dict[str, torch.Tensor], mask: torch.Tensor,
                clips: Optional[List[torch.Tensor]]) -> None:
    """``entropy``, ``kl`` (with ``beta``) and the clip ratios (PPO loss types; with
    ``clips``, from :func:`sequence_clips`, over the sequences or the active tokens as
    they are shaped): one all-reduce of the sums and counts."""
    tokens = mask.sum().float()
    names: List[str] = ["entropy"]
    sums, counts = [metrics["entropy_mean"] * tokens], [tokens]
    if trainer._ratiokl_options["kl_coef"] != 0.0:
        names.append("kl")
        sums.append(metrics["kl_mean"] * tokens)
        counts.append(tokens)
    if trainer.args.loss_type in PPO_TYPES:
        rows = torch.tensor(float(mask.shape[0]), device=tokens.device)
        token_clips = dict(metrics)
        if not _counts_high(trainer):  # ratiokl's high clips are at delta: TRL counts none
            token_clips.update(clip_fraction_high=torch.zeros_like(tokens),
                               clip_fraction=metrics["clip_fraction_low"])
        for i, (theirs, ours) in enumerate(_CLIP_METRICS):
            names.append(theirs)
            if clips is None:
                sums.append(token_clips[ours] * tokens)
                counts.append(tokens)
            elif clips[i].dim() == 1:  # one per sequence: every row counts
                sums.append(clips[i].sum())
                counts.append(rows)
            else:  # per token: the active ones
                sums.append(torch.where(mask, clips[i], 0.0).sum())
                counts.append(tokens)
    if "vespo_phi" in metrics:  # TRL's mean of the gamma weight: per sequence, or token
        phi = metrics["vespo_phi"].detach()
        names.append("vespo/phi_seq_mean")
        if phi.shape[-1] == 1:
            sums.append(phi.sum())
            counts.append(torch.tensor(float(mask.shape[0]), device=tokens.device))
        else:
            sums.append(torch.where(mask, phi, 0.0).sum())
            counts.append(tokens)
    totals = trainer.accelerator.reduce(torch.stack(sums + counts), reduction="sum")
    for i, name in enumerate(names):
        mean = totals[i] / totals[len(names) + i].clamp(min=1.0)
        trainer._metrics[mode][name].append(mean.item())
