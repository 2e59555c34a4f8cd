"""The linear ops' own GEMMs: a row chunk's logits from hidden states, and their gradients.

The transform is ``ratiokl.spec.linear``'s (``x = softcap((h @ W.T + b) * scale)``, its
slope ``scale * (1 - (x / softcap)^2)``), applied in place on the chunk's buffer so that no
second ``[C, V]`` array is made: the bias and the scale ride in the GEMM's epilogue
(``addmm``'s ``beta`` / ``alpha``; one rounding to the weight's dtype), the softcap is three
in-place passes. The backward folds the scale into its GEMMs' ``alpha`` and the softcap's
``1 - (x / softcap)^2`` into the upstream gradient (four in-place passes over the capped
logits, one more over the gradient).

Every GEMM here runs under :func:`ieee_fp32`: float32 inputs get float32 GEMMs whatever the
caller set (``torch.backends.cuda.matmul.allow_tf32``, ``fp32_precision``,
``torch.set_float32_matmul_precision``), so PyTorch and JAX (``Precision.HIGHEST``) agree.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator, Optional

import torch

from ratiokl.spec import LogitTransform, transform_slope

__all__ = ["chunk_grads", "chunk_logits", "head_logits", "ieee_fp32", "softcap_slope_"]

#: torch >= 2.9 also keeps a precision per backend (``fp32_precision``), which its legacy
#: getters check against the global one ("mix of the legacy and new APIs").
_PER_BACKEND = hasattr(torch.backends.cuda.matmul, "fp32_precision")


def _global_precision() -> str:
    """``torch.get_float32_matmul_precision()``, or its default where only the per-backend
    flags were set (torch >= 2.9 then refuses to read the global one)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return "highest"


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """float32 matmuls in float32 (no TF32 on CUDA, no bf16 on oneDNN) inside, the caller's
    settings restored after. ``torch.set_float32_matmul_precision("highest")`` sets the
    global flag and (torch >= 2.9) the CUDA and oneDNN matmul flags to ``"ieee"``, one
    consistent state for every check; the per-backend flags are restored exactly. Host
    flags only: nothing reaches the device."""
    flags = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if _PER_BACKEND else ()
    saved = _global_precision()
    saved_flags = [f.fp32_precision for f in flags]
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
        for f, value in zip(flags, saved_flags):
            f.fp32_precision = value


def chunk_logits(kept: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 transform: LogitTransform, out: torch.Tensor) -> torch.Tensor:
    """``x = softcap((kept @ weight.T + bias) * scale)`` written into ``out [C, V]`` (the
    weight's dtype, contiguous) and returned; call under :func:`ieee_fp32`."""
    scale = transform.scale
    if bias is not None:
        torch.addmm(bias, kept, weight.t(), beta=scale, alpha=scale, out=out)
    elif scale != 1.0:
        out.addmm_(kept, weight.t(), beta=0.0, alpha=scale)  # beta 0: out's bytes unread
    else:
        torch.mm(kept, weight.t(), out=out)
    if transform.softcap is not None:
        out.div_(transform.softcap).tanh_().mul_(transform.softcap)
    return out


def softcap_slope_(dx: torch.Tensor, x: torch.Tensor, transform: LogitTransform) -> None:
    """``dx *= 1 - (x / softcap)^2`` in place (the slope without its scale), overwriting
    ``x``; nothing without a softcap."""
    if transform.softcap is not None:
        dx.mul_(x.div_(transform.softcap).square_().neg_().add_(1.0))


def chunk_grads(du: torch.Tensor, kept: torch.Tensor, weight: torch.Tensor,
                transform: LogitTransform, grad_hidden: Optional[torch.Tensor],
                grad_weight: Optional[torch.Tensor], first: bool,
                grad_bias: Optional[torch.Tensor]) -> None:
    """One chunk's share of the gradients from ``du = d loss / d u / scale`` ``[C, V]``
    (:func:`softcap_slope_` applied; the scale enters here, as the GEMMs' ``alpha``).

    Writes ``scale * du @ weight`` into ``grad_hidden [C, H]``, writes (``first``) or adds
    ``scale * du.T @ kept`` into ``grad_weight [V, H]`` and adds ``scale`` times ``du``'s
    column sums into the float32 ``grad_bias [V]`` (each None: not wanted). Call under
    :func:`ieee_fp32`.
    """
    scale = transform.scale
    if grad_hidden is not None:
        grad_hidden.addmm_(du, weight, beta=0.0, alpha=scale)
    if grad_weight is not None:
        grad_weight.addmm_(du.t(), kept, beta=0.0 if first else 1.0, alpha=scale)
    if grad_bias is not None:
        grad_bias.add_(du.sum(dim=0, dtype=torch.float32), alpha=scale)


class _HeadLogits(torch.autograd.Function):
    """Every row's ``x`` at once, with the backward's GEMMs under :func:`ieee_fp32` too."""

    @staticmethod
    def forward(ctx, kept, weight, bias, transform):
        out = torch.empty((kept.shape[0], weight.shape[0]), dtype=weight.dtype,
                          device=weight.device)
        with ieee_fp32():
            x = chunk_logits(kept, weight, bias, transform, out)
        ctx.transform = transform
        ctx.has_bias = bias is not None
        ctx.save_for_backward(kept, weight, x if transform.softcap is not None else None)
        return x

    @staticmethod
    def backward(ctx, g):
        kept, weight, x = ctx.saved_tensors
        wants = ctx.needs_input_grad
        grad_hidden = torch.empty_like(kept) if wants[0] else None
        grad_weight = torch.empty_like(weight) if wants[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=g.device) \
            if ctx.has_bias and wants[2] else None
        du = g if x is None else g * transform_slope(x, replace(ctx.transform, scale=1.0))
        with ieee_fp32():
            chunk_grads(du, kept, weight, ctx.transform, grad_hidden, grad_weight, True,
                        grad_bias)
        if grad_bias is not None:
            grad_bias = grad_bias.to(weight.dtype)
        return grad_hidden, grad_weight, grad_bias, None


def head_logits(kept: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                transform: LogitTransform) -> torch.Tensor:
    """Every row's ``x [N, V]`` (the weight's dtype), differentiable w.r.t. ``kept``,
    ``weight`` and ``bias``: the native routes' materialised logits."""
    return _HeadLogits.apply(kept, weight, bias, transform)
