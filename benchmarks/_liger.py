"""Liger-Kernel's Triton GRPO loss as a peer, used only where it computes the same thing.

Liger (``liger_kernel.ops.grpo_loss``) takes logits ``[B, T + 1, V]`` (the
last position is ignored), ids and mask ``[B, T]``, one advantage per
sequence, and optional precomputed reference log-probs. The like-for-like
pairs with ratiokl:

- ``selected_logprobs`` forward: ``fused_selective_log_softmax`` (no autograd);
- ``ratio_kl_ref_logps`` forward: ``GrpoLossFunction`` forward (computes the
  ratio and the k3 KL of every token, then the loss);
- ``ratio_kl`` forward: ``fused_selective_log_softmax`` on the reference
  logits, then ``GrpoLossFunction`` forward (two kernels);
- ``policy_loss_ref_logps`` / ``policy_loss``: ``GrpoLossFunction`` (after
  the reference log-probs as above), forward and backward, token-mean loss,
  ``beta = KL_COEF``, ``eps_low = eps_high = CLIP_EPS``, ``inplace=False``
  (a fresh gradient tensor, like ratiokl's default);
- ``lmhead-step``: the same loss on ``hidden @ W.T``, Liger's own hidden states
  holding ``T + 1`` positions per sequence (``_lmhead``), as a trainer computes them.

The same arguments are used under both timings (Liger has no option that
the timings tell apart).

Liger is imported lazily; where it is missing, the provider is recorded as
skipped with the import error.
"""

from __future__ import annotations

import inspect
from typing import Any, List, Optional, Tuple

import torch

import _lmhead
from _cases import CLIP_EPS, KL_COEF, LMHEAD, TorchOp, uses_ref_logits

__all__ = ["build", "grpo_loss"]


def _padded(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, T, V]`` -> a contiguous ``[B, T + 1, V]`` copy (Liger's layout)."""
    b, t, v = tensor.shape
    out = torch.zeros(b, t + 1, v, dtype=tensor.dtype, device=tensor.device)
    out[:, :t].copy_(tensor.detach())
    return out


def _grpo_args(grpo: Any, logits, old, ref_lp, ids, adv, mask) -> List[Any]:
    """Positional arguments of ``GrpoLossFunction.apply`` for this Liger version.

    Every version starts with the same eleven; later ones add ``loss_type``
    (``"bnpo"`` is the token mean over all active tokens).
    """
    args = [logits, old, ref_lp, ids, adv, mask, 1.0, KL_COEF, CLIP_EPS, CLIP_EPS, False]
    if "loss_type" in inspect.signature(grpo.forward).parameters:
        args.append("bnpo")
    return args


def _token_mean(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Older Liger returns per-token losses; newer ones the reduced scalar."""
    if loss.dim() == 0:
        return loss
    active = mask.float()
    return (loss * active).sum() / active.sum().clamp(min=1.0)


def grpo_loss(logits: torch.Tensor, x: Any,
              ref_lp: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Any]:
    """Liger's GRPO loss on ``[B, T + 1, V]`` logits with the per-token inputs of ``x``
    (reference log-probs ``ref_lp``, default ``x.ref_logps``): ``(token-mean loss, the
    rest of its outputs)``."""
    from liger_kernel.ops.grpo_loss import GrpoLossFunction

    mask = x.mask.contiguous()
    ref_lp = x.ref_logps if ref_lp is None else ref_lp
    args = _grpo_args(GrpoLossFunction, logits, x.old_logps, ref_lp, x.ids.contiguous(),
                      x.advantages, mask)
    out = GrpoLossFunction.apply(*args)
    return _token_mean(out[0], mask), out[1:]


def build(op: str, x: Any, check_ids: Optional[bool] = None) -> TorchOp:
    """``op`` on the torch inputs ``x``; the gradient reaches Liger's padded copy of the policy
    (the lm_head step: Liger's hidden states and ``W``). ``check_ids``: unused (no such option)."""
    if op == LMHEAD:
        return _lmhead.liger_step(x, grpo_loss)
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    logits = _padded(x.policy).requires_grad_(True)
    ids, mask = x.ids.contiguous(), x.mask.contiguous()
    ref_logits = _padded(x.ref) if uses_ref_logits(op) else None

    if op == "selected_logprobs":
        return TorchOp(lambda: (fused_selective_log_softmax(logits, ids, 1.0, mask), ()), logits)

    def forward() -> Any:
        ref_lp = None
        if ref_logits is not None:
            ref_lp = fused_selective_log_softmax(ref_logits, ids, 1.0, mask)
        return grpo_loss(logits, x, ref_lp)

    return TorchOp(forward, logits)
