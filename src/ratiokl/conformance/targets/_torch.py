"""What the trainer targets share: a case's inputs as float32 torch tensors ``[B, T]``, the
per-token log-probs (and entropies) from its logits through a trainer's own helpers, and the
loss's gradients back as NumPy.

Only the policy-loss ops run here (``policy_loss`` from logits, ``policy_objective`` from
log-probs); every trainer target refuses the rest with :func:`refusal`'s reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy as np

from ratiokl.conformance._protocol import TargetCall, TargetResult

__all__ = ["TokenBatch", "padded_arguments", "refusal", "result", "token_batch"]

#: The ops a trainer target maps: from logits, or from the trainer's own log-probs.
POLICY_OPS = ("policy_loss", "policy_objective")


def refusal(call: TargetCall, trainer: str) -> Optional[str]:
    """The reason ``trainer``'s loss cannot take ``call`` whatever its options, or None."""
    if call.op not in POLICY_OPS:
        return (f"{call.op}: {trainer}'s loss code has no separate {call.op}; its target "
                "runs the policy_loss and policy_objective cases")
    if call.expect_error is not None:
        return f"{trainer} does not validate action ids or temperatures"
    if np.ndim(call.arguments["mask"]) != 2:
        return f"{trainer} takes [batch, response_length] tensors"
    if call.option("loss_agg") == "none":
        return f"{trainer}'s policy loss always aggregates (loss_agg='none')"
    if np.ndim(call.option("temperature", 1.0)):
        return f"{trainer}'s temperature is one number (no per-row temperature)"
    if call.option("segment_ids") is not None:
        return f"{trainer}'s rows are sequences: no packed segment_ids"
    return None


@dataclass
class TokenBatch:
    """A case as a trainer's loss takes it: float32 ``[B, T]`` tensors (``mask`` bool),
    ``logps`` (and ``entropy`` when the case has or needs it) differentiable back to
    ``leaves`` (argument name -> the tensor whose gradient is compared)."""

    logps: Any
    entropy: Optional[Any]
    old_logps: Optional[Any]
    ref_logps: Optional[Any]
    advantages: Any
    mask: Any
    leaves: Dict[str, Any]
    importance_weights: Optional[Any] = None


#: The per-token inputs a trainer pads: zeros there unless ``nan_padding``.
_PADDED = ("policy_logits", "ref_logits", "logps", "entropy", "old_logps", "ref_logps",
           "advantages", "importance_weights")


def padded_arguments(call: TargetCall, nan_padding: bool) -> Dict[str, Any]:
    """``call``'s arguments with the padded (inactive) positions of the per-token inputs
    set to 0, as a trainer's own padding holds finite values; as they are (the fixtures'
    NaN / inf included) with ``nan_padding``."""
    args = dict(call.arguments)
    if nan_padding:
        return args
    mask = np.asarray(args["mask"], bool)
    for key in _PADDED:
        value = args.get(key)
        if isinstance(value, np.ndarray) and value.shape[:mask.ndim] == mask.shape:
            keep = mask.reshape(mask.shape + (1,) * (value.ndim - mask.ndim))
            args[key] = np.where(keep, value, np.zeros((), value.dtype))
    return args


def token_batch(call: TargetCall, logprobs: Callable[[Any, Any], Any],
                entropy: Callable[[Any], Any], *, need_entropy: bool,
                nan_padding: bool) -> TokenBatch:
    """``call``'s inputs as a :class:`TokenBatch`. From logits, ``logprobs(logits, ids)``
    and ``entropy(logits)`` are the trainer's own helpers, given float32 logits divided by
    the temperature (as the trainers' actors do). Padded positions: :func:`padded_arguments`
    (with ``nan_padding`` a trainer that lets their NaN reach its loss is reported), and
    their action ids set to 0, as a trainer's pad token would be."""
    import torch

    args = padded_arguments(call, nan_padding)
    mask = torch.as_tensor(args["mask"]).bool()
    as_float = lambda key: (None if args.get(key) is None  # noqa: E731
                            else torch.as_tensor(np.asarray(args[key], np.float32)))
    leaves: Dict[str, Any] = {}
    if call.op.startswith("policy_objective"):
        logps = leaves.setdefault("logps", as_float("logps").requires_grad_(True))
        ent = as_float("entropy")
        if ent is not None:
            ent = leaves.setdefault("entropy", ent.requires_grad_(True))
        ref = as_float("ref_logps")
    else:
        temperature = torch.as_tensor(np.asarray(args.get("temperature", 1.0), np.float32))
        temperature = temperature[..., None] if temperature.ndim else temperature
        # Padded positions hold a token id in range (a trainer's pad token), not the
        # fixtures' out-of-range ids; their logits stay as they are (NaN, inf).
        ids = torch.where(mask, torch.as_tensor(args["action_ids"]).long(), 0)
        dtype = getattr(torch, call.dtype)
        policy = torch.as_tensor(args["policy_logits"]).to(dtype).requires_grad_(True)
        leaves["policy_logits"] = policy
        z = policy.float() / temperature
        logps = logprobs(z, ids)
        ent = entropy(z) if need_entropy else None
        ref = as_float("ref_logps")
        if args.get("ref_logits") is not None:
            with torch.no_grad():
                ref_z = torch.as_tensor(args["ref_logits"]).to(dtype).float() / temperature
                ref = logprobs(ref_z, ids)
    advantages = np.asarray(args["advantages"], np.float32)
    if advantages.ndim == mask.ndim - 1:
        advantages = advantages[..., None]
    advantages = torch.as_tensor(np.broadcast_to(advantages, mask.shape).copy())
    return TokenBatch(logps, ent, as_float("old_logps"), ref, advantages, mask, leaves,
                      as_float("importance_weights"))


def result(call: TargetCall, batch: TokenBatch, loss: Any,
           outputs: Optional[Dict[str, Any]] = None) -> TargetResult:
    """The :class:`TargetResult` of a scalar ``loss``: its value, the gradients of
    ``cotangent * loss`` w.r.t. the batch's leaves (0 where the loss does not reach), and
    ``outputs`` (metrics with the case's names) as they are."""
    import torch

    names = [k for k in call.grads if k in batch.leaves]
    leaves = [batch.leaves[k] for k in names]
    cotangent = torch.as_tensor(np.asarray(call.cotangents["loss"], np.float32))
    grads = torch.autograd.grad(loss, leaves, cotangent, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    as_numpy = lambda t: np.asarray(t.detach().float().numpy())  # noqa: E731
    return TargetResult(
        outputs={"loss": as_numpy(loss), **{k: np.asarray(v) for k, v in (outputs or {}).items()}},
        grads={k: as_numpy(g) for k, g in zip(names, grads)})
