"""The row statistics' launches: the log-prob / ratio / KL / entropy forward and its backward.

``FORWARD`` (``row_forward``: one program a row, or few rows split over the vocabulary plus
a combine), ``ENTROPY_FORWARD`` (the same launches in their ``ENTROPY`` mode) and
``BACKWARD`` (``row_backward``: ``c * (onehot - softmax) / T``), bound as
:class:`~ratiokl.torch._launch.op.KernelOp` ops with their autograd contexts.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ratiokl._codes import KL
from ratiokl._kernels import (
    LaunchConfig,
    SplitPlan,
    backward_plan,
    forward_plan,
    logp_backward_kernel,
    logp_combine_kernel,
    logp_forward_kernel,
    lse_partials_kernel,
)
from ratiokl.torch._launch.op import KernelOp, row_outputs, row_stride

__all__ = [
    "BACKWARD", "ENTROPY_FORWARD", "FORWARD", "entropy_forward", "row_backward",
    "row_forward",
]

Tensor = torch.Tensor


def row_forward(
    kernels: Callable, policy: Tensor, ref: Optional[Tensor], ids: Tensor, mask: Tensor,
    old: Optional[Tensor], ref_logps: Optional[Tensor], temp: Tensor, kl_code: int, *,
    config: Optional[LaunchConfig] = None, plan: Optional[SplitPlan] = None,
    split: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]`` each of ``policy [N, V]``.

    Few rows run a program per (row, vocabulary split) and a combine, else one program
    per row (``ratiokl._kernels.forward_plan``); both give the same bits. ``config``,
    ``plan`` (the spans) and ``split`` override the plan's choices (tuning sweeps).
    """
    return _forward_launch(kernels, policy, ref, ids, mask, old, ref_logps, temp, kl_code,
                           False, config, plan, split)


def _forward_launch(kernels, policy, ref, ids, mask, old, ref_logps, temp, kl_code: int,
                    entropy: bool, config, spans, split) -> Tuple[Tensor, ...]:
    """The forward's launches (see :func:`row_forward`); ``entropy``: the kernels' ``ENTROPY``
    mode (no reference, ``kl_code`` 0), the entropy in the ``kl`` and ``dkl`` outputs."""
    n_rows, vocab = policy.shape
    outs = row_outputs(n_rows, policy.device, 5)
    if n_rows == 0:
        return outs
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    plan = forward_plan(n_rows, vocab, policy.element_size(), config, spans, split)
    config, spans = plan.config, plan.spans
    sizes = (vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
             row_stride(temp))
    rows = (ids, mask, temp if old is None else old, temp if ref_logps is None else ref_logps,
            temp)
    if not plan.split:
        kernels(logp_forward_kernel)[(n_rows,)](
            policy, ref_t, *rows, *outs, *sizes,
            HAS_REF=ref is not None, KL_CODE=kl_code, ENTROPY=entropy,
            TILES_PER_SPLIT=spans.tiles_per_split, BLOCK_V=config.block_v,
            num_warps=config.num_warps,
        )
        return outs
    parts = torch.empty((n_rows, spans.splits, 4), dtype=torch.float32, device=policy.device)
    kernels(lse_partials_kernel)[(n_rows, spans.splits)](
        policy, ref_t, mask, temp, parts, *sizes,
        HAS_REF=ref is not None, ENTROPY=entropy, SPLITS=spans.splits,
        TILES_PER_SPLIT=spans.tiles_per_split, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    kernels(logp_combine_kernel)[(n_rows,)](
        policy, ref_t, *rows, parts, *outs, *sizes,
        HAS_REF=ref is not None, KL_CODE=kl_code, ENTROPY=entropy, SPLITS=spans.splits,
        num_warps=1,
    )
    return outs


def row_backward(
    kernels: Callable, logits: Tensor, ids: Tensor, mask: Tensor, temp: Tensor, lse: Tensor,
    g_logp: Optional[Tensor], g_ratio: Optional[Tensor] = None, ratio: Optional[Tensor] = None,
    g_kl: Optional[Tensor] = None, dkl: Optional[Tensor] = None, entropy: bool = False, *,
    config: Optional[LaunchConfig] = None, out: Optional[Tensor] = None,
) -> Tensor:
    """``c * (onehot(a) - softmax(z)) / T``, ``[N, V]`` in the logits' dtype, row-major.

    The kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per row (a
    ``None`` upstream gradient is a zero term, never zero-filled), exactly 0 on
    inactive rows. ``entropy``: ``g_kl`` is the entropy's upstream gradient and ``dkl``
    the entropy ``H``; the term is ``-g_kl * p * (log p + H) / T`` instead. Grid
    ``(N, S)``, ``S`` spans per row (``ratiokl._kernels.backward_plan``; no bit depends
    on ``S``); ``config`` overrides the tile (tuning sweeps).
    ``out``: a row-major ``[N, V]`` buffer of the logits' dtype for the gradient, which may
    be the (row-major) logits themselves: each program reads a tile before it writes it.
    """
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device) \
        if out is None else out
    if n_rows == 0:
        return grad
    plan = backward_plan(n_rows, vocab, logits.element_size(), config)
    upstream = (g_logp, g_ratio, g_kl)
    # An absent term's arrays are placeholders (never read: its HAS_G_* is off), stride 0.
    pointers = (lse if g_logp is None else g_logp, lse if g_ratio is None else g_ratio,
                lse if g_ratio is None else ratio, lse if g_kl is None else g_kl,
                lse if g_kl is None else dkl)
    kernels(logp_backward_kernel)[plan.grid(n_rows)](
        logits, ids, mask, temp, lse, *pointers, grad,
        vocab, logits.stride(0), logits.stride(1), row_stride(temp),
        *(0 if g is None else g.stride(0) for g in upstream), plan.tiles_per_program,
        HAS_G_LOGP=g_logp is not None, HAS_G_RATIO=g_ratio is not None,
        HAS_G_KL=g_kl is not None, ENTROPY=entropy, BLOCK_V=plan.config.block_v,
        num_warps=plan.config.num_warps,
    )
    return grad


