"""JAX's routes of ``linear_selected_logprobs`` and ``linear_policy_loss`` (from hidden
states): ``ratiokl.jax._route``'s steps with the weight's ``V`` as the ids' range, the
lm_head's shape rules and logit options from ``ratiokl.spec.linear``, then the tail of
``ratiokl._core.route`` (``linear_loss_step``) shared with PyTorch."""

from __future__ import annotations

from typing import Dict, Tuple

import jax

from ratiokl._core import route as _tail
from ratiokl.jax import _checks
from ratiokl.jax._arrays import XP
from ratiokl.jax._route import _rows
from ratiokl.spec import (
    LogitTransform,
    PolicyLossOptions,
    check_chunk_rows,
    check_head_shapes,
    logit_transform,
    rollout_options,
)

__all__ = ["linear_policy_loss", "linear_selected_logprobs"]


def _head(hidden, weight, bias, action_ids):
    """Check ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]`` (one dtype), then the
    ids: ``(hidden, weight, bias, ids, lead)`` as arrays."""
    hidden = _checks.check_logits("hidden", hidden)
    weight = _checks.check_logits("weight", weight)
    bias = None if bias is None else _checks.check_logits("bias", bias)
    lead = check_head_shapes(
        tuple(hidden.shape), str(hidden.dtype), tuple(weight.shape), str(weight.dtype),
        None if bias is None else tuple(bias.shape), None if bias is None else str(bias.dtype))
    return hidden, weight, bias, _checks.check_ids(action_ids, lead), lead


def linear_selected_logprobs(hidden, weight, action_ids, mask, *, bias, temperature,
                             logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                             grad_weight_accum, return_entropy, chunk_rows, backend, check_ids,
                             vocab_axis):
    """``ratiokl.jax.loss.linear_selected_logprobs`` (documented there)."""
    chunk_rows = check_chunk_rows(chunk_rows)
    transform = logit_transform(logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                                grad_weight_accum)
    hidden, weight, bias, ids, lead = _head(hidden, weight, bias, action_ids)
    rows = _rows(hidden, lead, ids, mask, temperature, backend, check_ids, vocab_axis,
                 vocab=weight.shape[0])
    return _tail.linear_logprobs_step(rows, weight, bias, transform, chunk_rows,
                                      return_entropy)


def linear_policy_loss(hidden, weight, action_ids, mask, old_logps, advantages,
                       chunk_rows: int, transform: LogitTransform, opts: PolicyLossOptions, *,
                       ref_logps, bias, loss_normalizer, kl_entropy_normalizer, segment_ids,
                       importance_weights, temperature, backend, check_ids, rollout_logps,
                       rollout_correction, rollout_bounds,
                       vocab_axis) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``ratiokl.jax.loss.linear_policy_loss`` (documented there): ``chunk_rows`` checked,
    the logit ``transform`` and the options ``opts`` built by the caller."""
    hidden, weight, bias, ids, lead = _head(hidden, weight, bias, action_ids)
    if ref_logps is not None or opts.uses_kl:
        _, ref_logps = _checks.check_ref(None, ref_logps, hidden.shape)
    inputs = _tail.loss_inputs(XP, opts, lead, old_logps, advantages, segment_ids,
                               importance_weights, loss_normalizer, kl_entropy_normalizer,
                               rollout_logps)
    rows = _rows(hidden, lead, ids, mask, temperature, backend, check_ids, vocab_axis,
                 vocab=weight.shape[0])
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None)
    return _tail.linear_loss_step(XP, rows, weight, bias, transform, chunk_rows, ref_logps,
                                  inputs, opts, rollout, vocab_axis is not None)
