"""The one-pass fused ``policy_loss`` on the ``"triton"`` and ``"interpret"`` PyTorch backends.

``ratiokl._kernels.policy_loss_kernel`` computes, per row, the log-sum-exp,
the per-token objective and -- in the same program, while the row is in
L2 -- the policy-logit gradient of ``sum_t w_t * loss_t``, stored in the
logits' dtype. The backward is ``scale_rows_kernel``: the stored gradient
scaled in place by the upstream value of each row, skipped on the device
for rows whose upstream value is exactly 1 (``loss.backward()``) -- no host
synchronisation anywhere.

Which options fuse (:func:`fuses`): every option of ``policy_loss`` except
``ratio_level="sequence"`` (GSPO needs a cross-row mean of the log-ratio
before the objective) and vocabulary-sharded logits (``vocab_group``);
those run the two-pass path (``selected_logprobs`` + ``_objective``). The
aggregation weights ``w = a_t / D`` depend only on the mask, segment ids
and ``loss_normalizer``, so they are computed before the launch (one
launch for the token-level aggregations, ``_loss_rows``), and the metrics
and the loss's sum after it in one more; the float options (clip bounds,
``kl_coef``, ``log_ratio_bound``) are compile-time constants of the kernel
(one compile per distinct value, as they are fixed for a run).

Memory and aliasing: when a gradient is wanted (grad mode on and the policy
logits require it) the forward allocates the ``[N, V]`` gradient and keeps
it for the backward, which scales it in place and returns it; the backward
therefore runs once per forward (a second ``backward`` with
``retain_graph=True`` fails autograd's in-place check rather than returning
a wrong gradient). Otherwise the kernel skips the gradient sweep: one read
of the row, O(N) memory. With ``inplace_grad=True`` (eager mode) the
gradient is written into the policy logits' own buffer instead: the logits
are consumed (they hold ``d loss / d logits`` afterwards) and the step's
extra memory is O(N).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch.library import custom_op, register_autograd, triton_op, wrap_triton

from ratiokl._kernels import interpreted
from ratiokl._kernels.fused_loss import launch_plan, policy_loss_kernel, scale_rows_kernel
from ratiokl.spec import PolicyLossOptions
from ratiokl.torch import _loss_rows, _objective, _triton

__all__ = ["fuses", "policy_loss"]

#: Tile of the in-place scale (a plain streaming read-modify-write).
_SCALE_BLOCK = 4096

FusedOutputs = Tuple[torch.Tensor, ...]


def fuses(backend_module: object, opts: PolicyLossOptions) -> bool:
    """Whether ``policy_loss`` with these options on this backend takes the fused kernel."""
    return backend_module is _triton and not opts.sequence_ratio


def _options(opts: PolicyLossOptions, has_ref: bool, write_grad: bool) -> Tuple:
    """The kernel's options as a flat tuple (custom ops take no dataclasses)."""
    return (
        write_grad,
        opts.kl_code if has_ref else 0,
        opts.kl_coef,
        opts.ratio_low,
        opts.ratio_high,
        opts.neg_cap or 0.0,
        opts.log_ratio_bound or 0.0,
    )


def _launch(kernel, policy, ref, ids, mask, old, ref_logps, temp, adv, iw, w,
            has_ref: bool, write_grad: bool, kl_code: int, kl_coef: float, ratio_low: float,
            ratio_high: float, neg_cap: float, bound: float,
            grad_out: Optional[torch.Tensor] = None) -> FusedOutputs:
    """``(loss_rows, logp, ratio, kl, clip_bits, grad)``; see ``policy_loss_kernel``.

    Without ``write_grad`` the gradient output is an empty ``[0, V]`` tensor.
    ``grad_out``: a row-major ``[N, V]`` buffer to write the gradient into
    (the in-place mode passes ``policy`` itself: each tile is read before it
    is overwritten, by the same program).
    """
    n_rows, vocab = policy.shape
    f32 = dict(dtype=torch.float32, device=policy.device)
    if grad_out is None:
        grad_out = torch.empty((n_rows if write_grad else 0, vocab), dtype=policy.dtype,
                               device=policy.device)
    outs = tuple(torch.empty(n_rows, **f32) for _ in range(4)) + (
        torch.empty(n_rows, dtype=torch.int32, device=policy.device), grad_out,
    )
    if n_rows == 0:
        return outs
    ref_t = ref if has_ref else policy  # never read without HAS_REF
    plan = launch_plan(vocab, policy.element_size(), n_rows, write_grad)
    parts = torch.empty((n_rows, plan.spans.splits, 4), **f32)
    n_counters = plan.counters(n_rows)  # 0: none used, no memset (any buffer will do)
    counts = torch.zeros(n_counters, dtype=torch.int32, device=policy.device) if n_counters \
        else torch.empty(1, dtype=torch.int32, device=policy.device)
    kernel[(plan.programs(n_rows),)](
        policy, ref_t, ids, mask, old, w if ref_logps is None else ref_logps, temp, adv,
        w if iw is None else iw, w,
        *outs, parts, counts,
        n_rows, vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
        0 if temp.numel() == 1 else temp.stride(0),
        HAS_REF=has_ref, HAS_IW=iw is not None, KL_CODE=kl_code, KL_COEF=kl_coef,
        RATIO_LOW=ratio_low, RATIO_HIGH=ratio_high, NEG_CAP=neg_cap, BOUND=bound,
        WRITE_GRAD=write_grad, SPLITS=plan.spans.splits,
        TILES_PER_SPLIT=plan.spans.tiles_per_split, SPANS=plan.spans_per_program,
        BLOCK_V=plan.config.block_v, num_warps=plan.config.num_warps,
    )
    return outs