def _forward_context(ctx, inputs, output) -> None:
    policy, _, ids, mask, _, _, temp, _ = inputs
    _, ratio, _, dkl, lse = output
    ctx.save_for_backward(policy, ids, mask, temp, lse, ratio, dkl)
    ctx.mark_non_differentiable(dkl, lse)
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None (skipped)


def _forward_backward(ctx, g_logp, g_ratio, g_kl, _g_dkl, _g_lse):
    policy, ids, mask, temp, lse, ratio, dkl = ctx.saved_tensors
    grad = BACKWARD.run(ctx.binding, policy, ids, mask, temp, lse, g_logp, g_ratio, ratio,
                        g_kl, dkl)
    return grad, None, None, None, None, None, None, None


BACKWARD = KernelOp(row_backward, fake=lambda logits, *_: torch.empty_like(
    logits, memory_format=torch.contiguous_format))
FORWARD = KernelOp(
    row_forward,
    fake=lambda policy, *_: tuple(policy.new_empty(policy.shape[0], dtype=torch.float32)
                                  for _ in range(5)),
    setup_context=_forward_context, backward=_forward_backward,
)


def entropy_forward(kernels: Callable, policy: Tensor, ids: Tensor, mask: Tensor,
                    temp: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(logp, entropy, lse)`` float32 ``[N]`` of ``policy [N, V]``, from the same pass.

    The forward's launches in their ``ENTROPY`` mode (the same plans as :func:`row_forward`;
    the row summed lane by lane, so ``logp`` and ``lse`` may differ from its in the last
    bits); inactive rows 0.
    """
    logp, _, ent, _, lse = _forward_launch(kernels, policy, None, ids, mask, None, None, temp,
                                           KL.NONE.value, True, None, None, None)
    return logp, ent, lse


def _entropy_context(ctx, inputs, output) -> None:
    policy, ids, mask, temp = inputs
    _, ent, lse = output
    ctx.save_for_backward(policy, ids, mask, temp, lse, ent)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _entropy_backward(ctx, g_logp, g_ent, _g_lse):
    policy, ids, mask, temp, lse, ent = ctx.saved_tensors
    # No entropy cotangent (the entropy only logged, e.g. policy_loss's entropy_mean): the
    # kernel without its entropy term.
    grad = BACKWARD.run(ctx.binding, policy, ids, mask, temp, lse, g_logp, None, None,
                        g_ent, ent, g_ent is not None)
    return grad, None, None, None


ENTROPY_FORWARD = KernelOp(
    entropy_forward,
    fake=lambda policy, *_: tuple(policy.new_empty(policy.shape[0], dtype=torch.float32)
                                  for _ in range(3)),
    setup_context=_entropy_context, backward=_entropy_backward,
)
