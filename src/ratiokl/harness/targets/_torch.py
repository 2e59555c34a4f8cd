"""What the trainer targets share: a case's inputs as float32 torch tensors, the per-token
log-probs (and entropies) from its logits through a trainer's own helpers, the per-token
outputs, and the gradients back as NumPy.

A trainer target runs the ops its trainer has code for: the policy loss (``policy_loss``
from logits, ``policy_objective`` from its own log-probs), the actor's per-token log-probs
and entropies (``selected_logprobs``, ``selected_logprobs_entropy``) and, where the trainer
has a KL function, ``ratio_kl``; :func:`refusal` names the reason for the rest.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np

from ratiokl.harness._protocol import TargetCall, TargetResult

__all__ = ["POLICY_OPS", "TOKEN_OPS", "TokenBatch", "TrainerTarget", "needs_entropy",
           "padded_arguments", "per_token_outputs", "refusal", "result", "token_batch"]

#: The policy-loss ops: from logits, or from the trainer's own log-probs.
POLICY_OPS = ("policy_loss", "policy_objective")
#: The per-token ops from logits (``ratio_kl`` only for a trainer with a KL function).
TOKEN_OPS = ("selected_logprobs", "selected_logprobs_entropy", "ratio_kl")
#: The trainers' clamp of the log-ratio before ``exp`` (verl, OpenRLHF).
LOG_RATIO_CLAMP = 20.0


def refusal(call: TargetCall, trainer: str, ops: Sequence[str]) -> Optional[str]:
    """The reason ``trainer``'s code cannot take ``call`` whatever its options, or None;
    ``ops``: the ops its target maps."""
    if call.op.endswith("_rollout"):
        return f"{trainer}'s rollout correction is not mapped by this target (rollout_logps)"
    if call.op not in ops:
        return (f"{call.op}: {trainer} has no code for it (its target runs "
                f"{', '.join(ops)})")
    if call.expect_error is not None:
        return f"{trainer} does not validate action ids or temperatures"
    if np.ndim(call.option("temperature", 1.0)):
        return f"{trainer}'s temperature is one number (no per-row temperature)"
    if call.op in TOKEN_OPS:
        return None
    if np.ndim(call.arguments["mask"]) != 2:
        return f"{trainer} takes [batch, response_length] tensors"
    if call.option("loss_agg") == "none":
        return f"{trainer}'s policy loss always aggregates (loss_agg='none')"
    if call.option("segment_ids") is not None:
        return f"{trainer}'s rows are sequences: no packed segment_ids"
    return None


class TrainerTarget:
    """A trainer's loss as a target: ``name`` is ``key`` (``"<key>-nan-padded"`` with
    ``nan_padding``: the fixtures' padded positions passed as they are, NaN / inf, instead
    of zeros, to list where the trainer lets them reach the loss). A subclass sets ``key``
    (also the ``ratiokl[...]`` extra), ``label``, ``module`` (the trainer's module that
    :meth:`load` imports, unless it overrides ``load``) and defines ``refusal(call)``."""

    key: str
    label: str
    module: str

    def __init__(self, nan_padding: bool = False) -> None:
        self.nan_padding = nan_padding
        self.name = f"{self.key}-nan-padded" if nan_padding else self.key

    def supports(self, call: TargetCall) -> Optional[str]:
        try:
            self.load()
        except ImportError as error:
            return f"{self.label} is not importable ({error}); pip install 'ratiokl[{self.key}]'"
        return self.refusal(call)

    def load(self) -> Any:
        return importlib.import_module(self.module)

    def refusal(self, call: TargetCall) -> Optional[str]:
        raise NotImplementedError


def needs_entropy(call: TargetCall) -> bool:
    """Whether a call needs the trainer's entropies (an entropy bonus, or the op's output)."""
    return float(call.option("entropy_coef", 0.0)) != 0.0 or call.op.endswith("_entropy")


@dataclass
class TokenBatch:
    """A case as a trainer's code takes it: float32 tensors of the case's leading shape
    (``mask`` bool), ``logps`` (and ``entropy`` when the case has or needs it)
    differentiable back to ``leaves`` (argument name -> the tensor whose gradient is
    compared); ``advantages`` broadcast to the leading shape, or None for a per-token op."""

    logps: Any
    entropy: Optional[Any]
    old_logps: Optional[Any]
    ref_logps: Optional[Any]
    advantages: Optional[Any]
    mask: Any
    leaves: Dict[str, Any]
    importance_weights: Optional[Any] = None


#: The per-token inputs a trainer pads: zeros there unless ``nan_padding``.
_PADDED = ("logits", "policy_logits", "ref_logits", "logps", "entropy", "old_logps",
           "ref_logps", "advantages", "importance_weights")


def padded_arguments(call: TargetCall, nan_padding: bool) -> Dict[str, Any]:
    """``call``'s arguments with the padded (inactive) positions of the per-token inputs
    set to 0, as a trainer's own padding holds finite values; as they are (the fixtures'
    NaN / inf included) with ``nan_padding`` or without a ``mask``."""
    args = dict(call.arguments)
    if nan_padding or args.get("mask") is None:
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
    (with ``nan_padding`` a trainer that lets their NaN through is reported), and their
    action ids set to 0, as a trainer's pad token would be."""
    import torch

    args = padded_arguments(call, nan_padding)
    as_float = lambda key: (None if args.get(key) is None  # noqa: E731
                            else torch.as_tensor(np.asarray(args[key], np.float32)))
    main = call.spec.differentiate
    lead = np.shape(args[main])[:None if call.spec.token_values else -1]
    mask = torch.as_tensor(np.ones(lead, bool) if args.get("mask") is None else args["mask"])
    leaves: Dict[str, Any] = {}
    if call.spec.token_values:  # policy_objective: the trainer's own log-probs
        logps = leaves.setdefault("logps", as_float("logps").requires_grad_(True))
        ent = as_float("entropy")
        if ent is not None:
            ent = leaves.setdefault("entropy", ent.requires_grad_(True))
        ref = as_float("ref_logps")
    else:
        temperature = float(args.get("temperature", 1.0))
        ids = torch.where(mask, torch.as_tensor(args["action_ids"]).long(), 0)
        leaves[main] = torch.as_tensor(args[main]).to(
            getattr(torch, call.dtype_of(main))).requires_grad_(True)
        z = leaves[main].float() / temperature
        logps = logprobs(z, ids)
        ent = entropy(z) if need_entropy else None
        ref = as_float("ref_logps")
        if args.get("ref_logits") is not None:
            with torch.no_grad():
                ref_dtype = getattr(torch, call.dtype_of("ref_logits"))
                ref = logprobs(torch.as_tensor(args["ref_logits"]).to(ref_dtype).float()
                               / temperature, ids)
    advantages = None
    if args.get("advantages") is not None:
        advantages = np.asarray(args["advantages"], np.float32)
        if advantages.ndim == mask.ndim - 1:
            advantages = advantages[..., None]
        advantages = torch.as_tensor(np.broadcast_to(advantages, tuple(mask.shape)).copy())
    return TokenBatch(logps, ent, as_float("old_logps"), ref, advantages, mask, leaves,
                      as_float("importance_weights"))


