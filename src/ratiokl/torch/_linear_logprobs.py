"""Per-token log-probs (and entropy) from the last hidden states and the lm_head, in row chunks.

With ``x = softcap((h @ W.T + b) * scale)`` (``ratiokl.spec.linear``) the rows go through
``C = chunk_rows`` at a time, never ``[N, V]`` at once:

* forward, per chunk: one GEMM of ``where(mask, h, 0)`` into a reusable ``[C, V]`` buffer
  in the weight's dtype (the transform in place: ``_lm_head.chunk_logits``), then the
  backend's row statistics of it (``logp``, the entropy, ``lse``) into ``[N]`` arrays;
* backward, per chunk: the same GEMM again (the same bits), the backend's row gradient
  ``dx`` of ``(g_logp, g_entropy)`` from the saved ``lse`` and entropy (the Triton kernel
  writes it over the logits; with a softcap into a second buffer, as the slope needs the
  capped logits), then ``du @ W`` into the chunk's rows of ``d hidden``, ``du.T @
  where(mask, h, 0)`` added to ``d W`` and ``du``'s column sums to ``d b``
  (``_lm_head.chunk_grads``).

Over a vocabulary-sharded head (``ratiokl.torch._vocab_linear``) a rank's ``d hidden`` is a
partial sum: given ``sum_hidden``, the loop writes it in float32 (``[N, H]``), ``sum_hidden``
sums it over the ranks in place and the total is rounded once to the hidden states' dtype,
as the unsharded op rounds its one float32 sum.

Memory beyond the inputs, outputs and gradients: one ``[C, V]`` buffer (two in the backward
with a softcap) and O(N). The backward costs four GEMMs per chunk in all (the forward's,
its recomputation, two for the gradients). A row's values come from its own GEMM row and
the row kernels, which read no other row: on the Triton backends they are those of
``selected_logprobs`` on the chunk's logits, bit for bit.

The row statistics and gradient come from a :class:`RowOps`: the Triton kernels
(:data:`TRITON_ROWS`: ``"triton"``, ``"interpret"``) or the native framework ops
(:data:`NATIVE_ROWS`).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

import torch

from ratiokl._codes import KL
from ratiokl.spec import LogitTransform, chunk_rows_for
from ratiokl.torch import _native
from ratiokl.torch._checks import Temperature
from ratiokl.torch._lm_head import Head, chunk_grads, chunk_logits, head_operands, ieee_fp32, \
    softcap_slope_

__all__ = ["NATIVE_ROWS", "RowOps", "TRITON_ROWS", "selected_logprobs"]

Tensor = torch.Tensor


class RowOps(NamedTuple):
    """A backend's row statistics and row gradient of a chunk's logits ``x [C, V]``."""

    #: ``(x, ids, mask, temperature, entropy) -> (logp, entropy | None, lse)``, float32 [C]
    forward: Callable
    #: ``(x, ids, mask, temperature, lse, entropy | None, g_logp | None, g_entropy | None,
    #: out) -> dx`` in x's dtype (``out``: a ``[C, V]`` buffer the backend may write, or x)
    backward: Callable


def _triton_forward(x, ids, mask, temperature, entropy):
    # Import triton: only when a kernel backend runs.
    from ratiokl.torch._launch import ENTROPY_FORWARD, FORWARD
    from ratiokl.torch._triton import kernel_temperature

    temp = kernel_temperature(temperature, x.device)
    if entropy:
        return ENTROPY_FORWARD.direct(x.device, x, ids, mask, temp)
    logp, _, _, _, lse = FORWARD.direct(x.device, x, None, ids, mask, None, None, temp,
                                        KL.NONE.value)
    return logp, None, lse


def _triton_backward(x, ids, mask, temperature, lse, ent, g_logp, g_ent, out):
    from ratiokl.torch._launch import BACKWARD  # imports triton: only when a kernel backend runs
    from ratiokl.torch._triton import kernel_temperature

    temp = kernel_temperature(temperature, x.device)
    return BACKWARD.direct(x.device, x, ids, mask, temp, lse, g_logp, None, None, g_ent,
                           None if g_ent is None else ent, g_ent is not None, out=out)


TRITON_ROWS = RowOps(_triton_forward, _triton_backward)
NATIVE_ROWS = RowOps(_native.rows_forward, _native.rows_backward)


def _parts(n_rows: int, chunk: int) -> List[slice]:
    return [slice(start, min(start + chunk, n_rows)) for start in range(0, n_rows, chunk)]


def _at(values: Optional[Tensor], part: slice) -> Optional[Tensor]:
    """A per-row tensor's chunk (None, or a Python temperature, passes through)."""
    return values[part] if isinstance(values, torch.Tensor) else values


def _kept(hidden: Tensor, mask: Tensor) -> Tensor:
    """``where(mask, hidden, 0)``: an inactive row's state (NaN, inf) enters no GEMM."""
    return torch.where(mask[:, None], hidden, torch.zeros((), dtype=hidden.dtype,
                                                          device=hidden.device))


class _Inputs(NamedTuple):
    """Everything but the differentiable tensors, flattened to ``N`` rows."""

    ids: Tensor  # [N] integer
    mask: Tensor  # [N] bool
    temperature: Temperature  # Python float or float32 [N]
    transform: LogitTransform
    chunk: int
    ops: RowOps
    entropy: bool
    #: sums a float32 partial ``d hidden [N, H]`` over the ranks in place (a vocabulary-
    #: sharded head), or None: this ``d hidden`` is the whole gradient
    sum_hidden: Optional[Callable[[Tensor], object]] = None


