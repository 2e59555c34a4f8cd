"""Providers: the implementations measured side by side.

A provider builds, for one operation, a forward callable on the case's
inputs; ``_measure`` turns it into the timed modes (forward, forward +
backward). Torch providers build a ``TorchOp`` on the torch inputs (a
zero-argument forward and the leaf the gradient reaches); JAX providers
build a pure function ``f(policy, rest)`` that ``_measure`` jits (and
differentiates with ``jax.vjp``). Either forward returns ``(diff, aux)``: ``diff`` is what the gradient flows from (a tensor, a tuple
of tensors, or a scalar loss) and ``aux`` anything else the op returns.

Peers are written as trainers write them: upcast to fp32, ``log_softmax``,
``gather`` (``torch-eager``), and ``torch.compile`` of exactly that
(``torch-compile``). Liger-Kernel lives in ``_liger``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import torch

import _liger
from _cases import CLIP_EPS, FWD, KL_COEF, TorchOp, uses_ref_logits

__all__ = ["PROVIDERS", "Provider", "eager_op", "ratiokl_op"]


@dataclass(frozen=True)
class Provider:
    """One implementation: how to build an op, and where it cannot run."""

    name: str
    framework: str  # "torch" | "jax"
    build: Callable[..., Any]  # torch: (op, inputs) -> TorchOp; jax: (op) -> f(policy, rest)
    unavailable: Callable[[], Optional[str]]  # reason it cannot run here, or None
    unsupported: Callable[[str, str], Optional[str]] = lambda op, mode: None


def _missing_module(name: str) -> Optional[str]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason
        return f"cannot import {name}: {type(exc).__name__}: {exc}"
    return None


def _needs_cuda() -> Optional[str]:
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


def _needs_jax_gpu() -> Optional[str]:
    reason = _missing_module("jax_triton")
    if reason:
        return reason
    import jax

    return None if jax.default_backend() == "gpu" else "needs a JAX GPU backend"


def ratiokl_op(loss: Any, op: str, a: Mapping[str, Any], backend: str,
               inplace_grad: bool = False) -> Any:
    """Call ``loss.<op>`` (torch or JAX module: same API) on the named inputs ``a``.

    ``check_ids=False``: the inputs' ids are valid by construction, and the
    host check is one synchronisation that a compiled/graph caller skips too.
    ``inplace_grad``: the policy loss's opt-in in-place gradient.
    """
    kw: Dict[str, Any] = {"backend": backend, "check_ids": False}
    p, ids, mask, old = a["policy"], a["ids"], a["mask"], a["old_logps"]
    if op == "selected_logprobs":
        return loss.selected_logprobs(p, ids, mask, **kw), ()
    ref, ref_lp = (a["ref"], None) if uses_ref_logits(op) else (None, a["ref_logps"])
    if op.startswith("ratio_kl"):
        return loss.ratio_kl(p, ref, ids, mask, old, ref_logps=ref_lp, **kw), ()
    return loss.policy_loss(
        p, ref, ids, mask, old, a["advantages"], ref_logps=ref_lp,
        clip_eps=CLIP_EPS, kl_coef=KL_COEF, inplace_grad=inplace_grad, **kw,
    )


def _ratiokl_torch(backend: str) -> Callable[[str, Any], TorchOp]:
    def build(op: str, x: Any) -> TorchOp:
        from ratiokl.torch import loss

        a = vars(x)
        return TorchOp(lambda: ratiokl_op(loss, op, a, backend), x.policy)

    return build


def _ratiokl_torch_inplace(op: str, x: Any) -> TorchOp:
    """The fused policy loss writing its gradient into the logits (its own copy of them:
    every run overwrites them with a gradient, which no other provider should read)."""
    from ratiokl.torch import loss

    a = {**vars(x), "policy": x.policy.detach().clone().requires_grad_()}
    return TorchOp(lambda: ratiokl_op(loss, op, a, "triton", inplace_grad=True), a["policy"])


def _policy_loss_only(op: str, mode: str) -> Optional[str]:
    if op.startswith("policy_loss"):
        return None
    return "the in-place gradient is a policy-loss option"


def _ratiokl_jax(backend: str) -> Callable[[str], Callable[..., Any]]:
    def build(op: str) -> Callable[..., Any]:
        from ratiokl.jax import loss

        return lambda policy, rest: ratiokl_op(loss, op, {**rest, "policy": policy}, backend)

    return build


def _eager_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The trainer's per-token log-prob: fp32 upcast, log_softmax, gather, mask."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, logp, 0.0)


def eager_op(op: str, p: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor,
             mask: torch.Tensor, old: torch.Tensor, ref_lp: torch.Tensor,
             adv: torch.Tensor) -> Any:
    """The eager PyTorch reference of ``op`` (T = 1, k3 KL, token-mean loss).

    Shapes: logits ``p``, ``ref`` ``[B, T, V]``; ``ids``, ``mask``, ``old``,
    ``ref_lp`` ``[B, T]``; ``adv`` ``[B]``. Returns ``(diff, aux)`` as the
    ratiokl providers do; inactive rows give ``logp = 0``, ``ratio = 1``,
    ``kl = 0`` (their forward values only: like trainers' code, it computes
    them and masks afterwards).
    """
    logp = _eager_logps(p, ids, mask)
    if op == "selected_logprobs":
        return logp, ()
    if uses_ref_logits(op):
        with torch.no_grad():
            ref_lp = _eager_logps(ref, ids, mask)
    ratio = torch.where(mask, torch.exp(logp - old), 1.0)
    d = ref_lp - logp
    kl = torch.where(mask, torch.exp(d) - d - 1.0, 0.0)
    if op.startswith("ratio_kl"):
        return (ratio, kl), ()
    a = adv.unsqueeze(-1)
    clipped = torch.clamp(ratio, 1.0 - CLIP_EPS, 1.0 + CLIP_EPS)
    per_token = torch.maximum(-a * ratio, -a * clipped) + KL_COEF * kl
    active = mask.float()
    count = active.sum().clamp(min=1.0)
    loss = (per_token * active).sum() / count
    metrics = {
        "clip_fraction": ((ratio != clipped).float() * active).sum().detach() / count,
        "ratio_mean": (ratio * active).sum().detach() / count,
        "kl_mean": (kl * active).sum().detach() / count,
    }
    return loss, metrics


def _eager(compile_it: bool) -> Callable[[str, Any], TorchOp]:
    def build(op: str, x: Any) -> TorchOp:
        fn = eager_op
        if compile_it:
            fn = torch.compile(eager_op, fullgraph=True, dynamic=False)
        args = (x.policy, x.ref, x.ids, x.mask, x.old_logps, x.ref_logps, x.advantages)
        return TorchOp(lambda: fn(op, *args), x.policy)

    return build


def _liger_unsupported(op: str, mode: str) -> Optional[str]:
    if op.startswith("policy_loss") or mode == FWD:
        return None
    return "Liger has no differentiable equivalent (forward-only comparison)"


PROVIDERS: Dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("ratiokl-torch-triton", "torch", _ratiokl_torch("triton"),
                 lambda: _needs_cuda() or _missing_module("ratiokl.torch.loss")),
        Provider("ratiokl-torch-triton-inplace", "torch", _ratiokl_torch_inplace,
                 lambda: _needs_cuda() or _missing_module("ratiokl.torch.loss"),
                 _policy_loss_only),
        Provider("ratiokl-jax-triton", "jax", _ratiokl_jax("triton"),
                 lambda: _needs_jax_gpu() or _missing_module("ratiokl.jax.loss")),
        Provider("ratiokl-torch-native", "torch", _ratiokl_torch("native"),
                 lambda: _missing_module("ratiokl.torch.loss")),
        Provider("ratiokl-jax-native", "jax", _ratiokl_jax("native"),
                 lambda: _missing_module("ratiokl.jax.loss")),
        Provider("torch-eager", "torch", _eager(False), lambda: None),
        Provider("torch-compile", "torch", _eager(True), lambda: None),
        Provider("liger", "torch", _liger.build,
                 lambda: _needs_cuda() or _missing_module("liger_kernel.ops.grpo_loss"),
                 _liger_unsupported),
    )
}
