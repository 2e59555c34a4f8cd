"""The policy loss from the last hidden states and the lm_head, in row chunks.

With ``x = softcap((hidden @ weight.T + bias) * scale)`` (``ratiokl.spec.linear``; ``hidden
[N, H]``, ``weight [V, H]``, ``bias [V]``), ``g = d loss / d x`` (the fused kernel's
gradient, exactly 0 on inactive rows) and ``du = g * slope(x)`` (the transform's slope;
``du = g`` without options)::

    d loss / d hidden = du @ weight                          [N, H]
    d loss / d weight = du.T @ where(mask, hidden, 0)        [V, H]
    d loss / d bias   = sum over rows of du                  [V]

the rows go through in chunks of ``C`` rows, never ``[N, V]`` at once. Per chunk: one
GEMM into a reusable ``[C, V]`` buffer (the weight's dtype; the bias, scale and softcap
applied there: ``_lm_head.chunk_logits``), one launch of the fused policy-loss kernel on it
(:func:`ratiokl.torch._launch.policy_loss_rows`), which writes the chunk's row values into
the call's ``[N]`` arrays and ``g`` over the buffer (its in-place mode; with a softcap into a
second buffer, as the slope needs the capped logits), then, when gradients are wanted,
``du @ weight`` into the chunk's rows of ``d hidden``, ``du.T @ hidden`` added to ``d weight``
(in ``Head.accumulate``: float32, rounded once at the end, or with
``grad_weight_accum="weight"`` the weight's dtype, one rounding per chunk) and ``du``'s column sums to ``d bias`` (in float32). One metrics
launch over all ``N`` rows closes the forward, so the loss and metrics are those of
``policy_loss`` on the same logits. Inactive rows' hidden states are zeroed before the
GEMMs (``0 * NaN`` would be NaN): whatever they hold stays out of every gradient. The
GEMMs run in float32 for float32 inputs (``_lm_head.ieee_fp32``).

The gradients are computed in the forward (the loss is a scalar: the backward only scales
them by the upstream value, skipping the scale on the device where it is exactly 1), so
the call holds ``d hidden``, ``d weight`` and ``d bias`` from its forward to its backward.
Memory beyond them: the ``[C, V]`` buffer (two with a softcap) and O(N).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ratiokl._codes import KL
from ratiokl._kernels.heuristics import launch_plan
from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.spec import ROLLOUT_PARITY_NAMES, LogitTransform, PolicyLossOptions, chunk_rows_for
from ratiokl.torch._checks import Temperature
from ratiokl.torch._lm_head import chunk_grads, chunk_logits, head_operands, ieee_fp32, \
    softcap_slope_
from ratiokl.torch._launch import SCALE_ROWS, kernels_for, metrics_size, policy_loss_rows, \
    policy_metrics, row_scratch
from ratiokl.torch._once import spend
from ratiokl.torch._triton import kernel_coefficients, kernel_temperature

__all__ = ["policy_loss"]


class _LinearLoss(torch.autograd.Function):
    """``(loss, metrics)`` of ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` (or
    None); gradients for all three from the forward (``_forward``), scaled by the upstream
    value in the backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rest):
        wants, inputs = rest
        loss, metrics, *grads = _forward(hidden, weight, bias, *wants, *inputs)
        ctx.grads = grads
        ctx.mask = inputs[2]
        ctx.mark_non_differentiable(metrics)
        ctx.set_materialize_grads(False)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        spend(ctx, "linear_policy_loss")  # the gradients are scaled in place: once
        if g_loss is None:
            return None, None, None, None
        grads, ctx.grads = ctx.grads, None
        g = g_loss.to(torch.float32)
        with np.errstate(all="ignore"):  # the interpreter's NumPy noise (CPU)
            for grad, mask in zip(grads, (ctx.mask, None, None)):
                if grad is None:
                    continue
                rows = grad.view(1, -1) if grad.dim() == 1 else grad  # d bias: one row
                every_row = torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
                SCALE_ROWS.direct(rows.device, rows, g, every_row if mask is None else mask)
        return (*grads, None)


def _forward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
             want_hidden: bool, want_weight: bool, want_bias: bool,
             transform: LogitTransform, ids: torch.Tensor, mask: torch.Tensor,
             old: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], adv: torch.Tensor,
             iw: Optional[torch.Tensor], w: torch.Tensor, temperature: Temperature,
             opts: PolicyLossOptions, chunk_rows: int, rollout: Optional[torch.Tensor]):
    """The chunk loop (module docstring): ``(loss, metrics, d hidden | None, d weight | None,
    d bias | None)``."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    write_grad = want_hidden or want_weight or want_bias
    head = head_operands(hidden.dtype, weight, transform)
    grad_hidden = torch.empty((n_rows, width), dtype=hidden.dtype, device=device) \
        if want_hidden else None
    # d weight: the first chunk's product is written (no zero fill, no read of zeros: a
    # [V, H] pass each), the later chunks' are added.
    grad_weight = (torch.empty if n_rows else torch.zeros)(
        weight.shape, dtype=head.accumulate, device=device) if want_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if want_bias else None
    if n_rows == 0:
        return (torch.zeros((), dtype=torch.float32, device=device),
                torch.zeros(metrics_size(rollout), dtype=torch.float32, device=device),
                grad_hidden, _as(grad_weight, weight), _as(grad_bias, bias))
    # The kernel writes g over the logits unless it needs a buffer of its own.
    second = write_grad and head.separate_grad(transform)
    chunk = chunk_rows_for(chunk_rows, n_rows, vocab,
                           head.chunk_bytes(transform) if write_grad else head.logits.itemsize)
    temp = kernel_temperature(temperature, device)
    per_row_temp = isinstance(temperature, torch.Tensor)
    coefs = kernel_coefficients(opts, device)
    kl_code = opts.kl_code if ref_logps is not None else KL.NONE.value
    splits = launch_plan(vocab, head.logits.itemsize, chunk, write_grad).spans.splits
    rows, (parts,) = row_scratch(n_rows, splits, device)  # parts: enough for a chunk
    logits_buffer = torch.empty((chunk, vocab), dtype=head.logits, device=device)
    grad_buffer = torch.empty((chunk, vocab), dtype=head.grad, device=device) if second \
        else logits_buffer
    kernels = kernels_for(device)
    no_grad_out = logits_buffer[:0]
    zero = torch.zeros((), dtype=hidden.dtype, device=device)
    with np.errstate(all="ignore"), ieee_fp32(head.tf32):  # the interpreter's NumPy noise
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            part = slice(start, end)
            kept = torch.where(mask[part, None], hidden[part], zero)
            logits = chunk_logits(kept, head, bias, transform, logits_buffer[:end - start])
            g = grad_buffer[:end - start] if write_grad else no_grad_out
            policy_loss_rows(
                kernels, logits, None, ids[part], mask[part],
                None if old is None else old[part],
                None if ref_logps is None else ref_logps[part],
                temp[part] if per_row_temp else temp, adv[part], 1,
                None if iw is None else iw[part], w[part], coefs, write_grad, kl_code,
                opts.neg_cap is not None, opts.log_ratio_bound or 0.0, opts.objective_code,
                opts.uses_entropy, [r[part] for r in rows], parts, g,
            )
            if write_grad:  # g = d loss / d x
                softcap_slope_(g, logits, transform)
                chunk_grads(g, kept, head, transform,
                            grad_hidden[part] if want_hidden else None, grad_weight,
                            start == 0, grad_bias)
        loss, metrics = policy_metrics(kernels, mask, rows, old, rollout)
    return loss, metrics, grad_hidden, _as(grad_weight, weight), _as(grad_bias, bias)


def _as(grad: Optional[torch.Tensor], like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A gradient accumulated in float32 (or None) in its input's dtype."""
    return None if grad is None else grad.to(like.dtype)


def policy_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                transform: LogitTransform, ids: torch.Tensor, mask: torch.Tensor,
                old: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
                adv: torch.Tensor, iw: Optional[torch.Tensor], weights: torch.Tensor,
                temperature: Temperature, opts: PolicyLossOptions,
                chunk_rows: int, rollout: Optional[torch.Tensor] = None,
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` (or None;
    one dtype and device) through ``transform``, ``chunk_rows`` rows at a time; the other
    inputs as the backends' fused ``policy_loss`` takes them, all ``[N]`` (``adv`` per
    token; ``old`` None: on-policy; ``rollout``, the engine's log-probs, or None). Differentiable w.r.t. ``hidden``, ``weight`` and
    ``bias`` (whichever requires a gradient, in grad mode)."""
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
             grad_on and bias is not None and bias.requires_grad)
    inputs = (transform, ids, mask, old, ref_logps, adv, iw, weights, temperature, opts,
              chunk_rows, rollout)
    if any(wants):
        loss, metrics = _LinearLoss.apply(hidden, weight, bias, (wants, inputs))
    else:
        loss, metrics, *_ = _forward(hidden.detach(), weight.detach(),
                                     None if bias is None else bias.detach(), False, False,
                                     False, *inputs)
    return loss, dict(zip(METRIC_NAMES + ROLLOUT_PARITY_NAMES, metrics.unbind()))
