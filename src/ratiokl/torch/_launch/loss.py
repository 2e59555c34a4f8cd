"""The fused policy loss's launches: loss + metrics + stored gradient, then the row scaling.

``POLICY_LOSS`` (``fused_policy_loss``: ``policy_loss_kernel`` then
``policy_metrics_kernel``) stores ``d sum_t w_t loss_t / d policy`` in its forward;
its backward scales that gradient in place by the upstream value (``SCALE_ROWS``). The
pieces (:func:`row_scratch`, :func:`policy_loss_rows`, :func:`policy_metrics`) are also
launched one by one by the linear (hidden-state) loss, chunk by chunk.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence, Tuple

import torch

from ratiokl._kernels.fused_loss import policy_loss_kernel, scale_rows_kernel
from ratiokl._kernels.heuristics import SCALE_WARPS, launch_plan, scale_block
from ratiokl._kernels.meeting import PARTIAL_FIELDS
from ratiokl._kernels.loss_rows import (METRIC_NAMES, PARITY_METRICS, ROWS_BLOCK, ROWS_WARPS,
                                        parity_constexprs, policy_metrics_kernel)
from ratiokl.spec import ROLLOUT_PARITY_TOLERANCES
from ratiokl.torch._launch.op import KernelOp, row_stride
from ratiokl.torch._once import spend

__all__ = [
    "POLICY_LOSS", "SCALE_ROWS", "fused_policy_loss", "metrics_size", "policy_loss_rows",
    "policy_metrics", "row_scratch", "scale_rows_",
]

Tensor = torch.Tensor


def fused_policy_loss(
    kernels: Callable, policy: Tensor, ref: Optional[Tensor], ids: Tensor, mask: Tensor,
    old: Optional[Tensor], ref_logps: Optional[Tensor], temp: Tensor, adv: Tensor, adv_rows: int,
    iw: Optional[Tensor], w: Tensor, coefs: Tensor, write_grad: bool, kl_code: int,
    has_neg_cap: bool, bound: float, objective: int, entropy_grad: bool, per_token: bool,
    rollout: Optional[Tensor], *, grad_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, metrics, grad)``: float32 ``[]`` (with ``per_token``: the rows' weighted
    losses ``w_t * loss_t``, float32 ``[N]``, 0 on inactive rows), float32 ``[8]``
    (``METRIC_NAMES``; ``rollout``, the engine's log-probs ``[N]``, adds the parity
    fractions: :func:`metrics_size`), and ``d sum_t w_t loss_t / d policy`` ``[N, V]`` in the logits'
    dtype (``[0, V]`` without ``write_grad``), which the backward scales row by row by the
    upstream value (``[]``, or ``[N]`` with ``per_token``).

    ``adv``: float32 ``[N // adv_rows]``, one advantage per ``adv_rows`` rows (1: per
    token; ``T``: per sequence of ``T`` rows, as given, never expanded to ``[N]``).
    ``old`` None: on-policy (``old = sg(logp)``: the kernel's ``ON_POLICY``).
    Two launches: ``policy_loss_kernel`` (per-row values and, with
    ``write_grad``, the gradient of ``sum_t w_t loss_t``: :func:`policy_loss_rows`) and
    ``policy_metrics_kernel`` (the loss and the metrics: :func:`policy_metrics`). ``coefs``:
    float32 ``[5]`` (``kl_coef``, ratio floor, ratio ceiling, negative-advantage cap,
    ``entropy_coef``); ``kl_code`` ``KL.NONE``: no reference; ``objective``: ``OBJECTIVES`` code;
    ``entropy_grad``: the entropy bonus is in the loss and its gradient (``entropy_coef``
    is not the number 0). ``grad_out``: a row-major ``[N, V]`` buffer for the gradient
    (the in-place mode passes ``policy`` itself: every tile is read before it is
    overwritten, by the same program).
    """
    n_rows, vocab = policy.shape
    device = policy.device
    if grad_out is None:
        grad_out = torch.empty((n_rows if write_grad else 0, vocab), dtype=policy.dtype,
                               device=device)
    if n_rows == 0:
        return (torch.zeros((0,) if per_token else (), dtype=torch.float32, device=device),
                torch.zeros(metrics_size(rollout), dtype=torch.float32, device=device),
                grad_out)
    plan = launch_plan(vocab, policy.element_size(), n_rows, write_grad)
    # One scratch allocation (host time: one allocator call, not eight): the six row
    # values, then the spans' partials.
    rows, parts = row_scratch(n_rows, plan.spans.splits, device)
    policy_loss_rows(kernels, policy, ref, ids, mask, old, ref_logps, temp, adv, adv_rows, iw,
                     w, coefs, write_grad, kl_code, has_neg_cap, bound, objective,
                     entropy_grad, rows, parts[0], grad_out)
    loss, metrics = policy_metrics(kernels, mask, rows, old, rollout)
    if per_token:  # a fresh [N] array: an op's output may not be a view of its scratch
        loss = rows[0][:n_rows].clone()
    return loss, metrics, grad_out


