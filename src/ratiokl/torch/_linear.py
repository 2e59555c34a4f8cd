"""The policy loss from the last hidden states and the lm_head weight, in row chunks.

With ``logits = hidden @ weight.T`` (``hidden [N, H]``, ``weight [V, H]``) and
``g = d loss / d logits`` (the fused kernel's gradient, exactly 0 on inactive rows)::

    d loss / d hidden = g @ weight            [N, H]
    d loss / d weight = g.T @ where(mask, hidden, 0)   [V, H]

the rows go through in chunks of ``C`` rows, never ``[N, V]`` at once. Per chunk: one
GEMM into a reusable ``[C, V]`` buffer (the weight's dtype), one launch of the fused
policy-loss kernel on it (:func:`ratiokl.torch._launch.policy_loss_rows`), which writes the
chunk's row values into the call's ``[N]`` arrays and overwrites the buffer with ``g``
(its in-place mode), then, when gradients are wanted, ``g @ weight`` into the chunk's rows of
``d hidden`` and ``g.T @ hidden`` added to ``d weight`` (accumulated in the weight's dtype,
as a materialised step's one GEMM would round once; a chunk rounds once more). One
metrics launch over all ``N`` rows closes the forward, so the loss and metrics are those
of ``policy_loss`` on the same logits. Inactive rows' hidden states are zeroed before
``g.T @ hidden`` (``0 * NaN`` would be NaN): whatever they hold stays out of both gradients.

The gradients are computed in the forward (the loss is a scalar: the backward only scales
them by the upstream value, skipping the scale on the device where it is exactly 1), so
the call holds ``d hidden`` and ``d weight`` from its forward to its backward. Memory beyond
them: the ``[C, V]`` buffer and O(N).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ratiokl._codes import KL
from ratiokl._kernels.fused_loss import launch_plan
from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.spec import PolicyLossOptions
from ratiokl.torch._checks import Temperature
from ratiokl.torch._launch import SCALE_ROWS, kernels_for, policy_loss_rows, policy_metrics, \
    row_scratch
from ratiokl.torch._once import spend
from ratiokl.torch._triton import kernel_coefficients, kernel_temperature

__all__ = ["policy_loss"]


class _LinearLoss(torch.autograd.Function):
    """``(loss, metrics)`` of ``hidden [N, H]`` and ``weight [V, H]``; gradients for both
    from the forward (``_forward``), scaled by the upstream value in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, rest):
        wants, inputs = rest
        loss, metrics, grad_hidden, grad_weight = _forward(hidden, weight, *wants, *inputs)
        ctx.grads = (grad_hidden, grad_weight)
        ctx.mask = inputs[1]
        ctx.mark_non_differentiable(metrics)
        ctx.set_materialize_grads(False)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        spend(ctx, "linear_policy_loss")  # the gradients are scaled in place: once
        if g_loss is None:
            return None, None, None
        (grad_hidden, grad_weight), ctx.grads = ctx.grads, None
        g = g_loss.to(torch.float32)
        with np.errstate(all="ignore"):  # the interpreter's NumPy noise (CPU)
            if grad_hidden is not None:
                SCALE_ROWS.direct(grad_hidden.device, grad_hidden, g, ctx.mask)
            if grad_weight is not None:
                every_row = torch.ones(grad_weight.shape[0], dtype=torch.bool,
                                       device=grad_weight.device)
                SCALE_ROWS.direct(grad_weight.device, grad_weight, g, every_row)
        return grad_hidden, grad_weight, None


