"""The ``"triton"`` (CUDA) and ``"interpret"`` (CPU) PyTorch backends, on flattened rows.

The functions ``ratiokl.torch._route`` calls with validated ``[N, V]`` logits
(any strides) and ``[N]`` per-row tensors; every one is a launch of
``ratiokl.torch._launch`` (which binds it for eager, compiled and
interpreted runs). The kernels poison an active row with an out-of-range id
or a bad temperature (NaN outputs and gradient), so nothing here depends on
the host check.

Memory: the forward of ``selected_logprobs`` / ``ratio_kl`` saves O(N)
(``lse``, ``ratio``, ``dkl``; the logits are referenced, not copied); the
fused ``policy_loss`` stores its ``[N, V]`` gradient in the forward when one
is wanted (the backward scales it in place, so the loss backpropagates once:
a second ``backward`` with ``retain_graph=True`` raises ``_once``'s error, as on
every backend) and reads each row once when none is; ``inplace_grad=True`` writes
the gradient into the logits' own buffer.
"""

from __future__ import annotations

import functools
import math
from typing import Dict, Optional, Tuple

import torch

from ratiokl._codes import KL
from ratiokl._core.route import uniform_weights
from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.spec import (ROLLOUT_METRIC_NAMES, ROLLOUT_PARITY_NAMES, PolicyLossOptions,
                          RolloutOptions)
from ratiokl.torch._launch import (
    BACKWARD,
    ENTROPY_FORWARD,
    FORWARD,
    POLICY_LOSS,
    ROLLOUT_WEIGHTS,
    SCALE_ROWS,
    SHARD_STATS,
    TOKEN_WEIGHTS,
    binding_for,
)
from ratiokl.torch._checks import Temperature
from ratiokl.torch._once import spend

__all__ = [
    "kernel_coefficients", "kernel_temperature", "policy_loss", "ratio_kl",
    "rollout_weights", "selected_logprobs", "shard_grad", "shard_lse", "token_weights",
]



@functools.lru_cache(maxsize=64)
def _constant(values: Tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A float32 tensor holding ``values``, made once per (values, device): read-only for
    the kernels; reusing it saves a host-to-device copy per call."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def kernel_temperature(temperature: Temperature, device: torch.device) -> torch.Tensor:
    """Temperature as float32 data the kernels read: ``[1]`` (one value, stride 0) or ``[N]``."""
    if isinstance(temperature, torch.Tensor):
        return temperature.detach().to(torch.float32)
    if torch.compiler.is_compiling():  # a traced graph makes its own constant
        return torch.full((1,), float(temperature), dtype=torch.float32, device=device)
    return _constant((float(temperature),), device)


def kernel_coefficients(opts: PolicyLossOptions, device: torch.device) -> torch.Tensor:
    """Float32 ``[5]``: ``(kl_coef, ratio floor, ratio ceiling, negative-advantage cap,
    entropy_coef)``.

    Run-time data of the fused kernel, so a new value (an adaptive KL
    controller, a clip schedule) is neither a compile nor, as a 0-d tensor, a
    host round trip. Python values come from a per-device cache.
    """
    values = (opts.kl_coef, opts.ratio_low, opts.ratio_high,
              math.inf if opts.neg_cap is None else opts.neg_cap, opts.entropy_coef)
    if not any(isinstance(v, torch.Tensor) for v in values):
        if torch.compiler.is_compiling():
            return torch.tensor(values, dtype=torch.float32, device=device)
        return _constant(tuple(float(v) for v in values), device)
    return torch.stack([
        v.detach().to(device=device, dtype=torch.float32) if isinstance(v, torch.Tensor)
        else torch.full((), float(v), dtype=torch.float32, device=device) for v in values
    ])


def selected_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                      temperature: Temperature) -> torch.Tensor:
    """Float32 ``logp[N]`` of ``logits[N, V]``: 0 on inactive rows, NaN on poisoned rows.

    Differentiable w.r.t. ``logits`` (gradient in its dtype).
    """
    temp = kernel_temperature(temperature, logits.device)
    return FORWARD(logits, None, ids, mask, None, None, temp, KL.NONE.value)[0]


