"""Providers: the implementations measured side by side.

A provider builds, for one operation and one value of ratiokl's
``check_ids`` (``Provider.check_ids``: the library default under user
timing, False under device timing; None for peers without the option), a
forward callable on the case's inputs; ``_measure`` turns it into the timed
modes (forward, forward + backward). Torch providers build a ``TorchOp`` on
the torch inputs (a zero-argument forward and the leaves the gradient
reaches); JAX providers build a pure function ``f(policy, rest)`` that
``_measure`` jits (and differentiates with ``jax.vjp``). Either forward
returns ``(diff, aux)``: ``diff`` is what the gradient flows from (a tensor,
a tuple of tensors, or a scalar loss) and ``aux`` anything else the op returns.

Peers are written as trainers write them: upcast to fp32, ``log_softmax``,
``gather`` (``torch-eager``), and ``torch.compile`` of exactly that
(``torch-compile``). Liger-Kernel lives in ``_liger``, the lm_head step's
builders (its ratiokl and Liger losses, the bare GEMMs) in ``_lmhead``, the log-prob seam's
(TRL's, verl's and cut-cross-entropy's fused heads, ratiokl's two routes) in ``_seam``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

import _liger
import _lmhead
import _seam
from _cases import (
    CLIP_EPS,
    CISPO_OP,
    ENTROPY_COEF,
    ENTROPY_OP,
    FWD,
    HIDDEN_OPS,
    KL_COEF,
    LINEAR_LOGP,
    LMHEAD,
    LOGP_ENTROPY_OP,
    ROLLOUT_OPS,
    USER,
    TorchOp,
    uses_ref_logits,
)

__all__ = ["PROVIDERS", "Provider", "eager_op", "ratiokl_op"]

#: Input kinds: logits in (every op but the hidden-state ones), hidden states in (``HIDDEN_OPS``).
LOGITS, HIDDEN = "logits", "hidden"


@dataclass(frozen=True)
class Provider:
    """One implementation: how to build an op, and where it cannot run.

    ``user_check_ids``: the ``check_ids`` its user timing passes to ratiokl (the
    library default, True; False for a CUDA graph, whose capture cannot
    synchronise), None for peers without the option. ``graphed``: timed as a
    CUDA-graph replay of the call. ``inputs``: the input kinds it takes.
    """

    name: str
    framework: str  # "torch" | "jax"
    # torch: (op, inputs, check_ids) -> TorchOp; jax: (op, check_ids) -> f(policy, rest)
    build: Callable[..., Any]
    unavailable: Callable[[], Optional[str]]  # reason it cannot run here, or None
    unsupported: Callable[[str, str], Optional[str]] = lambda op, mode: None
    user_check_ids: Optional[bool] = None
    graphed: bool = False
    inputs: Tuple[str, ...] = (LOGITS,)

    def check_ids(self, timing: str) -> Optional[bool]:
        """ratiokl's ``check_ids`` under ``timing`` (False under device timing; None: no option)."""
        if self.user_check_ids is None:
            return None
        return self.user_check_ids if timing == USER else False

    def why_not(self, op: str, mode: str) -> Optional[str]:
        """Why this provider does not run ``op`` in ``mode`` (None: it does)."""
        kind = HIDDEN if op in HIDDEN_OPS else LOGITS
        if kind not in self.inputs:
            return f"{self.name} does not take {kind} inputs"
        return self.unsupported(op, mode)


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


