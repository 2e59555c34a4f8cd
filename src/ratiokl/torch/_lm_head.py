"""The linear ops' own GEMMs: a row chunk's logits from hidden states, and their gradients.

The precision is the spec's (``ratiokl.spec.linear``: ``logits_dtype``, ``fp32_matmul``,
:func:`~ratiokl.spec.linear.head_dtypes`), resolved once per call into a :class:`Head`:

* ``logits_dtype="input"`` with one half-precision dtype: the GEMMs in that dtype, the
  logits rounded to it (a bf16 head), the gradient in it;
* otherwise on CUDA: float32 logits from the GEMM's float32 accumulator (``out_dtype``):
  one GEMM for half-precision inputs, the split products of ``piece_pairs`` for a float32
  operand (``"bf16x3"``; ``"ieee"`` / ``"tf32"``: float32 GEMMs); the gradient GEMMs take
  ``d loss / d x`` in the half-precision dtype (bfloat16 for split operands) with the
  weight's (and hidden states') first piece, as every fused head does, and accumulate in
  float32;
* on a CPU: every GEMM in float32 on the operands' values (the weight upcast once per
  call).

``d weight`` sums over the chunks in :func:`~ratiokl.spec.linear.grad_weight_accumulator`'s
dtype (``Head.accumulate``) on every device: float32, rounded once at the end
(``grad_weight_accum="float32"``), or the weight's, each chunk's GEMM adding its share with
one rounding (``"weight"``: cuBLAS's ``addmm`` epilogue; bf16 ``addmm_`` on a CPU rounds once
too).

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
from typing import Iterator, NamedTuple, Optional, Sequence, Tuple

import torch

from ratiokl.spec import (GRAD_PIECES, LogitTransform, grad_weight_accumulator, head_dtypes,
                          piece_pairs, split_bf16, split_pieces, transform_slope)

__all__ = ["Head", "chunk_grads", "chunk_logits", "head_logits", "head_operands", "ieee_fp32",
           "softcap_slope_"]

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
def ieee_fp32(tf32: bool = False) -> Iterator[None]:
    """float32 matmuls in float32 (no TF32 on CUDA, no bf16 on oneDNN) inside, the caller's
    settings restored after. ``torch.set_float32_matmul_precision("highest")`` sets the
    global flag and (torch >= 2.9) the CUDA and oneDNN matmul flags to ``"ieee"``, one
    consistent state for every check; the per-backend flags are restored exactly. Host
    flags only: nothing reaches the device."""
    flags = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if _PER_BACKEND else ()
    saved = _global_precision()
    saved_flags = [f.fp32_precision for f in flags]
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)
        for f, value in zip(flags, saved_flags):
            f.fp32_precision = value


class Head(NamedTuple):
    """One call's lm_head as its GEMMs take it (:func:`head_operands`)."""

    pieces: Tuple[torch.Tensor, ...]  # the weight's operands [V, H] (one: no split)
    pairs: Optional[Tuple[Tuple[int, int], ...]]  # the logits' (hidden piece, weight piece)
    # products; None: one GEMM in the logits' dtype with the epilogue (bias, scale) in it
    hidden_pieces: int  # bfloat16 pieces of each chunk's hidden rows; 0: cast to `operand`
    operand: torch.dtype  # the hidden rows' dtype in the GEMMs when not split
    logits: torch.dtype  # a chunk's logits x [C, V]
    grad: torch.dtype  # d loss / d x as the kernels write it
    split_grads: bool  # the gradient GEMMs on GRAD_PIECES bfloat16 pieces a side
    accumulate: torch.dtype  # d weight's accumulator across chunks
    tf32: bool  # float32 GEMMs in TF32 (fp32_matmul="tf32")

    def separate_grad(self, transform: LogitTransform) -> bool:
        """Whether the kernels write ``d loss / d x`` into a ``[C, V]`` buffer of its own
        (its dtype is not the logits', or a softcap's slope reads the logits after);
        else over the logits."""
        return self.grad != self.logits or transform.softcap is not None

    def chunk_bytes(self, transform: LogitTransform) -> int:
        """Bytes per logit of a chunk's buffers: the logits, and the gradient's own."""
        separate = self.grad.itemsize if self.separate_grad(transform) else 0
        return self.logits.itemsize + separate

    def hidden_ops(self, kept: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """A chunk's hidden rows as the logits' GEMMs take them (split or cast)."""
        if self.hidden_pieces:
            return _split(kept, self.hidden_pieces)
        return (kept.to(self.operand),)


def _split(x: torch.Tensor, pieces: int) -> Tuple[torch.Tensor, ...]:
    """``x`` as bfloat16 pieces (``ratiokl.spec.split_bf16``; a bfloat16 ``x`` itself)."""
    if x.dtype == torch.bfloat16:
        return (x,)
    return split_bf16(x, pieces, lambda t: t.to(torch.bfloat16),
                      lambda t: t.to(torch.float32))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def head_operands(hidden_dtype: torch.dtype, weight: torch.Tensor,
                  transform: LogitTransform, gpu: Optional[bool] = None) -> Head:
    """The :class:`Head` of ``weight [V, H]`` for hidden states of ``hidden_dtype`` (module
    docstring): the weight split (``"bf16x3"`` on CUDA) or upcast (CPU) once here. ``gpu``:
    the GPU's rules (default: whether ``weight`` is on CUDA; a test may ask for them on the
    CPU, where the split products run as float32 products of the pieces)."""
    gpu = weight.is_cuda if gpu is None else gpu
    logits_name, grad_name = head_dtypes(_name(hidden_dtype), _name(weight.dtype), transform,
                                         gpu)
    logits, grad = getattr(torch, logits_name), getattr(torch, grad_name)
    accumulate = getattr(torch, grad_weight_accumulator(_name(weight.dtype), transform))
    tf32 = transform.fp32_matmul == "tf32"
    split = gpu and grad == torch.float32 and transform.fp32_matmul == "bf16x3"
    if not gpu or (logits == hidden_dtype == weight.dtype and not split):  # one dtype
        return Head((weight.to(logits),), None, 0, logits, logits, logits, False, accumulate,
                    tf32)
    if split:  # a float32 operand: the bfloat16 pieces' products
        n_h, n_w = split_pieces(_name(hidden_dtype)), split_pieces(_name(weight.dtype))
        return Head(_split(weight, n_w), piece_pairs(n_h, n_w), n_h, hidden_dtype, logits,
                    grad, True, accumulate, False)
    if grad == torch.float32:  # float32 operands, "ieee" / "tf32": float32 GEMMs
        return Head((weight.to(grad),), None, 0, grad, logits, grad, False, accumulate, tf32)
    # half-precision inputs of one dtype, float32 logits from the accumulator
    return Head((weight,), ((0, 0),), 0, weight.dtype, logits, grad, False, accumulate, False)


def _gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float,
          beta: float) -> None:
    """``out = alpha * a @ b + beta * out`` (beta 0: ``out`` unread; ``a`` and ``b`` of one
    dtype) with ``out`` in its own dtype, rounded once: the float32 accumulator written as
    it is when the operands are narrower (CUDA's ``out_dtype``; elsewhere the operands
    upcast); a narrower ``out`` (``d weight`` in a half-precision weight's dtype,
    ``grad_weight_accum="weight"``, beside float32 operands) takes the float32 sum rounded
    once, as a GEMM's epilogue writes it."""
    if out.dtype == a.dtype == b.dtype:
        out.addmm_(a, b, beta=beta, alpha=alpha)
    elif out.dtype != torch.float32:  # a [V, H] float32 temporary; one rounding
        out.copy_(torch.addmm(out.float(), a.float(), b.float(), beta=beta, alpha=alpha))
    elif out.is_cuda:
        torch.addmm(out, a, b, beta=beta, alpha=alpha, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta, alpha=alpha)