def _forward(hidden: torch.Tensor, weight: torch.Tensor, want_hidden: bool, want_weight: bool,
             ids: torch.Tensor, mask: torch.Tensor, old: Optional[torch.Tensor],
             ref_logps: Optional[torch.Tensor], adv: torch.Tensor, iw: Optional[torch.Tensor],
             w: torch.Tensor, temperature: Temperature, opts: PolicyLossOptions,
             chunk_rows: int):
    """The chunk loop (module docstring): ``(loss, metrics, d hidden | None, d weight | None)``."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    write_grad = want_hidden or want_weight
    grad_hidden = torch.empty((n_rows, width), dtype=hidden.dtype, device=device) \
        if want_hidden else None
    # d weight: the first chunk's product is written (no zero fill, no read of zeros: a
    # [V, H] pass each), the later chunks' are added.
    grad_weight = (torch.empty_like if n_rows else torch.zeros_like)(
        weight, memory_format=torch.contiguous_format) if want_weight else None
    if n_rows == 0:
        return (torch.zeros((), dtype=torch.float32, device=device),
                torch.zeros(len(METRIC_NAMES), dtype=torch.float32, device=device),
                grad_hidden, grad_weight)
    chunk = min(chunk_rows, n_rows)
    temp = kernel_temperature(temperature, device)
    per_row_temp = isinstance(temperature, torch.Tensor)
    coefs = kernel_coefficients(opts, device)
    kl_code = opts.kl_code if ref_logps is not None else KL.NONE.value
    splits = launch_plan(vocab, weight.element_size(), chunk, write_grad).spans.splits
    rows, (parts,) = row_scratch(n_rows, splits, device)  # parts: enough for a chunk
    logits_buffer = torch.empty((chunk, vocab), dtype=weight.dtype, device=device)
    kernels = kernels_for(device)
    no_grad_out = logits_buffer[:0]
    with np.errstate(all="ignore"):  # the interpreter's NumPy noise (CPU)
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            part = slice(start, end)
            h = hidden[part]
            logits = torch.mm(h, weight.t(), out=logits_buffer[:end - start])
            policy_loss_rows(
                kernels, logits, None, ids[part], mask[part],
                None if old is None else old[part],
                None if ref_logps is None else ref_logps[part],
                temp[part] if per_row_temp else temp, adv[part], 1,
                None if iw is None else iw[part], w[part], coefs, write_grad, kl_code,
                opts.neg_cap is not None, opts.log_ratio_bound or 0.0, opts.objective_code,
                opts.uses_entropy, [r[part] for r in rows], parts,
                logits if write_grad else no_grad_out,
            )
            if want_hidden:  # logits now hold g = d loss / d logits
                torch.mm(logits, weight, out=grad_hidden[part])
            if want_weight:
                kept = torch.where(mask[part, None], h, torch.zeros((), dtype=h.dtype,
                                                                    device=device))
                if start == 0:
                    torch.mm(logits.t(), kept, out=grad_weight)
                else:
                    grad_weight.addmm_(logits.t(), kept)
        loss, metrics = policy_metrics(kernels, mask, rows, old)
    return loss, metrics, grad_hidden, grad_weight


def policy_loss(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                mask: torch.Tensor, old: Optional[torch.Tensor],
                ref_logps: Optional[torch.Tensor], adv: torch.Tensor,
                iw: Optional[torch.Tensor], weights: torch.Tensor, temperature: Temperature,
                opts: PolicyLossOptions,
                chunk_rows: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of ``hidden [N, H]`` and ``weight [V, H]`` (same dtype and device),
    ``chunk_rows`` rows at a time; the other inputs as the backends' fused ``policy_loss``
    takes them, all ``[N]`` (``adv`` per token; ``old`` None: on-policy). Differentiable
    w.r.t. ``hidden`` and ``weight`` (whichever requires a gradient, in grad mode)."""
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    inputs = (ids, mask, old, ref_logps, adv, iw, weights, temperature, opts, chunk_rows)
    if any(wants):
        loss, metrics = _LinearLoss.apply(hidden, weight, (wants, inputs))
    else:
        loss, metrics, _, _ = _forward(hidden.detach(), weight.detach(), False, False,
                                       *inputs)
    return loss, dict(zip(METRIC_NAMES, metrics.unbind()))