def logprobs_entropy(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                     temperature: Temperature) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logp[N], entropy[N])`` from one read of ``logits[N, V]``: 0 on inactive rows,
    NaN on poisoned rows. Differentiable w.r.t. ``logits`` through both."""
    temp = kernel_temperature(temperature, logits.device)
    logp, ent, _ = ENTROPY_FORWARD(logits, ids, mask, temp)
    return logp, ent


def ratio_kl(policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor,
             mask: torch.Tensor, old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor],
             kl_code: int, temperature: Temperature) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(ratio[N], kl[N])``: ``(1, 0)`` on inactive rows, NaN on poisoned rows.

    Differentiable w.r.t. ``policy`` only; ``ref``, ``ref_logps`` and
    ``old_logps`` (float32) are read detached.
    """
    temp = kernel_temperature(temperature, policy.device)
    _, ratio, kl, _, _ = FORWARD(policy, ref, ids, mask, old_logps, ref_logps, temp, kl_code)
    return ratio, kl


def token_weights(mask: torch.Tensor, opts: PolicyLossOptions, normalizer: object,
                  width: int) -> Optional[torch.Tensor]:
    """:func:`ratiokl._core.route.uniform_weights` on ``mask [N]`` (documented there)."""
    return uniform_weights(
        opts, normalizer, width, lambda: TOKEN_WEIGHTS(mask),
        lambda denom: torch.where(mask.bool(), 1.0 / denom, 0.0).to(torch.float32))