def _products(out: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
              pairs: Sequence[Tuple[int, int]], alpha: float, beta: float) -> None:
    """``out = alpha * sum over pairs (i, j) of a[i] @ b[j] + beta * out``: the split GEMMs,
    summed in ``out``'s dtype (float32 for a sum of several)."""
    for n, (i, j) in enumerate(pairs):
        _gemm(out, a[i], b[j], alpha, beta if n == 0 else 1.0)


def chunk_logits(kept: torch.Tensor, head: Head, bias: Optional[torch.Tensor],
                 transform: LogitTransform, out: torch.Tensor) -> torch.Tensor:
    """``x = softcap((kept @ weight.T + bias) * scale)`` written into ``out [C, V]``
    (``head.logits``, contiguous) and returned; call under :func:`ieee_fp32` (with
    ``head.tf32``)."""
    scale = transform.scale
    if head.pairs is None:  # one GEMM in the logits' dtype, the bias and scale in it
        weight, hidden = head.pieces[0], kept.to(head.operand)
        if bias is not None:
            torch.addmm(bias.to(out.dtype), hidden, weight.t(), beta=scale, alpha=scale,
                        out=out)
        else:  # beta 0: out's bytes unread
            out.addmm_(hidden, weight.t(), beta=0.0, alpha=scale)
    else:  # the products summed in float32, then the bias and scale
        _products(out, head.hidden_ops(kept), [w.t() for w in head.pieces], head.pairs, 1.0,
                  0.0)
        if bias is not None:
            out.add_(bias)
        if scale != 1.0:
            out.mul_(scale)
    if transform.softcap is not None:
        out.div_(transform.softcap).tanh_().mul_(transform.softcap)
    return out


