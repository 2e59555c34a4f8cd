"""TRL's entropy bonus between steps: the coefficient a step applies, and what it logs.

TRL 1.16 subtracts ``c * mean(H) / GA`` from each micro-batch's loss (the mean over its
active tokens, or with ``top_entropy_quantile < 1`` its high-entropy ones). ``c`` is
``entropy_coef``, or with ``use_adaptive_entropy`` a controller (arXiv:2505.22312): ``c``
applies only while the previous optimizer step's entropy (the
token mean over the accumulation window and every process) is at most
``entropy_target``, and after each optimizer step ``c`` moves by ``entropy_coef_delta``
towards more bonus when that entropy is at most the target, less otherwise, within
``[entropy_coef_min, entropy_coef_max]``. The state lives in TRL's own attributes
(``entropy_coef``, ``_last_world_entropy``, ``_entropy_window_stats``), which TRL's
checkpoints save and restore.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["applied_coef", "after_step"]

#: The loss types whose loss TRL logs per micro-batch, before dividing by ``GA``.
_PER_MICRO_BATCH = ("grpo", "bnpo", "dr_grpo", "luspo", "sapo")


def applied_coef(trainer: Any) -> float:
    """The bonus coefficient of this micro-batch: ``entropy_coef``, or with the adaptive
    controller ``entropy_coef`` where the last optimizer step's entropy is at most
    ``entropy_target`` and 0 before the first step or above the target."""
    if not trainer.use_adaptive_entropy:
        return float(trainer.entropy_coef)
    if trainer._last_world_entropy <= trainer.args.entropy_target:
        return float(trainer.entropy_coef)
    return 0.0


def _update_controller(trainer: Any, entropy_sum: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add the micro-batch to the window; at an optimizer step, the window's entropy over
    every process moves the coefficient, and the window starts again."""
    stats = torch.stack([entropy_sum, tokens]).detach()
    window = trainer._entropy_window_stats
    trainer._entropy_window_stats = stats if window is None else window + stats
    if not trainer.accelerator.sync_gradients:
        return
    totals = trainer.accelerator.reduce(trainer._entropy_window_stats, reduction="sum")
    entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
    args = trainer.args
    if entropy <= args.entropy_target:
        trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta,
                                   args.entropy_coef_max)
    else:
        trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta,
                                   args.entropy_coef_min)
    trainer._last_world_entropy = entropy
    trainer._entropy_window_stats = None


def after_step(trainer: Any, mode: str, loss: torch.Tensor, entropy: torch.Tensor,
               tokens: torch.Tensor, coef: float, train: bool) -> None:
    """After a micro-batch with the bonus ``coef`` on the mean ``entropy`` of its
    ``tokens`` (the active ones, or with ``top_entropy_quantile < 1`` the high-entropy
    ones): log ``policy_loss`` (the loss without the bonus, times ``GA`` for the loss types
    TRL logs per micro-batch; gathered, NaN-mean), move the adaptive controller (training
    only), and at each optimizer step in training log ``entropy_coef``."""
    steps = trainer.current_gradient_accumulation_steps if train else 1
    policy = loss.detach() + coef * entropy / steps
    if trainer.args.loss_type in _PER_MICRO_BATCH:
        policy = policy * steps
    trainer._metrics[mode]["policy_loss"].append(
        trainer.accelerator.gather(policy).nanmean().item())
    if trainer.use_adaptive_entropy and train:
        _update_controller(trainer, entropy * tokens, tokens)
    if train and trainer.accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