def ratiokl_op(loss: Any, op: str, a: Mapping[str, Any], backend: str, check_ids: bool,
               inplace_grad: bool = False) -> Any:
    """Call ``loss.<op>`` (torch or JAX module: same API) on the named inputs ``a``.

    ``check_ids=True``: the library's default (the keyword is not passed: what a
    user's call does); False: no host check of the ids (valid by construction),
    as a compiled/graph caller runs it. ``inplace_grad``: the policy loss's
    opt-in in-place gradient.
    """
    kw: Dict[str, Any] = {"backend": backend}
    if not check_ids:
        kw["check_ids"] = False
    p, ids, mask, old = a["policy"], a["ids"], a["mask"], a["old_logps"]
    if op == "selected_logprobs":
        return loss.selected_logprobs(p, ids, mask, **kw), ()
    if op == LOGP_ENTROPY_OP:  # (logp, entropy): both differentiated, like ratio_kl's pair
        return loss.selected_logprobs(p, ids, mask, return_entropy=True, **kw), ()
    ref, ref_lp = (a["ref"], None) if uses_ref_logits(op) else (None, a["ref_logps"])
    if op.startswith("ratio_kl"):
        return loss.ratio_kl(p, ref, ids, mask, old, ref_logps=ref_lp, **kw), ()
    if op in ROLLOUT_OPS:  # the engine's log-probs and a correction, beside the default
        kw.update(rollout_logps=a["rollout_logps"], rollout_correction=ROLLOUT_OPS[op])
    if op == ENTROPY_OP:
        kw["entropy_coef"] = ENTROPY_COEF
    if op == CISPO_OP:
        kw["objective"] = "cispo"
    return loss.policy_loss(
        p, ref, ids, mask, old, a["advantages"], ref_logps=ref_lp,
        clip_eps=CLIP_EPS, kl_coef=KL_COEF, inplace_grad=inplace_grad, **kw,
    )


def _ratiokl_torch(backend: str) -> Callable[[str, Any, bool], TorchOp]:
    def build(op: str, x: Any, check_ids: bool) -> TorchOp:
        from ratiokl.torch import loss

        a = vars(x)
        if op == LINEAR_LOGP:  # one GEMM, then the log-probs and entropy on [N, V] logits
            return _seam.ratiokl_materialised(x, backend, check_ids)
        if op == LMHEAD:  # the policy loss (reference log-probs given) on hidden @ W.T
            return _lmhead.step(x, lambda logits: ratiokl_op(
                loss, "policy_loss_ref_logps", {**a, "policy": logits}, backend, check_ids))
        return TorchOp(lambda: ratiokl_op(loss, op, a, backend, check_ids), x.policy)

    return build


def _ratiokl_torch_linear(backend: str) -> Callable[[str, Any, bool], TorchOp]:
    """The hidden-state ops in row chunks (their default size): the lm_head step through
    ``linear_policy_loss`` (the ``policy_loss_ref_logps`` call's loss from the hidden states
    and ``W``), the seam through ``linear_selected_logprobs``."""
    def build(op: str, x: Any, check_ids: bool) -> TorchOp:
        from ratiokl.torch import loss

        if op == LINEAR_LOGP:
            return _seam.ratiokl_linear(x, backend, check_ids)
        kw = {"backend": backend, **({} if check_ids else {"check_ids": False})}
        return _lmhead.linear_step(x, lambda hidden, weight: loss.linear_policy_loss(
            hidden, weight, x.ids, x.mask, x.old_logps, x.advantages, ref_logps=x.ref_logps,
            clip_eps=CLIP_EPS, kl_coef=KL_COEF, **kw))

    return build


def _ratiokl_jax_linear(op: str, check_ids: bool) -> Callable[..., Any]:
    """The hidden-state ops of ``ratiokl.jax.loss`` on ``(hidden, W)`` (``_measure`` jits and
    differentiates with respect to both), as :func:`_ratiokl_torch_linear`."""
    from ratiokl.jax import loss

    kw = {} if check_ids else {"check_ids": False}

    def f(hw: Any, r: Dict[str, Any]) -> Any:
        hidden, weight = hw
        b = r["ids"].shape[0]
        hidden = hidden.reshape(b, -1, hidden.shape[-1])
        if op == LINEAR_LOGP:
            return loss.linear_selected_logprobs(hidden, weight, r["ids"], r["mask"],
                                                 return_entropy=True, **kw), ()
        return loss.linear_policy_loss(hidden, weight, r["ids"], r["mask"], r["old_logps"],
                                       r["advantages"], ref_logps=r["ref_logps"],
                                       clip_eps=CLIP_EPS, kl_coef=KL_COEF, **kw)

    return f


def _ratiokl_torch_compiled(op: str, x: Any, check_ids: bool) -> TorchOp:
    """``torch.compile(fullgraph=True)`` of the same call (``check_ids=False``: the check
    cannot compile); the tensors are arguments of the compiled function, as in a step."""
    from ratiokl.torch import loss

    def call(a: Dict[str, Any]) -> Any:
        return ratiokl_op(loss, op, a, "triton", check_ids)

    compiled = torch.compile(call, fullgraph=True)
    a = vars(x)
    return TorchOp(lambda: compiled(a), x.policy)