def softcap_slope_(dx: torch.Tensor, x: torch.Tensor, transform: LogitTransform) -> None:
    """``dx *= 1 - (x / softcap)^2`` in place (the slope without its scale), overwriting
    ``x``; nothing without a softcap."""
    if transform.softcap is not None:
        dx.mul_(x.div_(transform.softcap).square_().neg_().add_(1.0))


def chunk_grads(du: torch.Tensor, kept: torch.Tensor, head: Head, transform: LogitTransform,
                grad_hidden: Optional[torch.Tensor], grad_weight: Optional[torch.Tensor],
                first: bool, grad_bias: Optional[torch.Tensor]) -> None:
    """One chunk's share of the gradients from ``du = d loss / d u / scale`` ``[C, V]``
    (:func:`softcap_slope_` applied; the scale enters here, as the GEMMs' ``alpha``).

    Writes ``scale * du @ weight`` into ``grad_hidden [C, H]`` (the hidden states' dtype),
    writes (``first``) or adds ``scale * du.T @ kept`` into ``grad_weight [V, H]``
    (``head.accumulate``) and adds ``scale`` times ``du``'s column sums into the float32
    ``grad_bias [V]`` (each None: not wanted). With ``head.split_grads`` ``du`` and the
    float32 operands enter as ``GRAD_PIECES`` bfloat16 pieces each. Call under
    :func:`ieee_fp32`.
    """
    scale = transform.scale
    if head.split_grads:
        du_ops = _split(du.to(torch.float32), GRAD_PIECES)
        w_ops = head.pieces[:GRAD_PIECES]
        h_ops = _split(kept, GRAD_PIECES)
    else:
        du_ops, w_ops, h_ops = (du.to(head.grad),), head.pieces, (kept.to(head.grad),)
    if grad_hidden is not None:
        pairs = piece_pairs(len(du_ops), len(w_ops), depth=1)
        if grad_hidden.dtype == torch.float32 or (
                len(pairs) == 1 and grad_hidden.dtype == du_ops[0].dtype == w_ops[0].dtype):
            _products(grad_hidden, du_ops, w_ops, pairs, scale, 0.0)
        else:  # a sum in float32, rounded once to the hidden states' dtype: [C, H]
            total = torch.empty(grad_hidden.shape, dtype=torch.float32,
                                device=grad_hidden.device)
            _products(total, du_ops, w_ops, pairs, scale, 0.0)
            grad_hidden.copy_(total)
    if grad_weight is not None:
        _products(grad_weight, [d.t() for d in du_ops], h_ops,
                  piece_pairs(len(du_ops), len(h_ops), depth=1), scale, 0.0 if first else 1.0)
    if grad_bias is not None:
        grad_bias.add_(du.sum(dim=0, dtype=torch.float32), alpha=scale)


class _HeadLogits(torch.autograd.Function):
    """Every row's ``x`` at once, with the backward's GEMMs under :func:`ieee_fp32` too."""

    @staticmethod
    def forward(ctx, kept, weight, bias, transform):
        head = head_operands(kept.dtype, weight, transform)
        out = torch.empty((kept.shape[0], weight.shape[0]), dtype=head.logits,
                          device=weight.device)
        with ieee_fp32(head.tf32):
            x = chunk_logits(kept, head, bias, transform, out)
        ctx.transform = transform
        ctx.has_bias = bias is not None
        ctx.save_for_backward(kept, weight, x if transform.softcap is not None else None)
        return x

    @staticmethod
    def backward(ctx, g):
        kept, weight, x = ctx.saved_tensors
        head = head_operands(kept.dtype, weight, ctx.transform)
        wants = ctx.needs_input_grad
        grad_hidden = torch.empty_like(kept) if wants[0] else None
        grad_weight = torch.empty(weight.shape, dtype=head.accumulate, device=weight.device) \
            if wants[1] else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=g.device) \
            if ctx.has_bias and wants[2] else None
        du = g if x is None else g * transform_slope(x, replace(ctx.transform, scale=1.0))
        with ieee_fp32(head.tf32):
            chunk_grads(du, kept, head, ctx.transform, grad_hidden, grad_weight, True,
                        grad_bias)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(weight.dtype), None)


def head_logits(kept: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                transform: LogitTransform) -> torch.Tensor:
    """Every row's ``x [N, V]`` (float32; ``logits_dtype="input"``: the inputs' dtype),
    differentiable w.r.t. ``kept``, ``weight`` and ``bias``: the native routes'
    materialised logits."""
    return _HeadLogits.apply(kept, weight, bias, transform)
