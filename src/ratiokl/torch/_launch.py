"""Every Triton launch of the PyTorch binding, each described once and bound three ways.

A launch is a plain function ``launch(kernels, *args)``: ``kernels`` maps a
``@triton.jit`` kernel to something launchable as ``kernel[grid](...)``, and
the annotated positional parameters after it are the op's schema.
:class:`KernelOp` binds that one description for each way torch runs it:

* ``"eager"`` (CUDA, outside ``torch.compile``): the kernels themselves, inside
  a generated ``torch.autograd.Function`` when the op has a gradient, else
  called directly -- no op dispatcher, whose ~0.2-0.4 ms of host time per call
  dominated few-row steps on the H200;
* ``"compiled"`` (CUDA, while ``torch.compile`` traces): a
  ``torch.library.triton_op`` launching through ``wrap_triton``, so the
  compiler sees the kernels (``fullgraph=True`` works);
* ``"interpret"`` (CPU tensors): the interpreter twins
  (``ratiokl._kernels.interpreted``) inside a ``torch.library.custom_op``,
  opaque to the compiler, with a fake for tracing.

An op with a gradient gives ``setup_context(ctx, inputs, output)`` and
``backward(ctx, *grads)``: registered for both library ops and used by the
eager Function. ``ctx.binding`` names the binding that ran the forward, so a
backward launches its own kernels the same way (:meth:`KernelOp.run`).

Launches never synchronise with the host and never read out of bounds: the
kernels clamp every id and poison (NaN) an active row with an id outside
``[0, V)`` or a NaN temperature, so a host check is never needed for safety.
"""

from __future__ import annotations

import inspect
import math
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.library import custom_op, register_autograd, triton_op, wrap_triton

from ratiokl._codes import KL
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
    shard_stats_kernel,
    split_plan,
    use_split_forward,
)
from ratiokl._kernels.interpret import quiet as quiet_interpreter
from ratiokl._kernels.active_check import CHECK_BLOCK, CHECK_WARPS, active_check_kernel
from ratiokl._kernels.fused_loss import (
    PARTIAL_FIELDS,
    SCALE_WARPS,
    launch_plan,
    policy_loss_kernel,
    scale_block,
    scale_rows_kernel,
)
from ratiokl._kernels.loss_rows import (
    METRIC_NAMES,
    ROWS_BLOCK,
    ROWS_WARPS,
    policy_metrics_kernel,
    token_weights_kernel,
)
from ratiokl._kernels.rollout import rollout_weights_kernel
from ratiokl.torch._cached_launch import cached
from ratiokl.torch._once import spend

__all__ = [
    "BACKWARD", "ENTROPY_FORWARD", "FORWARD", "KernelOp", "POLICY_LOSS", "ROLLOUT_WEIGHTS",
    "SCALE_ROWS", "SHARD_STATS", "TOKEN_WEIGHTS", "row_backward", "row_forward",
]

Tensor = torch.Tensor


def _raw(kernel):
    """Eager CUDA: the kernel launched from its cached compiled handle (no tracing wrapper,
    no per-call binder: ``_cached_launch``)."""
    return cached(kernel)


def _interpreter(kernel):
    return interpreted(kernel)


