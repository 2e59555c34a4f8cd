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
  (a fresh gradient tensor, like ratiokl's default).

Liger is imported lazily; where it is missing, the provider is recorded as
skipped with the import error.
"""

from __future__ import annotations

import inspect
from typing import Any, List

import torch

from _cases import CLIP_EPS, KL_COEF, TorchOp, uses_ref_logits

__all__ = ["build"]


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


def build(op: str, x: Any) -> TorchOp:
    """``op`` on the torch inputs ``x``; the gradient reaches Liger's padded copy of the policy."""
    from liger_kernel.ops.grpo_loss import GrpoLossFunction, fused_selective_log_softmax

    logits = _padded(x.policy).requires_grad_(True)
    ids, mask = x.ids.contiguous(), x.mask.contiguous()
    ref_logits = _padded(x.ref) if uses_ref_logits(op) else None

    if op == "selected_logprobs":
        return TorchOp(lambda: (fused_selective_log_softmax(logits, ids, 1.0, mask), ()), logits)

    def ref_logps() -> torch.Tensor:
        if ref_logits is None:
            return x.ref_logps
        return fused_selective_log_softmax(ref_logits, ids, 1.0, mask)

    def forward() -> Any:
        args = _grpo_args(GrpoLossFunction, logits, x.old_logps, ref_logps(), ids,
                          x.advantages, mask)
        out = GrpoLossFunction.apply(*args)
        return _token_mean(out[0], mask), out[1:]

    return TorchOp(forward, logits)
