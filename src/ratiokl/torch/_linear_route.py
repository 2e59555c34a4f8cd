"""The routes of the two ops from hidden states: ``linear_selected_logprobs`` and
``linear_policy_loss``.

The steps are ``ratiokl.torch._route``'s (validate and flatten, queue the id check, run the
backend, read the check), with the lm_head's shape rules and logit options from
``ratiokl.spec.linear`` (written once for both frameworks).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ratiokl._core import route as _tail
from ratiokl.spec import (
    LogitTransform,
    PolicyLossOptions,
    check_chunk_rows,
    check_head_shapes,
    logit_transform,
    rollout_options,
)
from ratiokl.torch import _checks
from ratiokl.torch._arrays import XP
from ratiokl.torch._route import _rows, backend_name

__all__ = ["linear_policy_loss", "linear_selected_logprobs"]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _head(hidden, weight, bias, action_ids) -> Tuple[int, ...]:
    """Check ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]`` (one dtype), then the
    ids; the leading shape. First the call context (no ``torch.func`` transform)."""
    _checks.check_no_transforms()
    _checks.check_logits("hidden", hidden)
    _checks.check_logits("weight", weight)
    if bias is not None:
        _checks.check_logits("bias", bias)
    lead = check_head_shapes(
        tuple(hidden.shape), _dtype(hidden), tuple(weight.shape), _dtype(weight),
        None if bias is None else tuple(bias.shape), None if bias is None else _dtype(bias))
    _checks.check_ids(action_ids, lead)
    return lead


@torch.library.custom_op("ratiokl::compiled_refusal", mutates_args=())
def _refusal(hidden: torch.Tensor, message: str) -> torch.Tensor:
    """Raises ``ValueError(message)`` when the compiled graph runs. Opaque to the compiler,
    so the error is ratiokl's own with ``fullgraph=True`` or not (an exception raised while
    Dynamo traces reaches the caller as Dynamo's ``Unsupported``, or is retraced eagerly)."""
    raise ValueError(message)


@_refusal.register_fake
def _refusal_fake(hidden, message):
    return torch.empty_like(hidden)


_refusal.register_autograd(lambda ctx, grad: (grad, None))


def _eager_only(op: str, logits_op: str, hidden: torch.Tensor, backend: str,
                vocab_group) -> Tuple[torch.Tensor, str, object]:
    """``(hidden, backend, vocab_group)`` to trace. Under ``torch.compile``, what runs only
    eagerly (every Triton backend, ``"interpret"`` included, and ``vocab_group``) becomes a
    :func:`_refusal` of ``hidden``, which every output reads, followed by the native
    route's trace: a graph that raises the ``ValueError`` before computing anything.
    Checked before the rows are built (that queues the id check, a kernel launch)."""
    if not torch.compiler.is_compiling():
        return hidden, backend, vocab_group
    if vocab_group is None and backend_name(backend, hidden.device) == "native":
        return hidden, backend, vocab_group
    why = ("with `vocab_group` (its chunks make plain all-reduces)" if vocab_group is not None
           else "on the Triton backends (its row chunks launch the kernels one by one)")
    message = (f"{op} {why} runs eagerly; call it outside the torch.compile region, or "
               f"compile the logits and call {logits_op}")
    return _refusal(hidden, message), "native", None


def linear_selected_logprobs(hidden, weight, action_ids, mask, *, bias, temperature,
                             logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                             grad_weight_accum, return_entropy, chunk_rows, backend, check_ids,
                             vocab_group):
    """``ratiokl.torch.loss.linear_selected_logprobs`` (documented there)."""
    chunk_rows = check_chunk_rows(chunk_rows)
    transform = logit_transform(logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                                grad_weight_accum)
    lead = _head(hidden, weight, bias, action_ids)
    hidden, backend, vocab_group = _eager_only("linear_selected_logprobs",
                                               "selected_logprobs", hidden, backend, vocab_group)
    rows = _rows(hidden, lead, action_ids, mask, temperature, backend, check_ids, vocab_group,
                 vocab=weight.shape[0], weight=weight, bias=bias)
    return _tail.linear_logprobs_step(rows, weight, bias, transform, chunk_rows,
                                      return_entropy)


def linear_policy_loss(hidden, weight, action_ids, mask, old_logps, advantages,
                       chunk_rows: int, transform: LogitTransform, opts: PolicyLossOptions, *,
                       ref_logps, bias, loss_normalizer, kl_entropy_normalizer, segment_ids,
                       importance_weights, temperature, backend, check_ids, rollout_logps,
                       rollout_correction, rollout_bounds,
                       vocab_group) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``ratiokl.torch.loss.linear_policy_loss`` (documented there): ``chunk_rows`` checked,
    the logit ``transform`` and the options ``opts`` built by the caller."""
    lead = _head(hidden, weight, bias, action_ids)
    hidden, backend, vocab_group = _eager_only("linear_policy_loss", "policy_loss", hidden,
                                               backend, vocab_group)
    if ref_logps is not None or opts.uses_kl:
        _checks.check_ref(None, ref_logps, tuple(hidden.shape))
    inputs = _tail.loss_inputs(XP, opts, lead, old_logps, advantages, segment_ids,
                               importance_weights, loss_normalizer, kl_entropy_normalizer,
                               rollout_logps)
    rows = _rows(
        hidden, lead, action_ids, mask, temperature, backend, check_ids, vocab_group,
        vocab=weight.shape[0], weight=weight, bias=bias, old_logps=old_logps,
        ref_logps=ref_logps, advantages=advantages, segment_ids=segment_ids,
        importance_weights=importance_weights, rollout_logps=rollout_logps,
    )
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None,
                              cached=not torch.compiler.is_compiling())
    return _tail.linear_loss_step(XP, rows, weight, bias, transform, chunk_rows, ref_logps,
                                  inputs, opts, rollout, vocab_group is not None)