def row_scratch(n_rows: int, splits: int, device: torch.device,
                part_sets: int = 1) -> Tuple[Tuple[Tensor, ...], Tuple[Tensor, ...]]:
    """``(rows, parts)`` from one allocation: :func:`policy_loss_rows`'s six row values
    (``[width >= N]`` float32 each, the clip bits int32) and ``part_sets`` scratches for the
    spans' partials (``N * splits * PARTIAL_FIELDS`` float32 each). Each piece starts 64-byte
    aligned, as its own allocation would (the kernel's specialisation, hence its compile,
    does not depend on N mod 16); the kernels index the rows below N only.
    """
    width = -(-n_rows // 16) * 16
    part = width * splits * PARTIAL_FIELDS.value
    scratch = torch.empty(width * 6 + part * part_sets, dtype=torch.float32, device=device)
    loss_rows, logp, ratio, kl, ent, bits = scratch[:6 * width].view(6, width).unbind()
    parts = scratch[6 * width:].view(part_sets, part).unbind() if part_sets > 1 else \
        (scratch[6 * width:],)
    return (loss_rows, logp, ratio, kl, ent, bits.view(torch.int32)), parts


def policy_loss_rows(
    kernels: Callable, policy: Tensor, ref: Optional[Tensor], ids: Tensor, mask: Tensor,
    old: Optional[Tensor], ref_logps: Optional[Tensor], temp: Tensor, adv: Tensor, adv_rows: int,
    iw: Optional[Tensor], w: Tensor, coefs: Tensor, write_grad: bool, kl_code: int,
    has_neg_cap: bool, bound: float, objective: int, entropy_grad: bool,
    rows: Sequence[Tensor], parts: Tensor, grad_out: Tensor,
) -> None:
    """One launch of ``policy_loss_kernel`` on ``policy [N, V]`` (``N >= 1``): writes the six
    row values ``rows = (w * loss_t, logp, ratio, kl, entropy, clip bits)`` (each at least
    ``[N]``, any offset: a row block's slice of a longer array) and, with ``write_grad``, the
    gradient of ``sum_t w_t loss_t`` into ``grad_out [N, V]`` (row-major; ``policy`` itself in
    the in-place mode). ``parts``: float32 scratch of at least ``N * SPLITS *
    PARTIAL_FIELDS`` (:func:`row_scratch`). Arguments as in :func:`fused_policy_loss`.
    """
    n_rows, vocab = policy.shape
    has_ref = ref is not None
    ref_t = ref if has_ref else policy  # never read without HAS_REF
    plan = launch_plan(vocab, policy.element_size(), n_rows, write_grad)
    n_counters = plan.counters(n_rows)  # 0: none used, no memset (any buffer will do)
    counts = torch.zeros(n_counters, dtype=torch.int32, device=policy.device) if n_counters \
        else rows[5]
    kernels(policy_loss_kernel)[(plan.programs(n_rows),)](
        policy, ref_t, ids, mask, w if old is None else old,
        w if ref_logps is None else ref_logps, temp, adv,
        w if iw is None else iw, w, coefs, *rows, grad_out, parts, counts,
        n_rows, vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
        row_stride(temp), adv_rows,
        HAS_REF=has_ref, HAS_IW=iw is not None, KL_CODE=kl_code, HAS_NEG_CAP=has_neg_cap,
        BOUND=bound, OBJECTIVE=objective, ON_POLICY=old is None, ENTROPY_GRAD=entropy_grad,
        WRITE_GRAD=write_grad, SPLITS=plan.spans.splits,
        TILES_PER_SPLIT=plan.spans.tiles_per_split, SPANS=plan.spans_per_program,
        BLOCK_V=plan.config.block_v, num_warps=plan.config.num_warps,
    )


def metrics_size(rollout: Optional[Tensor]) -> int:
    """The metrics' count: ``METRIC_NAMES``, then with ``rollout`` the parity fractions."""
    return len(METRIC_NAMES) + (0 if rollout is None else PARITY_METRICS)


def policy_metrics(kernels: Callable, mask: Tensor, rows: Sequence[Tensor],
                   old: Optional[Tensor], rollout: Optional[Tensor] = None,
                   ) -> Tuple[Tensor, Tensor]:
    """``(loss, metrics)``, float32 ``[]`` and ``[8]`` (``METRIC_NAMES``; with ``rollout``,
    the engine's log-probs ``[N]``, then the parity fractions of
    ``ratiokl.spec.ROLLOUT_PARITY_NAMES``), from the row values :func:`policy_loss_rows`
    wrote for all ``N = mask.numel()`` rows (``N >= 1``): one launch of
    ``policy_metrics_kernel``. ``old`` None (on-policy): the rows' own log-probs."""
    loss = torch.empty((), dtype=torch.float32, device=mask.device)
    metrics = torch.empty(metrics_size(rollout), dtype=torch.float32, device=mask.device)
    loss_rows, logp, ratio, kl, ent, bits = rows
    kernels(policy_metrics_kernel)[(1,)](
        mask, logp, ratio, kl, ent, bits, logp if old is None else old, loss_rows,
        logp if rollout is None else rollout, metrics, loss, mask.numel(),
        HAS_ROLLOUT=rollout is not None, **parity_constexprs(ROLLOUT_PARITY_TOLERANCES),
        BLOCK=ROWS_BLOCK, num_warps=ROWS_WARPS,
    )
    return loss, metrics



def scale_rows_(kernels: Callable, grad: Tensor, g: Tensor, mask: Tensor) -> None:
    """``grad[i] *= g[i]`` in place on active rows whose ``g[i] != 1`` (tested on the device)."""
    n_rows, vocab = grad.shape
    if n_rows:
        kernels(scale_rows_kernel)[(n_rows,)](
            grad, g, mask, grad, vocab, row_stride(g),
            BLOCK_V=scale_block(vocab), num_warps=SCALE_WARPS,
        )


SCALE_ROWS = KernelOp(scale_rows_, fake=lambda *_: None, mutates=("grad",))


def _fused_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[2], inputs[3])  # the stored gradient, the mask
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # else autograd fills a zero [N, V] cotangent