def _ratiokl_torch_inplace(op: str, x: Any, check_ids: bool) -> TorchOp:
    """The fused policy loss writing its gradient into the logits (its own copy of them:
    every run overwrites them with a gradient, which no other provider should read)."""
    from ratiokl.torch import loss

    a = {**vars(x), "policy": x.policy.detach().clone().requires_grad_()}
    return TorchOp(lambda: ratiokl_op(loss, op, a, "triton", check_ids, inplace_grad=True),
                   a["policy"])


def _policy_loss_only(op: str, mode: str) -> Optional[str]:
    if op.startswith("policy_loss"):
        return None
    return "the in-place gradient is a policy-loss option"


def _ratiokl_jax(backend: str) -> Callable[[str, bool], Callable[..., Any]]:
    def build(op: str, check_ids: bool) -> Callable[..., Any]:
        from ratiokl.jax import loss

        return lambda policy, rest: ratiokl_op(loss, op, {**rest, "policy": policy}, backend,
                                               check_ids)

    return build


def _eager_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                 entropy: bool = False) -> Any:
    """The trainer's per-token log-prob: fp32 upcast, log_softmax, gather, mask; with
    ``entropy``, also ``-sum p log p`` of the same log_softmax (``(logp, entropy)``)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    logp = torch.where(mask, log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1), 0.0)
    if not entropy:
        return logp
    return logp, torch.where(mask, -(log_p.exp() * log_p).sum(-1), 0.0)


def eager_op(op: str, p: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor,
             mask: torch.Tensor, old: torch.Tensor, ref_lp: torch.Tensor,
             adv: torch.Tensor) -> Any:
    """The eager PyTorch reference of ``op`` (T = 1, k3 KL, token-mean loss; the entropy
    bonus for ``ENTROPY_OP``).

    Shapes: logits ``p``, ``ref`` ``[B, T, V]``; ``ids``, ``mask``, ``old``,
    ``ref_lp`` ``[B, T]``; ``adv`` ``[B]``. Returns ``(diff, aux)`` as the
    ratiokl providers do; inactive rows give ``logp = 0``, ``ratio = 1``,
    ``kl = 0`` (their forward values only: like trainers' code, it computes
    them and masks afterwards).
    """
    ent = None
    if op in (ENTROPY_OP, LOGP_ENTROPY_OP):
        logp, ent = _eager_logps(p, ids, mask, entropy=True)
    else:
        logp = _eager_logps(p, ids, mask)
    if op == "selected_logprobs":
        return logp, ()
    if op == LOGP_ENTROPY_OP:
        return (logp, ent), ()
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
    if op == CISPO_OP:  # the clipped ratio, detached, weighs the log-prob
        per_token = -clipped.detach() * a * logp + KL_COEF * kl
    else:
        per_token = torch.maximum(-a * ratio, -a * clipped) + KL_COEF * kl
    if ent is not None:
        per_token = per_token - ENTROPY_COEF * ent
    active = mask.float()
    count = active.sum().clamp(min=1.0)
    loss = (per_token * active).sum() / count
    metrics = {
        "clip_fraction": ((ratio != clipped).float() * active).sum().detach() / count,
        "ratio_mean": (ratio * active).sum().detach() / count,
        "kl_mean": (kl * active).sum().detach() / count,
    }
    return loss, metrics


def _eager(compile_it: bool) -> Callable[[str, Any, Optional[bool]], TorchOp]:
    def build(op: str, x: Any, check_ids: Optional[bool]) -> TorchOp:
        fn = eager_op
        if compile_it:
            fn = torch.compile(eager_op, fullgraph=True, dynamic=False)
        args = (x.policy, x.ref, x.ids, x.mask, x.old_logps, x.ref_logps, x.advantages)
        return TorchOp(lambda: fn(op, *args), x.policy)

    return build


def _liger_unsupported(op: str, mode: str) -> Optional[str]:
    if op in (ENTROPY_OP, LOGP_ENTROPY_OP, LINEAR_LOGP):
        return "Liger's GRPO loss has no entropy bonus"
    if op == CISPO_OP:
        return "Liger's GRPO loss has no CISPO objective"
    if op.startswith("policy_loss") or op == LMHEAD or mode == FWD:
        return None
    return "Liger has no differentiable equivalent (forward-only comparison)"


def _gemm_only(op: str, x: Any, check_ids: Optional[bool]) -> TorchOp:
    return _lmhead.gemm_only(x, x.seam_grad_logits if op == LINEAR_LOGP else x.grad_logits)


def _peer_seam_only(op: str, mode: str) -> Optional[str]:
    return None if op == LINEAR_LOGP else "a trainer's fused log-prob head (the seam only)"


def _torch_triton() -> Optional[str]:
    return _needs_cuda() or _missing_module("ratiokl.torch.loss")


PROVIDERS: Dict[str, Provider] = {
    p.name: p
    for p in (
        Provider("ratiokl-torch-triton", "torch", _ratiokl_torch("triton"), _torch_triton,
                 user_check_ids=True, inputs=(LOGITS, HIDDEN)),
        # The lm_head step from hidden states in row chunks (no [N, V] logits).
        Provider("ratiokl-torch-triton-linear", "torch", _ratiokl_torch_linear("triton"),
                 _torch_triton, user_check_ids=True, inputs=(HIDDEN,)),
        Provider("ratiokl-torch-native-linear", "torch", _ratiokl_torch_linear("native"),
                 lambda: _missing_module("ratiokl.torch.loss"), user_check_ids=True,
                 inputs=(HIDDEN,)),
        Provider("ratiokl-jax-triton-linear", "jax", _ratiokl_jax_linear,
                 lambda: _needs_jax_gpu() or _missing_module("ratiokl.jax.loss"),
                 user_check_ids=True, inputs=(HIDDEN,)),
        Provider("ratiokl-torch-triton-inplace", "torch", _ratiokl_torch_inplace,
                 _torch_triton, _policy_loss_only, user_check_ids=True),
        # The same call with check_ids=False under both timings: what the default id
        # check costs (PERF.md: <= 3 %) and the eager side of the torch.compile target.
        Provider("ratiokl-torch-triton-unchecked", "torch", _ratiokl_torch("triton"),
                 _torch_triton, user_check_ids=False),
        # torch.compile(fullgraph=True) of that call (PERF.md: <= 1.05x the eager call).
        Provider("ratiokl-torch-triton-compiled", "torch", _ratiokl_torch_compiled,
                 _torch_triton, user_check_ids=False),
        # The same call as ratiokl-torch-triton (check_ids=False), captured once as a CUDA
        # graph and replayed: the op without the host's per-call work.
        Provider("ratiokl-torch-triton-graph", "torch", _ratiokl_torch("triton"),
                 _torch_triton, user_check_ids=False, graphed=True),
        Provider("ratiokl-jax-triton", "jax", _ratiokl_jax("triton"),
                 lambda: _needs_jax_gpu() or _missing_module("ratiokl.jax.loss"),
                 user_check_ids=True),
        Provider("ratiokl-torch-native", "torch", _ratiokl_torch("native"),
                 lambda: _missing_module("ratiokl.torch.loss"), user_check_ids=True,
                 inputs=(LOGITS, HIDDEN)),
        Provider("ratiokl-jax-native", "jax", _ratiokl_jax("native"),
                 lambda: _missing_module("ratiokl.jax.loss"), user_check_ids=True),
        Provider("torch-eager", "torch", _eager(False), lambda: None),
        Provider("torch-compile", "torch", _eager(True), lambda: None),
        Provider("liger", "torch", _liger.build,
                 lambda: _needs_cuda() or _missing_module("liger_kernel.ops.grpo_loss"),
                 _liger_unsupported, inputs=(LOGITS, HIDDEN)),
        Provider("gemm-only", "torch", _gemm_only, lambda: None, inputs=(HIDDEN,)),
        Provider("trl-chunked", "torch", _seam.trl_chunked,
                 lambda: _needs_cuda() or _missing_module("trl.kernels"), _peer_seam_only,
                 inputs=(HIDDEN,)),
        Provider("verl-fused", "torch", _seam.verl_fused,
                 lambda: _needs_cuda() or _missing_module("verl.utils.kernel.kernels"),
                 _peer_seam_only, inputs=(HIDDEN,)),
        Provider("cce", "torch", _seam.cce,
                 lambda: _needs_cuda() or _missing_module("cut_cross_entropy"),
                 _peer_seam_only, inputs=(HIDDEN,)),
    )
}
