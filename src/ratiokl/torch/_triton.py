"""The ``"triton"`` and ``"interpret"`` PyTorch backends: ``ratiokl._kernels`` launched from torch.

Implements the backend interface documented in ``ratiokl.torch._dispatch``
on flattened inputs (logits ``[N, V]`` with any strides, per-row tensors
``[N]``). Both backends run the very same kernel functions:

* ``"triton"`` (CUDA tensors): under ``torch.compile`` the kernels are
  launched through ``torch.library.triton_op`` + ``wrap_triton``, so the
  compiler sees them (``fullgraph=True`` works) and the autograd formula is
  registered with ``register_autograd``; in eager mode the same launch and
  formula run in a plain ``torch.autograd.Function``, which skips the
  custom-op dispatcher's ~0.2-0.4 ms of host time per call (measured on the
  H200: that overhead, not the kernels, dominated few-row steps);
* ``"interpret"`` (CPU tensors): the interpreter twins of the same kernels
  (``ratiokl._kernels.interpreted``) inside a ``torch.library.custom_op``,
  opaque to ``torch.compile``, with the same autograd formula.

Forward: one kernel writes per row ``logp``, ``ratio``, ``kl``, ``dkl/dlogp``
and ``lse`` (few rows: a program per (row, vocabulary split) and a per-row
combine, bitwise the same; ``ratiokl._kernels.split_forward``). Backward: one
kernel forms the per-row coefficient ``c = g_logp + g_ratio * ratio + g_kl *
dkl`` (0 on inactive rows; an unused output's gradient is skipped, never
zero-filled) and writes ``c * (onehot - softmax) / T`` in the logits' dtype.
Nothing synchronises with the host; the kernels clamp every
id and poison active rows with an out-of-range id (NaN outputs and gradient)
whether or not the caller checked them, so ``check_ids`` needs nothing here.

Memory: O(N) saved for the backward (``lse``, ``ratio``, ``dkl`` and the
caller's logits, referenced, not copied); the gradient is one row-major
``[N, V]`` tensor in the logits' dtype.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple, Union

import numpy as np
import torch
from torch.library import custom_op, register_autograd, triton_op, wrap_triton

from ratiokl._kernels import (
    LaunchConfig,
    SplitPlan,
    backward_config,
    backward_splits,
    forward_config,
    interpreted,
    logp_backward_kernel,
    logp_combine_kernel,
    logp_forward_kernel,
    lse_partials_kernel,
    split_plan,
    use_split_forward,
)

__all__ = ["ratio_kl", "selected_logprobs"]

Temperature = Union[float, torch.Tensor]
Outputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _launch_forward(
    wrap: Callable, policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor,
    mask: torch.Tensor, old: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor],
    temp: torch.Tensor, kl_code: int, config: Optional[LaunchConfig] = None,
    plan: Optional[SplitPlan] = None, split: Optional[bool] = None,
) -> Outputs:
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]`` each; ``wrap(kernel)`` is launchable.

    Few rows run a program per (row, split) and a combine (``use_split_forward``),
    else one program per row; both give the same bits. ``config``, ``plan``
    and ``split`` override the heuristics (for tuning sweeps).
    """
    n_rows, vocab = policy.shape
    outs = tuple(torch.empty(n_rows, dtype=torch.float32, device=policy.device) for _ in range(5))
    if n_rows == 0:
        return outs
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    config = config or forward_config(vocab, policy.element_size())
    plan = plan or split_plan(vocab, config.block_v)
    split = use_split_forward(n_rows, plan) if split is None else split
    sizes = (vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
             0 if temp.numel() == 1 else temp.stride(0))
    rows = (ids, mask, temp if old is None else old, temp if ref_logps is None else ref_logps,
            temp)
    if not split:
        wrap(logp_forward_kernel)[(n_rows,)](
            policy, ref_t, *rows, *outs, *sizes,
            HAS_REF=ref is not None, KL_CODE=kl_code, TILES_PER_SPLIT=plan.tiles_per_split,
            BLOCK_V=config.block_v, num_warps=config.num_warps,
        )
        return outs
    parts = torch.empty((n_rows, plan.splits, 4), dtype=torch.float32, device=policy.device)
    wrap(lse_partials_kernel)[(n_rows, plan.splits)](
        policy, ref_t, mask, temp, parts, *sizes,
        HAS_REF=ref is not None, SPLITS=plan.splits, TILES_PER_SPLIT=plan.tiles_per_split,
        BLOCK_V=config.block_v, num_warps=config.num_warps,
    )
    wrap(logp_combine_kernel)[(n_rows,)](
        policy, ref_t, *rows, parts, *outs, *sizes,
        HAS_REF=ref is not None, KL_CODE=kl_code, SPLITS=plan.splits, num_warps=1,
    )
    return outs