def _chunk(inputs: _Inputs, head: Head, n_rows: int, vocab: int) -> int:
    """Rows per chunk: ``chunk_rows``, or sized so that the logits and their gradient's own
    buffer (``Head.separate_grad``) fit ``ratiokl.spec.CHUNK_BYTES``."""
    return chunk_rows_for(inputs.chunk, n_rows, vocab, head.chunk_bytes(inputs.transform))


def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
             inputs: _Inputs) -> Tuple[Tensor, Optional[Tensor], Tensor]:
    """``(logp, entropy | None, lse)`` float32 ``[N]`` from the chunk loop."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    out = [torch.zeros(n_rows, dtype=torch.float32, device=hidden.device)
           for _ in range(3)]
    logp, ent, lse = out
    head = head_operands(hidden.dtype, weight, inputs.transform)
    chunk = _chunk(inputs, head, n_rows, vocab)
    buffer = torch.empty((chunk, vocab), dtype=head.logits, device=weight.device)
    with ieee_fp32(head.tf32):
        for part in _parts(n_rows, chunk):
            mask = inputs.mask[part]
            x = chunk_logits(_kept(hidden[part], mask), head, bias, inputs.transform,
                             buffer[:part.stop - part.start])
            rows = inputs.ops.forward(x, inputs.ids[part], mask,
                                      _at(inputs.temperature, part), inputs.entropy)
            for target, value in zip(out, rows):
                if value is not None:
                    target[part] = value
    return logp, ent if inputs.entropy else None, lse


def _backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], lse: Tensor,
              ent: Optional[Tensor], g_logp: Optional[Tensor], g_ent: Optional[Tensor],
              inputs: _Inputs, wants: Tuple[bool, bool, bool]):
    """``(d hidden, d weight, d bias)`` (None where not wanted) from the chunk loop."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    head = head_operands(hidden.dtype, weight, inputs.transform)
    partial = inputs.sum_hidden is not None  # d hidden in float32 until summed
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32 if partial else hidden.dtype,
                              device=hidden.device) if wants[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=head.accumulate, device=weight.device) \
        if wants[1] else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=weight.device) \
        if wants[2] else None
    if g_logp is not None or g_ent is not None:
        chunk = _chunk(inputs, head, n_rows, vocab)
        buffer = torch.empty((chunk, vocab), dtype=head.logits, device=weight.device)
        second = torch.empty((chunk, vocab), dtype=head.grad, device=weight.device) \
            if head.separate_grad(inputs.transform) else buffer
        with ieee_fp32(head.tf32):
            for i, part in enumerate(_parts(n_rows, chunk)):
                mask, rows = inputs.mask[part], part.stop - part.start
                kept = _kept(hidden[part], mask)
                x = chunk_logits(kept, head, bias, inputs.transform, buffer[:rows])
                dx = inputs.ops.backward(x, inputs.ids[part], mask,
                                         _at(inputs.temperature, part), lse[part],
                                         _at(ent, part), _at(g_logp, part), _at(g_ent, part),
                                         second[:rows])
                softcap_slope_(dx, x, inputs.transform)
                chunk_grads(dx, kept, head, inputs.transform, _at(grad_hidden, part),
                            grad_weight, i == 0, grad_bias)
    if grad_hidden is not None and partial:  # the float32 partials summed, rounded once
        inputs.sum_hidden(grad_hidden)
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _upstream(g: Optional[Tensor]) -> Optional[Tensor]:
    return None if g is None else g.to(torch.float32).contiguous()


class _LinearLogprobs(torch.autograd.Function):
    """``logp`` (or ``(logp, entropy)``) of ``hidden [N, H]``, ``weight [V, H]``, ``bias [V]``;
    the backward recomputes each chunk's logits (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, inputs):
        logp, ent, lse = _forward(hidden, weight, bias, inputs)
        ctx.inputs = inputs
        ctx.save_for_backward(hidden, weight, bias, lse, ent)
        ctx.set_materialize_grads(False)
        return (logp, ent) if inputs.entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, lse, ent = ctx.saved_tensors
        wants = ctx.needs_input_grad[:3]
        grads = _backward(hidden, weight, bias, lse, ent, _upstream(g_logp), _upstream(g_ent),
                          ctx.inputs, wants)
        return (*grads, None)


def selected_logprobs(ops: RowOps, hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                      ids: Tensor, mask: Tensor, temperature: Temperature,
                      transform: LogitTransform, chunk_rows: int, entropy: bool,
                      sum_hidden: Optional[Callable[[Tensor], object]] = None):
    """``logp`` float32 ``[N]``, or ``(logp, entropy)``, of ``hidden [N, H]`` through the
    head ``weight [V, H]`` / ``bias [V]`` (one dtype, one device), ``chunk_rows`` rows at a
    time; ``ids``, ``mask`` and a per-row ``temperature`` are ``[N]``. Differentiable
    w.r.t. ``hidden``, ``weight`` and ``bias`` (whichever requires a gradient).
    ``sum_hidden``: sums the float32 partial ``d hidden`` over a vocabulary-sharded head's
    ranks, in place, inside the backward (module docstring)."""
    inputs = _Inputs(ids, mask, temperature, transform, chunk_rows, ops, entropy, sum_hidden)
    tensors = (hidden, weight) + (() if bias is None else (bias,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _LinearLogprobs.apply(hidden, weight, bias, inputs)
    logp, ent, _ = _forward(hidden.detach(), weight.detach(),
                            None if bias is None else bias.detach(), inputs)
    return (logp, ent) if entropy else logp