def per_token_outputs(call: TargetCall, batch: TokenBatch,
                      kl: Optional[Callable[[Any, Any, str], Any]] = None) -> Dict[str, Any]:
    """The outputs of a :data:`TOKEN_OPS` case, neutral on padded positions (ratio 1, the
    rest 0: the trainers' losses mask them there). ``ratio_kl``: the ratio
    ``exp(clamp(logp - old, +-20))`` as the trainers' policy losses compute it, and
    ``kl(logp, ref, kl_estimator)``, the trainer's own KL function."""
    import torch

    mask = batch.mask
    if call.op == "ratio_kl":
        log_ratio = (batch.logps - batch.old_logps).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        value = kl(batch.logps, batch.ref_logps, call.option("kl_estimator", "k3"))
        return {"ratio": torch.where(mask, log_ratio.exp(), 1.0),
                "kl": torch.where(mask, value, 0.0)}
    outputs = {"logp": torch.where(mask, batch.logps, 0.0)}
    if batch.entropy is not None:
        outputs["entropy"] = torch.where(mask, batch.entropy, 0.0)
    return outputs


def result(call: TargetCall, batch: TokenBatch, outputs: Dict[str, Any]) -> TargetResult:
    """The :class:`TargetResult` of ``outputs`` (tensors by the case's output names): their
    values, and the gradients of ``sum(output * cotangent)`` over the case's cotangents
    w.r.t. the batch's leaves (0 where nothing reaches)."""
    import torch

    names = [k for k in call.grads if k in batch.leaves]
    leaves = [batch.leaves[k] for k in names]
    differentiated = [o for o in call.cotangents if o in outputs]
    cotangents = [torch.as_tensor(np.asarray(call.cotangents[o], np.float32))
                  for o in differentiated]
    grads = torch.autograd.grad([outputs[o] for o in differentiated], leaves, cotangents,
                                allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    as_numpy = lambda t: np.asarray(t.detach().float().numpy())  # noqa: E731
    return TargetResult(outputs={k: as_numpy(v) for k, v in outputs.items()},
                        grads={k: as_numpy(g) for k, g in zip(names, grads)})
