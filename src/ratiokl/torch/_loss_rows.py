"""The fused policy loss's row vectors in one launch each: aggregation weights and metrics.

``_kernels.loss_rows`` as PyTorch ops, bound like the other launches
(``_triton.choose_op``): a ``triton_op`` while ``torch.compile`` traces, the
kernel itself in eager CUDA, the interpreter twin on CPU tensors. Neither
has a gradient: the weights depend only on the mask and the metrics are
detached.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch
from torch.library import custom_op, triton_op, wrap_triton

from ratiokl._kernels import interpreted
from ratiokl._kernels.loss_rows import (
    METRIC_NAMES,
    METRICS_OUT,
    ROWS_BLOCK,
    ROWS_WARPS,
    policy_metrics_kernel,
    token_denominator,
    token_weights_kernel,
)
from ratiokl.spec import PolicyLossOptions
from ratiokl.torch import _objective, _triton

__all__ = ["aggregation_weights", "loss_and_metrics"]


def _weights(kernel, mask: torch.Tensor, denom: float, count: bool) -> torch.Tensor:
    w = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    if mask.numel():
        kernel[(1,)](mask, w, mask.numel(), denom, COUNT=count, BLOCK=ROWS_BLOCK,
                     num_warps=ROWS_WARPS)
    return w


def _metrics(kernel, mask, logp, ratio, kl, bits, old, loss_rows) -> torch.Tensor:
    """The seven metrics and the loss; the kernel writes all eight (no memset); 0 without rows."""
    if not mask.numel():
        return torch.zeros(METRICS_OUT, dtype=torch.float32, device=mask.device)
    out = torch.empty(METRICS_OUT, dtype=torch.float32, device=mask.device)
    kernel[(1,)](mask, logp, ratio, kl, bits, old, loss_rows, out, mask.numel(),
                 BLOCK=ROWS_BLOCK, num_warps=ROWS_WARPS)
    return out


@triton_op("ratiokl::token_weights", mutates_args=())
def _triton_weights(mask: torch.Tensor, denom: float, count: bool) -> torch.Tensor:
    return _weights(wrap_triton(token_weights_kernel), mask, denom, count)


@triton_op("ratiokl::policy_metrics", mutates_args=())
def _triton_metrics(mask: torch.Tensor, logp: torch.Tensor, ratio: torch.Tensor,
                    kl: torch.Tensor, bits: torch.Tensor, old: torch.Tensor,
                    loss_rows: torch.Tensor) -> torch.Tensor:
    return _metrics(wrap_triton(policy_metrics_kernel), mask, logp, ratio, kl, bits, old,
                    loss_rows)


@custom_op("ratiokl::interpret_token_weights", mutates_args=(), device_types="cpu")
def _interpret_weights(mask: torch.Tensor, denom: float, count: bool) -> torch.Tensor:
    return _weights(interpreted(token_weights_kernel), mask, denom, count)


@_interpret_weights.register_fake
def _(mask, denom, count):
    return mask.new_empty(mask.shape, dtype=torch.float32)


@custom_op("ratiokl::interpret_policy_metrics", mutates_args=(), device_types="cpu")
def _interpret_metrics(mask: torch.Tensor, logp: torch.Tensor, ratio: torch.Tensor,
                       kl: torch.Tensor, bits: torch.Tensor, old: torch.Tensor,
                       loss_rows: torch.Tensor) -> torch.Tensor:
    with np.errstate(all="ignore"):  # NaN on inactive rows is data, selected out
        return _metrics(interpreted(policy_metrics_kernel), mask, logp, ratio, kl, bits, old,
                        loss_rows)


@_interpret_metrics.register_fake
def _(mask, logp, ratio, kl, bits, old, loss_rows):
    return mask.new_empty(METRICS_OUT, dtype=torch.float32)


def _eager_weights(mask: torch.Tensor, denom: float, count: bool) -> torch.Tensor:
    return _weights(_triton._raw(token_weights_kernel), mask, denom, count)


def _eager_metrics(*rows: torch.Tensor) -> torch.Tensor:
    return _metrics(_triton._raw(policy_metrics_kernel), *rows)


def aggregation_weights(mask_rows: torch.Tensor, inputs: _objective.TokenInputs,
                        opts: PolicyLossOptions) -> torch.Tensor:
    """``_objective.aggregation_weights`` (float32 ``[R, T]``), one launch where it can be.

    Where every active token weighs the same (``token-mean``, ``token-sum``,
    ``seq-mean-token-sum-norm``; ``seq-mean-token-sum`` with a numeric
    ``loss_normalizer``): ``token_weights_kernel``. The others (sequence
    counts or lengths, a tensor normaliser) take ``_objective``'s ops.
    """
    denom, count = token_denominator(opts, inputs.loss_normalizer, mask_rows.shape[-1])
    if denom is None and not count:
        return _objective.aggregation_weights(mask_rows, inputs, opts)
    op = _triton.choose_op(mask_rows.device, _interpret_weights, _triton_weights, _eager_weights)
    return op(mask_rows, 1.0 if denom is None else denom, count)


class _RowsTotal(torch.autograd.Function):
    """``sum(loss_rows)`` given already summed (``total``): the sum's gradient, no launch.

    The backward hands every row the upstream value (a stride-0 expand).
    """

    @staticmethod
    def forward(ctx, loss_rows: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        ctx.rows = loss_rows.shape
        return total.view_as(total)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g.expand(ctx.rows), None


def loss_and_metrics(loss_rows, mask, logp, ratio, kl, bits,
                     old) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The loss ``sum(loss_rows)`` and the metrics of ``_objective.token_metrics``, one launch.

    ``loss_rows``: the fused kernel's float32 ``[N]`` weighted losses (0 on
    inactive rows), differentiable; ``mask`` bool; ``logp``, ``ratio``, ``kl``,
    ``old`` float32; ``bits`` int32 clip bits. Returns the float32 0-d loss
    (its gradient flows to ``loss_rows``) and detached float32 0-d metrics
    (views of one ``[8]`` tensor).
    """
    op = _triton.choose_op(mask.device, _interpret_metrics, _triton_metrics, _eager_metrics)
    out = op(mask, logp, ratio, kl, bits, old, loss_rows.detach())
    return _RowsTotal.apply(loss_rows, out[-1]), dict(zip(METRIC_NAMES, out[:-1].unbind()))
