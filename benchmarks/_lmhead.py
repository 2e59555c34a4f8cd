"""The in-situ lm_head step (op ``lmhead-step``): hidden states in, gradients of hidden and W out.

``logits = hidden @ W.T`` (``hidden [N, H]``, ``W [V, H]``, both requiring
grad) viewed ``[B, T, V]``, a policy loss on them, and the gradients of
``hidden`` and ``W`` (timed as ``fwd+bwd`` only). The logits are
materialised as a trainer materialises them; what the loss adds on top of
the three GEMMs is the comparison:

- ratiokl: ``ratiokl.torch.loss.policy_loss`` with reference log-probs given
  (the ``policy_loss_ref_logps`` call of the logits-in cases);
- Liger: ``GrpoLossFunction`` on ``[B, T + 1, V]`` logits from its own
  hidden states with ``T + 1`` positions per sequence (the layout it takes,
  as a trainer computes them; the extra position is ignored), the same ``W``;
- ``gemm-only``: the forward GEMM and, for a random gradient of the logits'
  shape and dtype, the two backward GEMMs (``dH = G @ W``, ``dW = G.T @ hidden``);
- ratiokl's chunked path, ``ratiokl.torch.loss.linear_policy_loss`` on ``hidden`` and
  ``W`` themselves (:func:`linear_step`): the same loss, the logits never all in memory.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from _cases import TorchOp

__all__ = ["gemm_only", "liger_step", "linear_step", "step"]

#: A loss on ``[B, T', V]`` logits: ``logits -> (loss, aux)``.
LossOf = Callable[[torch.Tensor], Any]


def step(x: Any, loss_of: LossOf, hidden: Optional[torch.Tensor] = None) -> TorchOp:
    """``loss_of(hidden @ W.T viewed [B, -1, V])``; the gradient reaches ``(hidden, W)``.

    ``x``: ``_inputs.StepInputs``; ``hidden``: the provider's own hidden states
    (default ``x.hidden``).
    """
    hidden = x.hidden if hidden is None else hidden
    batch, vocab = x.ids.shape[0], x.weight.shape[0]

    def forward() -> Any:
        return loss_of((hidden @ x.weight.T).view(batch, -1, vocab))

    return TorchOp(forward, (hidden, x.weight))


def liger_step(x: Any, grpo_loss: Callable[[torch.Tensor, Any], Any]) -> TorchOp:
    """:func:`step` for Liger: hidden states of ``T + 1`` positions per sequence (built here,
    outside the timed region; the first ``T`` are ``x.hidden``'s, the last random)."""
    b, t = x.ids.shape
    h = x.hidden.detach()
    extra = torch.randn(b, 1, h.shape[1], dtype=h.dtype, device=h.device)
    padded = torch.cat([h.view(b, t, -1), extra], dim=1).view(b * (t + 1), -1)
    return step(x, lambda logits: grpo_loss(logits, x), padded.requires_grad_(True))


def linear_step(x: Any, loss_of: Callable[[torch.Tensor, torch.Tensor], Any]) -> TorchOp:
    """``loss_of(hidden viewed [B, T, H], W)``: a loss that takes the hidden states and the
    lm_head weight itself; the gradient reaches ``(hidden, W)``."""
    batch = x.ids.shape[0]
    return TorchOp(lambda: loss_of(x.hidden.view(batch, -1, x.hidden.shape[-1]), x.weight),
                   (x.hidden, x.weight))


def gemm_only(x: Any, grad_logits: torch.Tensor) -> TorchOp:
    """The bare GEMMs: forward ``hidden @ W.T``; backward for the fixed gradient
    ``grad_logits`` ``[N, V]`` (the measured op's own: ``x.grad_logits`` for the loss,
    ``x.seam_grad_logits`` for the log-prob seam)."""
    return TorchOp(lambda: (x.hidden @ x.weight.T, ()), (x.hidden, x.weight), (grad_logits,))