class KernelOp:
    """One launch (``launch(kernels, *args)``) bound as eager, compiled and interpreted ops.

    Call it like the launch without ``kernels``: the binding is chosen from the
    first tensor argument's device and whether ``torch.compile`` is tracing.
    """

    def __init__(self, launch: Callable, *, fake: Callable, mutates: Sequence[str] = (),
                 setup_context: Optional[Callable] = None,
                 backward: Optional[Callable] = None) -> None:
        name = launch.__name__
        signature = inspect.signature(launch)
        params = [p for p in list(signature.parameters.values())[1:]
                  if p.kind is p.POSITIONAL_OR_KEYWORD]  # keyword-only: eager tuning knobs
        schema = signature.replace(parameters=params)
        self.launch = launch
        self._mutates = tuple(mutates)
        names = [p.name for p in params]
        self._mutated_positions = tuple(names.index(m) for m in self._mutates)
        self._compiled = triton_op(f"ratiokl::{name}", self._bound(launch, wrap_triton, schema),
                                   mutates_args=self._mutates)
        self._interpret = custom_op(
            f"ratiokl::interpret_{name}", self._bound(launch, _interpreter, schema, quiet=True),
            mutates_args=self._mutates, device_types="cpu",
        )
        self._interpret.register_fake(fake)
        self._eager = self._direct
        if backward is not None:
            for qualname, binding in ((f"ratiokl::{name}", "compiled"),
                                      (f"ratiokl::interpret_{name}", "interpret")):
                register_autograd(qualname, backward,
                                  setup_context=self._tagged(setup_context, binding))
            self._eager = self._function(name, setup_context, backward)

    @staticmethod
    def _bound(launch: Callable, kernels: Callable, schema: inspect.Signature,
               quiet: bool = False) -> Callable:
        def op(*args):
            if quiet:  # the interpreter: its NumPy noise stays out of the caller's output
                with quiet_interpreter():
                    return launch(kernels, *args)
            return launch(kernels, *args)

        op.__signature__ = schema
        op.__name__ = launch.__name__
        return op

    @staticmethod
    def _tagged(setup_context: Callable, binding: str) -> Callable:
        def setup(ctx, inputs, output) -> None:
            ctx.binding = binding
            setup_context(ctx, inputs, output)

        return setup

    def _function(self, name: str, setup_context: Callable,
                  backward: Callable) -> Callable:
        """The eager op: an ``autograd.Function`` of the first input (the one a backward
        differentiates) and the rest as one tuple, which autograd does not walk
        (``apply`` costs host time per argument: the fused loss's twenty took about 35 us
        a call on the CPU); ``backward``'s other gradients, all None, are dropped."""
        launch = self.launch

        def forward(ctx, first, rest):
            args = (first, *rest)
            output = launch(_raw, *args)
            ctx.binding = "eager"
            setup_context(ctx, args, output)
            return output

        def backward_first(ctx, *grads):
            return backward(ctx, *grads)[0], None

        function = type(f"{name}_eager", (torch.autograd.Function,),
                        {"forward": staticmethod(forward),
                         "backward": staticmethod(backward_first)})
        return lambda first, *rest: function.apply(first, rest)

    def _direct(self, *args):
        output = self.launch(_raw, *args)
        for index in self._mutated_positions:
            torch.autograd.graph.increment_version(args[index])
        return output

    def run(self, binding: str, *args):
        """The op through ``binding`` (``"eager"``, ``"compiled"`` or ``"interpret"``).

        Eager without a gradient to take (grad mode off, or the first input -- the only
        one a backward differentiates -- not requiring one): the launch itself, without
        the ``autograd.Function`` around it (about 10 us of host time a call).
        """
        if binding == "eager":
            if torch.is_grad_enabled() and args[0].requires_grad:
                return self._eager(*args)
            return self._direct(*args)
        return (self._compiled if binding == "compiled" else self._interpret)(*args)

    def __call__(self, *args):
        return self.run(binding_for(args[0].device), *args)

    def direct(self, device: torch.device, *args, **knobs):
        """The launch itself, outside any op or autograd (eager only; knobs: tuning overrides)."""
        kernels = _raw if device.type == "cuda" else _interpreter
        with np.errstate(all="ignore"):
            return self.launch(kernels, *args, **knobs)


def binding_for(device: torch.device) -> str:
    """Which binding runs on ``device`` now (see the module docstring)."""
    if device.type != "cuda":
        return "interpret"
    return "compiled" if torch.compiler.is_compiling() else "eager"


def _rows(n_rows: int, device: torch.device, count: int) -> Tuple[Tensor, ...]:
    return tuple(torch.empty(n_rows, dtype=torch.float32, device=device) for _ in range(count))


def _stride(t: Tensor) -> int:
    """Row stride of a per-row tensor, 0 for a one-element tensor (one value for every row)."""
    return 0 if t.numel() == 1 else t.stride(0)


# --- the check_ids test (eager CUDA; ratiokl.torch._checks.ActiveCheck) ------------------