def rollout_weights(mask: torch.Tensor, old: torch.Tensor, rollout: torch.Tensor,
                    seq: Optional[torch.Tensor], iw: Optional[torch.Tensor],
                    opts: RolloutOptions, bound: Optional[float],
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The rollout correction's ``w * iw`` (float32 ``[N]``, 0 on inactive rows) and its
    metrics, in one launch (``ratiokl.spec.rollout`` has the formulas).

    ``mask``, ``old``, ``rollout`` and ``iw`` (or None) are ``[N]`` (any strides: read
    contiguous); ``seq`` (sequence modes) the sequence log-weights, ``[R, 1]`` (one per
    row) or ``[R, T]`` (per token).
    """
    width = 1 if seq is None else mask.numel() // max(seq.numel(), 1)
    flat = lambda x: None if x is None else x.reshape(-1).contiguous()  # noqa: E731
    w, metrics = ROLLOUT_WEIGHTS(flat(mask), flat(old), flat(rollout), flat(seq), flat(iw),
                                 width, opts.masks, opts.corrects, opts.low, opts.high,
                                 bound or 0.0)
    return w, dict(zip(ROLLOUT_METRIC_NAMES, metrics.unbind()))


class _InplaceLoss(torch.autograd.Function):
    """The fused loss writing its gradient into the policy logits' own buffer (opt-in, eager).

    The forward overwrites ``policy`` with ``d loss / d policy`` and bumps its
    version, so another autograd node that saved the logits fails loudly in
    its backward instead of reading gradients; the backward scales that buffer
    by the upstream value and returns it: no ``[N, V]`` allocation. The other inputs
    come as one tuple, which autograd does not walk (host time per argument).
    """

    @staticmethod
    def forward(ctx, policy, inputs):
        loss, metrics, _ = POLICY_LOSS.direct(policy.device, policy, *inputs, grad_out=policy)
        torch.autograd.graph.increment_version(policy)
        ctx.grad = policy.detach()  # not saved_tensors: it holds the gradient now
        ctx.mask = inputs[2]
        ctx.mark_non_differentiable(metrics)
        ctx.set_materialize_grads(False)
        return loss, metrics

    @staticmethod
    def backward(ctx, g_loss, _g_metrics):
        spend(ctx, "policy_loss(inplace_grad=True)")  # the buffer is the caller's after one
        if g_loss is None:
            return None, None
        SCALE_ROWS.direct(ctx.grad.device, ctx.grad, g_loss.to(torch.float32), ctx.mask)
        grad, ctx.grad = ctx.grad, None  # once: the buffer is the caller's now
        return grad, None


def policy_loss(policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor,
                mask: torch.Tensor, old: Optional[torch.Tensor],
                ref_logps: Optional[torch.Tensor], adv: torch.Tensor,
                iw: Optional[torch.Tensor], weights: torch.Tensor, temperature: Temperature,
                opts: PolicyLossOptions, inplace_grad: bool, *, adv_rows: int = 1,
                rollout: Optional[torch.Tensor] = None,
                ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The fused ``(loss, metrics)`` of flattened rows: one kernel for the loss, the
    metrics' row values and the policy-logit gradient, one for the means.

    ``old``, ``iw`` (or None), ``ref_logps`` (or None) and the aggregation
    ``weights`` are float32 ``[N]``, detached; ``adv`` float32 ``[N // adv_rows]``
    (one advantage per ``adv_rows`` rows: per-sequence advantages reach the kernel as
    given); ``old`` None: on-policy; ``rollout`` (the engine's log-probs ``[N]``, or None)
    adds the parity fractions (``ROLLOUT_PARITY_NAMES``) to the metrics. ``loss_agg="none"`` (weights 1 on active rows): the
    loss is the rows' losses, float32 ``[N]``, and the backward scales each row's stored
    gradient by its own upstream value. The gradient is
    computed in the forward only when one is wanted (grad mode on, the logits
    require it); ``inplace_grad`` then writes it into ``policy``'s buffer
    (eager; ignored while compiling, where the compiler plans buffers).
    """
    has_ref = ref is not None or ref_logps is not None
    write_grad = torch.is_grad_enabled() and policy.requires_grad
    args = (ref, ids, mask, old, ref_logps, kernel_temperature(temperature, policy.device),
            adv, adv_rows, iw, weights, kernel_coefficients(opts, policy.device), write_grad,
            opts.kl_code if has_ref else KL.NONE.value, opts.neg_cap is not None,
            opts.log_ratio_bound or 0.0, opts.objective_code, opts.uses_entropy,
            opts.loss_agg == "none", rollout)
    if inplace_grad and write_grad and binding_for(policy.device) != "compiled":
        loss, metrics = _InplaceLoss.apply(policy, args)
    else:
        loss, metrics, _ = POLICY_LOSS(policy, *args)
    return loss, dict(zip(METRIC_NAMES + ROLLOUT_PARITY_NAMES, metrics.unbind()))


def shard_lse(policy: torch.Tensor, ref: Optional[torch.Tensor], mask: torch.Tensor,
              temp: torch.Tensor, entropy: bool = False
              ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """This shard's log-sum-exp of ``policy / T`` (and of ``ref / T``), float32 ``[N]``, and
    with ``entropy`` the mean ``mu`` of ``policy / T`` under the shard's softmax (else None).

    ``policy``/``ref``: ``[N, V_local]``, detached, any strides; ``temp`` from
    :func:`kernel_temperature`. Inactive rows are 0 and none of their logits is read.
    """
    lse, ref_lse, mu = SHARD_STATS(policy, ref, mask, temp, entropy)
    return lse, None if ref is None else ref_lse, mu if entropy else None


def shard_grad(logits: torch.Tensor, local_ids: torch.Tensor, mask: torch.Tensor,
               temp: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor,
               g_ent: Optional[torch.Tensor] = None,
               ent: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This shard's ``(coef * (onehot(local_ids) - p) - g_ent * p * (log p + ent)) / T``,
    ``[N, V_local]``, ``p = exp(z - lse)``.

    ``lse`` and ``ent`` (the entropy) are the global row values (float32 ``[N]``);
    ``local_ids`` are ``a - vocab_start`` (no one-hot where outside ``[0, V_local)``);
    ``coef`` and ``g_ent`` (None: no entropy term) float32 ``[N]``. Row-major, in the
    logits' dtype, exact 0 on inactive rows.
    """
    if g_ent is None:
        return BACKWARD(logits, local_ids, mask, temp, lse, coef, None, lse, None, lse)
    return BACKWARD(logits, local_ids, mask, temp, lse, coef, None, lse, g_ent, ent, True)