def _scale(kernel, grad: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> None:
    """``grad[i] *= g[i]`` in place on active rows whose ``g[i] != 1`` (device-side test)."""
    n_rows, vocab = grad.shape
    if n_rows == 0:
        return
    kernel[(n_rows,)](
        grad, g, mask, grad, vocab, 0 if g.numel() == 1 else g.stride(0),
        BLOCK_V=min(_SCALE_BLOCK, max(16, 1 << (vocab - 1).bit_length())), num_warps=8,
    )


# --- "triton": CUDA, visible to torch.compile -------------------------------------------


@triton_op("ratiokl::fused_policy_loss", mutates_args=())
def _triton_fused(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old: torch.Tensor, ref_logps: Optional[torch.Tensor], temp: torch.Tensor,
    adv: torch.Tensor, iw: Optional[torch.Tensor], w: torch.Tensor, has_ref: bool,
    write_grad: bool, kl_code: int, kl_coef: float, ratio_low: float, ratio_high: float,
    neg_cap: float, bound: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch(
        wrap_triton(policy_loss_kernel), policy, ref, ids, mask, old, ref_logps, temp, adv,
        iw, w, has_ref, write_grad, kl_code, kl_coef, ratio_low, ratio_high, neg_cap, bound,
    )


@triton_op("ratiokl::fused_scale_rows_", mutates_args={"grad"})
def _triton_scale(grad: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> None:
    _scale(wrap_triton(scale_rows_kernel), grad, g, mask)


# --- "interpret": CPU, Triton's interpreter, opaque to torch.compile ---------------------


@custom_op("ratiokl::interpret_fused_policy_loss", mutates_args=(), device_types="cpu")
def _interpret_fused(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old: torch.Tensor, ref_logps: Optional[torch.Tensor], temp: torch.Tensor,
    adv: torch.Tensor, iw: Optional[torch.Tensor], w: torch.Tensor, has_ref: bool,
    write_grad: bool, kl_code: int, kl_coef: float, ratio_low: float, ratio_high: float,
    neg_cap: float, bound: float,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with np.errstate(all="ignore"):  # NaN/inf rows are data here, not accidents
        return _launch(
            interpreted(policy_loss_kernel), policy, ref, ids, mask, old, ref_logps, temp, adv,
            iw, w, has_ref, write_grad, kl_code, kl_coef, ratio_low, ratio_high, neg_cap, bound,
        )


@_interpret_fused.register_fake
def _(policy, ref, ids, mask, old, ref_logps, temp, adv, iw, w, has_ref, write_grad, *options):
    n_rows, vocab = policy.shape
    rows = tuple(policy.new_empty(n_rows, dtype=torch.float32) for _ in range(4))
    grad = policy.new_empty((n_rows if write_grad else 0, vocab))
    return rows + (policy.new_empty(n_rows, dtype=torch.int32), grad)


@custom_op("ratiokl::interpret_scale_rows_", mutates_args={"grad"}, device_types="cpu")
def _interpret_scale(grad: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> None:
    with np.errstate(all="ignore"):
        _scale(interpreted(scale_rows_kernel), grad, g, mask)


# --- autograd: the stored gradient, scaled by the upstream value --------------------------


def _setup_context(ctx, inputs, output) -> None:
    mask = inputs[3]
    grad = output[5]
    ctx.save_for_backward(grad, mask)
    ctx.mark_non_differentiable(*output[1:])
    # Else autograd fills a zero [N, V] cotangent for the stored-gradient output.
    ctx.set_materialize_grads(False)


def _make_backward(scale_op):
    def backward(ctx, g_loss, *_unused):
        if g_loss is None:
            return (None,) * 18
        grad, mask = ctx.saved_tensors
        scale_op(grad, g_loss.to(torch.float32), mask)
        return (grad,) + (None,) * 17

    return backward


register_autograd(
    "ratiokl::fused_policy_loss", _make_backward(_triton_scale), setup_context=_setup_context
)
register_autograd(
    "ratiokl::interpret_fused_policy_loss", _make_backward(_interpret_scale),
    setup_context=_setup_context,
)


def _eager_scale(grad: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> None:
    """``_scale`` launched directly; bumps ``grad``'s version as the mutating op does."""
    _scale(_triton._raw(scale_rows_kernel), grad, g, mask)
    torch.autograd.graph.increment_version(grad)


class _EagerFused(torch.autograd.Function):
    """``ratiokl::fused_policy_loss`` and its formula without the op dispatch (eager CUDA).

    Same launches as the ``triton_op`` (which ``torch.compile`` traces); the
    custom-op dispatcher costs ~0.2-0.4 ms of host time per call.
    """

    @staticmethod
    def forward(ctx, *inputs):
        output = _launch(_triton._raw(policy_loss_kernel), *inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_make_backward(_eager_scale))


class _InplaceFused(torch.autograd.Function):
    """The fused loss writing its gradient into the policy logits' own buffer (opt-in).

    Eager only (CUDA: the Triton kernels; CPU: their interpreter twins). The
    forward overwrites ``policy`` with ``d loss / d policy`` and bumps its
    version, so any other autograd node that saved the logits fails loudly
    in its backward instead of reading gradients; the backward scales that
    buffer by the upstream value and returns it: no ``[N, V]`` allocation.
    """

    @staticmethod
    def forward(ctx, policy, *inputs):
        cuda = policy.device.type == "cuda"
        kernel = (_triton._raw if cuda else interpreted)(policy_loss_kernel)
        with np.errstate(all="ignore"):
            output = _launch(kernel, policy, *inputs, grad_out=policy)
        torch.autograd.graph.increment_version(policy)
        ctx.grad = policy.detach()  # not saved_tensors: it holds the gradient now
        ctx.mask = inputs[2]
        ctx.scale = _eager_scale if cuda else _interpret_scale
        ctx.mark_non_differentiable(*output[1:5])
        ctx.set_materialize_grads(False)
        return output[:5]

    @staticmethod
    def backward(ctx, g_loss, *_unused):
        if g_loss is None:
            return (None,) * 18
        if ctx.grad is None:
            raise RuntimeError(
                "policy_loss(inplace_grad=True) gives its gradient once: the logits' buffer "
                "was already handed back; use inplace_grad=False to backward more than once"
            )
        with np.errstate(all="ignore"):
            ctx.scale(ctx.grad, g_loss.to(torch.float32), ctx.mask)
        grad, ctx.grad = ctx.grad, None  # once: the buffer is the caller's now
        return (grad,) + (None,) * 17


# --- entry point from ratiokl.torch.loss -----------------------------------------------------


def _flat(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().reshape(-1).to(torch.float32)


def policy_loss(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    ref_logps: Optional[torch.Tensor], temperature: _triton.Temperature,
    inputs: _objective.TokenInputs, opts: PolicyLossOptions, lead: Tuple[int, ...],
    inplace_grad: bool = False,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Fused ``(loss, metrics)`` on flattened rows (requires :func:`fuses`).

    Args:
      policy: ``[N, V]`` logits (any strides), the only differentiable input.
      ref: ``[N, V]`` reference logits or None; ref_logps: float ``[N]`` or None.
      ids, mask: ``[N]`` integer / bool. temperature: a float or float32 ``[N]``.
      inputs, opts, lead: as for ``_objective.policy_objective`` (``[R, T]`` layout
        of the leading shape ``lead``).
      inplace_grad: write the gradient into ``policy``'s buffer (see
        :class:`_InplaceFused`); only when a gradient is wanted, outside
        ``torch.compile`` (which plans its own buffers: there it is ignored).

    Returns:
      The float32 0-d loss (its gradient reaches ``policy`` only, in its dtype)
      and the detached metrics of ``_objective.token_metrics``.
    """
    mask_rows = _objective.as_rows(mask, lead)
    w = _loss_rows.aggregation_weights(mask_rows, inputs, opts).reshape(-1)
    has_ref = ref is not None or ref_logps is not None
    # No gradient wanted (no_grad, frozen logits): the row is read once, memory O(N).
    write_grad = torch.is_grad_enabled() and policy.requires_grad
    op = _triton.choose_op(policy.device, _interpret_fused, _triton_fused, _EagerFused.apply)
    if inplace_grad and write_grad and not torch.compiler.is_compiling():
        op = _InplaceFused.apply  # ratiokl.torch.loss checked that policy is contiguous
    old = _flat(inputs.old_logps)
    loss_rows, logp, ratio, kl, bits = op(
        policy, None if ref is None else ref.detach(), ids, mask, old,
        _flat(ref_logps), _triton.kernel_temperature(temperature, policy.device),
        _flat(inputs.advantages), _flat(inputs.importance_weights), w, ref is not None,
        *_options(opts, has_ref, write_grad),
    )[:5]
    return _loss_rows.loss_and_metrics(loss_rows, mask, logp, ratio, kl, bits, old)
