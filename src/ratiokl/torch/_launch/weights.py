"""The row-weight launches: the token-mean aggregation weights and the rollout correction's
weights and metrics, each one single-program launch over the rows.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ratiokl._kernels.loss_rows import ROWS_BLOCK, ROWS_WARPS, token_weights_kernel
from ratiokl._kernels.rollout import rollout_constexprs, rollout_weights_kernel
from ratiokl.torch._launch.op import KernelOp

__all__ = ["ROLLOUT_WEIGHTS", "TOKEN_WEIGHTS", "rollout_weights", "token_weights"]

Tensor = torch.Tensor


def token_weights(kernels: Callable, mask: Tensor) -> Tensor:
    """``w = where(mask, 1 / D, 0)`` float32 ``[N]``, ``D`` = the active rows (at least 1)."""
    w = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    if mask.numel():
        kernels(token_weights_kernel)[(1,)](mask, w, mask.numel(), BLOCK=ROWS_BLOCK,
                                            num_warps=ROWS_WARPS)
    return w


TOKEN_WEIGHTS = KernelOp(token_weights, fake=lambda mask, *_: mask.new_empty(
    mask.shape, dtype=torch.float32))


def rollout_weights(kernels: Callable, mask: Tensor, old: Tensor, rollout: Tensor,
                    seq: Optional[Tensor], iw: Optional[Tensor], seq_width: int, masks: bool,
                    corrects: bool, low: float, high: float,
                    bound: float) -> Tuple[Tensor, Tensor]:
    """``(w * iw, metrics)``: float32 ``[N]`` (0 on inactive rows) and float32 ``[3]``
    (``ratiokl.spec.ROLLOUT_METRIC_NAMES``) from ``rollout_weights_kernel``.

    ``seq``: the sequence log-weights, one per ``seq_width`` rows (None: token level);
    ``iw``: importance weights or None; the rest: ``rollout_constexprs``' arguments.
    """
    w = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    metrics = torch.empty(3, dtype=torch.float32, device=mask.device)
    if not mask.numel():
        return w, metrics.zero_()
    kernels(rollout_weights_kernel)[(1,)](
        mask, old, rollout, old if seq is None else seq, old if iw is None else iw, w, metrics,
        mask.numel(), seq_width, num_warps=ROWS_WARPS,
        **rollout_constexprs(masks, corrects, low, high, bound, seq is not None, iw is not None),
    )
    return w, metrics


ROLLOUT_WEIGHTS = KernelOp(rollout_weights, fake=lambda mask, *_: (
    mask.new_empty(mask.shape, dtype=torch.float32), mask.new_empty(3, dtype=torch.float32)))
