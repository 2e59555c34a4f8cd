"""The policy losses backpropagate once per call, on every backend.

The one-kernel ``policy_loss`` (Triton backends) and ``linear_policy_loss`` compute their
gradients in the forward and scale them in place in the backward: one ``[N, V]`` (or
``d hidden`` / ``d weight``) gradient in the policy's dtype at the peak, and a second
backward would find it already scaled and handed to autograd. So that the same training
code behaves the same on every backend, a second backward through the same loss (the
graph kept by ``retain_graph=True``) raises :func:`second_backward_error` on every path,
before anything is read or written: the one-kernel backwards check a flag on their own
context, and the two-pass route (native, GSPO, vocabulary-parallel) and the native
``linear_policy_loss`` wrap the loss in :class:`_BackwardOnce`, an identity whose backward
sets the same flag (a Python attribute: no host sync, and ``torch.compile`` traces it).

Under ``torch.compile`` the compiled region's backward is AOTAutograd's: the flag is read
once, while tracing, so a second backward of a compiled loss is the compiler's (the
traced route writes a fresh gradient in each backward, so it accumulates).

``selected_logprobs`` and ``ratio_kl`` recompute their gradient from the saved logits in
each backward (nothing in place): they backpropagate any number of times on every backend.
"""

from __future__ import annotations

import torch

__all__ = ["backward_once", "second_backward_error", "spend"]


def second_backward_error(op: str) -> RuntimeError:
    """The error of a second backward through ``op``'s loss (``op``: the public call)."""
    return RuntimeError(
        f"{op} backpropagates once per call: this is a second backward through the same "
        "loss (its graph kept by `retain_graph=True`). On the Triton backends the gradient "
        "is computed in the forward and scaled in place by the first backward, so every "
        f"backend refuses a second one. Call {op} again (a new forward) for another "
        "backward, or sum the losses and call backward once"
    )


def spend(ctx, op: str) -> None:
    """Mark ``ctx``'s backward as run; raise :func:`second_backward_error` if it already was.

    Call it first in a backward, before the saved state is read or written.
    """
    if getattr(ctx, "ratiokl_spent", False):
        raise second_backward_error(op)
    ctx.ratiokl_spent = True


class _BackwardOnce(torch.autograd.Function):
    """``loss`` unchanged (a copy of the 0-d value, so the caller may modify it in place);
    its backward passes the gradient through once, then raises. ``setup_context`` and a
    generated ``vmap`` rule: ``torch.func`` transforms it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(loss, op):
        return loss.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.op = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        spend(ctx, ctx.op)
        return grad, None


def backward_once(loss: torch.Tensor, op: str) -> torch.Tensor:
    """``loss`` guarded by :class:`_BackwardOnce` where it has a gradient, else itself."""
    return _BackwardOnce.apply(loss, op) if loss.requires_grad else loss