def _launch_backward(
    wrap: Callable, logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
    temp: torch.Tensor, lse: torch.Tensor, g_logp: Optional[torch.Tensor],
    g_ratio: Optional[torch.Tensor] = None, ratio: Optional[torch.Tensor] = None,
    g_kl: Optional[torch.Tensor] = None, dkl: Optional[torch.Tensor] = None,
    config: Optional[LaunchConfig] = None,
) -> torch.Tensor:
    """Gradient ``[N, V]`` in the logits' dtype (row-major), exact 0 on inactive rows.

    The kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per row
    (a ``None`` upstream gradient is a zero term; any strides). Grid ``(N, S)``
    with ``S = backward_splits(...)`` spans per row (no bit depends on ``S``).
    ``config`` overrides the heuristic tile (for tuning sweeps).
    """
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return grad
    config = config or backward_config(vocab, logits.element_size())
    tiles = -(-vocab // config.block_v)
    per_prog = -(-tiles // backward_splits(n_rows, vocab, logits.element_size()))
    upstream = (g_logp, g_ratio, g_kl)
    given = [g is not None for g in upstream]
    # An absent term's arrays are placeholders (never read: its HAS_G_* is off), stride 0.
    pointers = [g_logp if given[0] else lse, g_ratio if given[1] else lse,
                ratio if given[1] else lse, g_kl if given[2] else lse, dkl if given[2] else lse]
    strides = [g.stride(0) if g is not None else 0 for g in upstream]
    wrap(logp_backward_kernel)[(n_rows, -(-tiles // per_prog))](
        logits, ids, mask, temp, lse, *pointers,
        grad,
        vocab, logits.stride(0), logits.stride(1), 0 if temp.numel() == 1 else temp.stride(0),
        *strides, per_prog,
        HAS_G_LOGP=given[0], HAS_G_RATIO=given[1], HAS_G_KL=given[2],
        BLOCK_V=config.block_v, num_warps=config.num_warps,
    )
    return grad


# --- "triton": CUDA, visible to torch.compile -------------------------------------------


@triton_op("ratiokl::triton_forward", mutates_args=())
def _triton_forward(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], temp: torch.Tensor,
    kl_code: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_forward(
        wrap_triton, policy, ref, ids, mask, old, ref_logps, temp, kl_code
    )


@triton_op("ratiokl::triton_backward", mutates_args=())
def _triton_backward(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temp: torch.Tensor,
    lse: torch.Tensor, g_logp: Optional[torch.Tensor], g_ratio: Optional[torch.Tensor],
    ratio: torch.Tensor, g_kl: Optional[torch.Tensor], dkl: torch.Tensor,
) -> torch.Tensor:
    return _launch_backward(
        wrap_triton, logits, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl
    )


# --- "interpret": CPU, Triton's interpreter, opaque to torch.compile ---------------------


@custom_op("ratiokl::interpret_forward", mutates_args=(), device_types="cpu")
def _interpret_forward(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], temp: torch.Tensor,
    kl_code: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with np.errstate(all="ignore"):  # NaN/inf rows are data here, not accidents
        return _launch_forward(
            interpreted, policy, ref, ids, mask, old, ref_logps, temp, kl_code
        )


@_interpret_forward.register_fake
def _(policy, ref, ids, mask, old, ref_logps, temp, kl_code):
    return tuple(policy.new_empty(policy.shape[0], dtype=torch.float32) for _ in range(5))


@custom_op("ratiokl::interpret_backward", mutates_args=(), device_types="cpu")
def _interpret_backward(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temp: torch.Tensor,
    lse: torch.Tensor, g_logp: Optional[torch.Tensor], g_ratio: Optional[torch.Tensor],
    ratio: torch.Tensor, g_kl: Optional[torch.Tensor], dkl: torch.Tensor,
) -> torch.Tensor:
    with np.errstate(all="ignore"):
        return _launch_backward(
            interpreted, logits, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl
        )


@_interpret_backward.register_fake
def _(logits, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


# --- autograd: the same formula for both --------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    policy, _, ids, mask, _, _, temp, _ = inputs
    _, ratio, _, dkl, lse = output
    ctx.save_for_backward(policy, ids, mask, temp, lse, ratio, dkl)
    ctx.mark_non_differentiable(dkl, lse)
    # Unused outputs get no zero-filled gradient: the kernel skips a None term.
    ctx.set_materialize_grads(False)


def _make_backward(backward_op: Callable) -> Callable:
    """The backward: one kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per
    row (0 on inactive rows; a NaN upstream value there stays out) and writes the gradient."""
    def backward(ctx, g_logp, g_ratio, g_kl, _g_dkl, _g_lse):
        policy, ids, mask, temp, lse, ratio, dkl = ctx.saved_tensors
        grad = backward_op(policy, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl)
        return grad, None, None, None, None, None, None, None

    return backward


register_autograd(
    "ratiokl::triton_forward", _make_backward(_triton_backward), setup_context=_setup_context
)


def _raw(kernel):
    """Launch the ``JITFunction`` itself (eager mode: no ``wrap_triton`` tracing wrapper)."""
    return kernel


class _EagerForward(torch.autograd.Function):
    """``ratiokl::triton_forward`` and its registered formula, minus the op dispatch (eager CUDA)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _launch_forward(_raw, *inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_make_backward(lambda *args: _launch_backward(_raw, *args)))
register_autograd(
    "ratiokl::interpret_forward", _make_backward(_interpret_backward), setup_context=_setup_context
)


# --- backend interface ----------------------------------------------------------------------


def choose_op(device: torch.device, interpret_op: Callable, compiled_op: Callable,
              eager_op: Callable) -> Callable:
    """Which binding of a launch runs: the interpreter's custom op on a CPU; on CUDA the
    ``triton_op`` while ``torch.compile`` traces, else the eager ``autograd.Function``."""
    if device.type != "cuda":
        return interpret_op
    return compiled_op if torch.compiler.is_compiling() else eager_op


def _forward_op(device: torch.device) -> Callable:
    return choose_op(device, _interpret_forward, _triton_forward, _EagerForward.apply)


@functools.lru_cache(maxsize=64)
def _scalar_temperature(value: float, device: torch.device) -> torch.Tensor:
    """A float32 ``[1]`` tensor holding ``value``, made once per (value, device).

    Read-only for the kernels; reusing it saves a fill launch per call (a few
    microseconds of device time and host time that show at small N).
    """
    return torch.full((1,), value, dtype=torch.float32, device=device)


def kernel_temperature(temperature: Temperature, device: torch.device) -> torch.Tensor:
    """Temperature as float32 data the kernels read: ``[1]`` (stride 0 in-kernel) or ``[N]``."""
    if isinstance(temperature, torch.Tensor):
        return temperature.detach().to(torch.float32)
    if torch.compiler.is_compiling():  # a traced graph makes its own constant
        return torch.full((1,), float(temperature), dtype=torch.float32, device=device)
    return _scalar_temperature(float(temperature), torch.device(device))


def selected_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, temperature: Temperature,
    check_ids: bool,
) -> torch.Tensor:
    """Float32 ``logp[N]`` of ``logits[N, V]``; 0 on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``logits`` (gradient in its dtype). ``check_ids``
    is accepted for the interface; the kernel poisons bad ids regardless.
    """
    temp = kernel_temperature(temperature, logits.device)
    logp, _, _, _, _ = _forward_op(logits.device)(logits, None, ids, mask, None, None, temp, 0)
    return logp


def ratio_kl(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor], kl_code: int,
    temperature: Temperature, check_ids: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(ratio[N], kl[N])``: ``(1, 0)`` on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``policy`` only; ``ref``, ``ref_logps`` and
    ``old_logps`` are read detached. ``check_ids`` as in :func:`selected_logprobs`.
    """
    temp = kernel_temperature(temperature, policy.device)
    ref = None if ref is None else ref.detach()
    ref_logps = None if ref_logps is None else ref_logps.detach().to(torch.float32)
    old = old_logps.detach().to(torch.float32)
    _, ratio, kl, _, _ = _forward_op(policy.device)(
        policy, ref, ids, mask, old, ref_logps, temp, kl_code
    )
    return ratio, kl