def active_flags(ids: Tensor, mask: Tensor, vocab: Optional[int],
                 temperature: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """int32 ``[2]``: (an active id outside ``[0, vocab)``, an active temperature outside
    ``(0, inf)``), from one launch; ``vocab`` / ``temperature`` None: not tested.

    Inputs of the leading shape, any strides (flattened; a 0-d temperature expanded
    over the rows is read with stride 0). CUDA tensors launch the kernel, CPU tensors its
    interpreter twin (tests). ``out``: where the flags go (its first two int32), e.g. a
    pinned host slot the device writes through unified addressing; returned.
    """
    kernels = _raw if ids.device.type == "cuda" else _interpreter
    ids = ids.reshape(-1).contiguous()
    mask = mask.reshape(-1).contiguous()
    flags = torch.empty(2, dtype=torch.int32, device=ids.device) if out is None else out
    temp = mask if temperature is None else temperature.reshape(-1)
    if temp.stride(0) not in (0, 1):
        temp = temp.contiguous()
    kernels(active_check_kernel)[(1,)](
        ids, mask, temp, flags, ids.numel(), vocab or 0, _stride(temp),
        CHECK_IDS=vocab is not None, CHECK_TEMP=temperature is not None, BLOCK=CHECK_BLOCK,
        num_warps=CHECK_WARPS,
    )
    return flags


# --- log-probs, ratio and KL: forward and backward of one row's statistics ---------------


def row_forward(
    kernels: Callable, policy: Tensor, ref: Optional[Tensor], ids: Tensor, mask: Tensor,
    old: Optional[Tensor], ref_logps: Optional[Tensor], temp: Tensor, kl_code: int, *,
    config: Optional[LaunchConfig] = None, plan: Optional[SplitPlan] = None,
    split: Optional[bool] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]`` each of ``policy [N, V]``.

    Few rows run a program per (row, vocabulary split) and a combine
    (``use_split_forward``), else one program per row; both give the same bits.
    ``config``, ``plan`` and ``split`` override the heuristics (tuning sweeps).
    """
    return _forward_launch(kernels, policy, ref, ids, mask, old, ref_logps, temp, kl_code,
                           False, config, plan, split)


def _forward_launch(kernels, policy, ref, ids, mask, old, ref_logps, temp, kl_code: int,
                    entropy: bool, config, plan, split) -> Tuple[Tensor, ...]:
    """The forward's launches (see :func:`row_forward`); ``entropy``: the kernels' ``ENTROPY``
    mode (no reference, ``kl_code`` 0), the entropy in the ``kl`` and ``dkl`` outputs."""
    n_rows, vocab = policy.shape
    outs = _rows(n_rows, policy.device, 5)
    if n_rows == 0:
        return outs
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    config = config or forward_config(vocab, policy.element_size())
    plan = plan or split_plan(vocab, config.block_v)
    split = use_split_forward(n_rows, plan) if split is None else split
    sizes = (vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
             _stride(temp))
    rows = (ids, mask, temp if old is None else old, temp if ref_logps is None else ref_logps,
            temp)
    if not split:
        kernels(logp_forward_kernel)[(n_rows,)](
            policy, ref_t, *rows, *outs, *sizes,
            HAS_REF=ref is not None, KL_CODE=kl_code, ENTROPY=entropy,
            TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v,
            num_warps=config.num_warps,
        )
        return outs
    parts = torch.empty((n_rows, plan.splits, 4), dtype=torch.float32, device=policy.device)
    kernels(lse_partials_kernel)[(n_rows, plan.splits)](
        policy, ref_t, mask, temp, parts, *sizes,
        HAS_REF=ref is not None, ENTROPY=entropy, SPLITS=plan.splits,
        TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    kernels(logp_combine_kernel)[(n_rows,)](
        policy, ref_t, *rows, parts, *outs, *sizes,
        HAS_REF=ref is not None, KL_CODE=kl_code, ENTROPY=entropy, SPLITS=plan.splits,
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
    ``(N, S)`` with ``S = backward_splits(...)`` spans per
    row (no bit depends on ``S``); ``config`` overrides the tile (tuning sweeps).
    ``out``: a row-major ``[N, V]`` buffer of the logits' dtype for the gradient, which may
    be the (row-major) logits themselves: each program reads a tile before it writes it.
    """
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device) \
        if out is None else out
    if n_rows == 0:
        return grad
    config = config or backward_config(vocab, logits.element_size())
    tiles = -(-vocab // config.block_v)
    per_prog = -(-tiles // backward_splits(n_rows, vocab, logits.element_size()))
    upstream = (g_logp, g_ratio, g_kl)
    # An absent term's arrays are placeholders (never read: its HAS_G_* is off), stride 0.
    pointers = (lse if g_logp is None else g_logp, lse if g_ratio is None else g_ratio,
                lse if g_ratio is None else ratio, lse if g_kl is None else g_kl,
                lse if g_kl is None else dkl)
    kernels(logp_backward_kernel)[(n_rows, -(-tiles // per_prog))](
        logits, ids, mask, temp, lse, *pointers, grad,
        vocab, logits.stride(0), logits.stride(1), _stride(temp),
        *(0 if g is None else g.stride(0) for g in upstream), per_prog,
        HAS_G_LOGP=g_logp is not None, HAS_G_RATIO=g_ratio is not None,
        HAS_G_KL=g_kl is not None, ENTROPY=entropy, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
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


# --- the fused policy loss: weights before, loss + metrics + stored gradient, scale after -------


def token_weights(kernels: Callable, mask: Tensor) -> Tensor:
    """``w = where(mask, 1 / D, 0)`` float32 ``[N]``, ``D`` = the active rows (at least 1)."""
    w = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    if mask.numel():
        kernels(token_weights_kernel)[(1,)](mask, w, mask.numel(), BLOCK=ROWS_BLOCK,
                                            num_warps=ROWS_WARPS)
    return w


TOKEN_WEIGHTS = KernelOp(token_weights, fake=lambda mask, *_: mask.new_empty(
    mask.shape, dtype=torch.float32))


def fused_policy_loss(
    kernels: Callable, policy: Tensor, ref: Optional[Tensor], ids: Tensor, mask: Tensor,
    old: Optional[Tensor], ref_logps: Optional[Tensor], temp: Tensor, adv: Tensor, adv_rows: int,
    iw: Optional[Tensor], w: Tensor, coefs: Tensor, write_grad: bool, kl_code: int,
    has_neg_cap: bool, bound: float, objective: int, entropy_grad: bool, per_token: bool,
    *, grad_out: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """``(loss, metrics, grad)``: float32 ``[]`` (with ``per_token``: the rows' weighted
    losses ``w_t * loss_t``, float32 ``[N]``, 0 on inactive rows), float32 ``[8]``
    (``METRIC_NAMES``), and ``d sum_t w_t loss_t / d policy`` ``[N, V]`` in the logits'
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
                torch.zeros(len(METRIC_NAMES), dtype=torch.float32, device=device), grad_out)
    plan = launch_plan(vocab, policy.element_size(), n_rows, write_grad)
    # One scratch allocation (host time: one allocator call, not eight): the six row
    # values, then the spans' partials.
    rows, parts = row_scratch(n_rows, plan.spans.splits, device)
    policy_loss_rows(kernels, policy, ref, ids, mask, old, ref_logps, temp, adv, adv_rows, iw,
                     w, coefs, write_grad, kl_code, has_neg_cap, bound, objective,
                     entropy_grad, rows, parts[0], grad_out)
    loss, metrics = policy_metrics(kernels, mask, rows, old)
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
        _stride(temp), adv_rows,
        HAS_REF=has_ref, HAS_IW=iw is not None, KL_CODE=kl_code, HAS_NEG_CAP=has_neg_cap,
        BOUND=bound, OBJECTIVE=objective, ON_POLICY=old is None, ENTROPY_GRAD=entropy_grad,
        WRITE_GRAD=write_grad, SPLITS=plan.spans.splits,
        TILES_PER_SPLIT=plan.spans.tiles_per_split, SPANS=plan.spans_per_program,
        BLOCK_V=plan.config.block_v, num_warps=plan.config.num_warps,
    )


def policy_metrics(kernels: Callable, mask: Tensor, rows: Sequence[Tensor],
                   old: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """``(loss, metrics)``, float32 ``[]`` and ``[8]`` (``METRIC_NAMES``), from the row values
    :func:`policy_loss_rows` wrote for all ``N = mask.numel()`` rows (``N >= 1``): one launch
    of ``policy_metrics_kernel``. ``old`` None (on-policy): the rows' own log-probs."""
    loss = torch.empty((), dtype=torch.float32, device=mask.device)
    metrics = torch.empty(len(METRIC_NAMES), dtype=torch.float32, device=mask.device)
    loss_rows, logp, ratio, kl, ent, bits = rows
    kernels(policy_metrics_kernel)[(1,)](
        mask, logp, ratio, kl, ent, bits, logp if old is None else old, loss_rows, metrics,
        loss, mask.numel(),
        BLOCK=ROWS_BLOCK, num_warps=ROWS_WARPS,
    )
    return loss, metrics


def kernels_for(device: torch.device) -> Callable:
    """The launcher of eager launches outside any op (:meth:`KernelOp.direct`): the cached
    compiled handle on CUDA, the interpreter twin on the CPU."""
    return _raw if device.type == "cuda" else _interpreter


def scale_rows_(kernels: Callable, grad: Tensor, g: Tensor, mask: Tensor) -> None:
    """``grad[i] *= g[i]`` in place on active rows whose ``g[i] != 1`` (tested on the device)."""
    n_rows, vocab = grad.shape
    if n_rows:
        kernels(scale_rows_kernel)[(n_rows,)](
            grad, g, mask, grad, vocab, _stride(g),
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
    SCALE_ROWS.run(ctx.binding, grad, g_loss.to(torch.float32), mask)
    return (grad,) + (None,) * (_FUSED_INPUTS - 1)


def _fused_fake(policy, ref, ids, mask, old, ref_logps, temp, adv, adv_rows, iw, w, coefs,
                write_grad, kl_code, has_neg_cap, bound, objective, entropy_grad, per_token):
    grad = policy.new_empty((policy.shape[0] if write_grad else 0, policy.shape[1]))
    return (policy.new_empty(policy.shape[:1] if per_token else (), dtype=torch.float32),
            policy.new_empty(len(METRIC_NAMES), dtype=torch.float32), grad)


POLICY_LOSS = KernelOp(fused_policy_loss, fake=_fused_fake, setup_context=_fused_context,
                       backward=_fused_backward)


# --- one vocabulary shard (vocab-parallel) -----------------------------------------------------


def shard_stats(kernels: Callable, policy: Tensor, ref: Optional[Tensor], mask: Tensor,
                temp: Tensor, entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(lse, ref_lse, mu)`` float32 ``[N]`` of this shard (``ref_lse`` 0 without ``ref``;
    ``mu``, the mean ``x / T`` under the shard's softmax, only with ``entropy``, else
    unwritten).

    ``shard_stats_kernel`` without its selected-logit part (a rank learns where
    its shard starts only from the first all-reduce); 0 on inactive rows.
    """
    n_rows, vocab = policy.shape
    lse, ref_lse, mu = _rows(n_rows, policy.device, 3)
    if n_rows == 0:
        return lse, ref_lse, mu
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    config = forward_config(vocab, policy.element_size())
    # ids, start and the selected-logit outputs are untouched with SELECT=False.
    kernels(shard_stats_kernel)[(n_rows,)](
        policy, ref_t, mask, mask, temp, mask, lse, ref_lse, lse, lse, mu,
        vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
        _stride(temp),
        HAS_REF=ref is not None, SELECT=False, ENTROPY=entropy, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    return lse, ref_lse, mu


SHARD_STATS = KernelOp(shard_stats, fake=lambda policy, *_: tuple(
    policy.new_empty(policy.shape[0], dtype=torch.float32) for _ in range(3)))


# --- the rollout correction's weights (before the policy loss) ---------------------------------


def rollout_weights(kernels: Callable, mask: Tensor, old: Tensor, rollout: Tensor,
                    seq: Optional[Tensor], iw: Optional[Tensor], seq_width: int, low: float,
                    high: float, bound: float, correct: int) -> Tuple[Tensor, Tensor]:
    """``(w * iw, metrics)``: float32 ``[N]`` (0 on inactive rows) and float32 ``[3]``
    (``ratiokl.spec.ROLLOUT_METRIC_NAMES``) from ``rollout_weights_kernel``.

    ``seq``: the sequence log-weights, one per ``seq_width`` rows (None: token level);
    ``iw``: importance weights or None; ``high`` may be inf (no ceiling, mask modes);
    ``bound``: ``log_ratio_bound`` (0: none); ``correct``: the kernel's ``CORRECT``.
    """
    w = torch.empty(mask.shape, dtype=torch.float32, device=mask.device)
    metrics = torch.empty(3, dtype=torch.float32, device=mask.device)
    if not mask.numel():
        return w, metrics.zero_()
    finite = high < math.inf
    kernels(rollout_weights_kernel)[(1,)](
        mask, old, rollout, old if seq is None else seq, old if iw is None else iw, w, metrics,
        mask.numel(), seq_width,
        LOW=low, HIGH=high if finite else 0.0, HAS_HIGH=finite, BOUND=bound, CORRECT=correct,
        SEQUENCE=seq is not None, HAS_IW=iw is not None, BLOCK=ROWS_BLOCK,
        num_warps=ROWS_WARPS,
    )
    return w, metrics


ROLLOUT_WEIGHTS = KernelOp(rollout_weights, fake=lambda mask, *_: (
    mask.new_empty(mask.shape, dtype=torch.float32), mask.new_empty(3, dtype=torch.float32)))