#: Inputs of ``fused_policy_loss`` (the op's schema, ``kernels`` aside): the backward's
#: result count.
_FUSED_INPUTS = sum(p.kind is p.POSITIONAL_OR_KEYWORD
                    for p in inspect.signature(fused_policy_loss).parameters.values()) - 1


def _fused_backward(ctx, g_loss, *_unused):
    spend(ctx, "policy_loss")  # before the stored gradient is read: it is scaled in place
    if g_loss is None:
        return (None,) * _FUSED_INPUTS
    grad, mask = ctx.saved_tensors
    g = g_loss.to(torch.float32)
    if torch._C._are_functorch_transforms_active():  # vmap cannot batch an in-place launch
        rows = g.reshape(-1, 1) if g.numel() > 1 else g.reshape(1, 1)
        grad = torch.where(mask[:, None], (grad.float() * rows).to(grad.dtype), grad)
    else:
        SCALE_ROWS.run(ctx.binding, grad, g, mask)
    return (grad,) + (None,) * (_FUSED_INPUTS - 1)


def _fused_fake(policy, ref, ids, mask, old, ref_logps, temp, adv, adv_rows, iw, w, coefs,
                write_grad, kl_code, has_neg_cap, bound, objective, entropy_grad, per_token,
                rollout):
    grad = policy.new_empty((policy.shape[0] if write_grad else 0, policy.shape[1]))
    return (policy.new_empty(policy.shape[:1] if per_token else (), dtype=torch.float32),
            policy.new_empty(metrics_size(rollout), dtype=torch.float32), grad)


POLICY_LOSS = KernelOp(fused_policy_loss, fake=_fused_fake, setup_context=_fused_context,
                       backward=_fused_backward)
