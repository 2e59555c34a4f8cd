"""The rollout correction in PyTorch: ``ratiokl.spec.rollout``'s weight, folded into the
importance weights of every ``policy_loss`` path.

The weight depends on per-token values only (``old_logps``, ``rollout_logps``, the
mask, the sequences), never on the logits, so :func:`correct` computes it once per
call and hands ``w * importance_weights`` to the fused kernel, the two-pass objective
and the vocabulary-sharded route as their ``importance_weights``: no big kernel
changes, and the weight multiplies the policy term only, as ``importance_weights``
does. A Triton backend computes the weights and the metrics in one launch
(``Backend.rollout_weights``); the others use the framework ops below (the same
formulas). The sequence-level log-weight is a row sum, or with ``segment_ids`` the
objective's segmented sum (``_objective.sequence_totals``).

Inactive tokens are selected out before any arithmetic (a NaN ``rollout_logps`` there
reaches nothing); everything here is detached and never synchronises with the host.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ratiokl._backend import Backend
from ratiokl.spec import ROLLOUT_METRIC_NAMES, RolloutOptions
from ratiokl.torch import _objective
from ratiokl.torch._checks import TokenInputs, as_rows, check_row_values, check_same_device

__all__ = ["correct"]

Metrics = Dict[str, torch.Tensor]


def correct(run: Backend, mask: torch.Tensor, lead: Tuple[int, ...], inputs: TokenInputs,
            rollout_logps: torch.Tensor, opts: RolloutOptions,
            log_ratio_bound: Optional[float]) -> Tuple[TokenInputs, Metrics]:
    """``inputs`` with the rollout weight folded into ``importance_weights``, and the
    rollout metrics.

    ``mask``: the flattened bool ``[N]`` mask; ``lead``: the leading shape ``[...]``;
    ``opts``: ``spec.rollout_options`` of the call (the route calls this only where that
    is not None, i.e. where ``rollout_logps`` is given).
    """
    rollout = check_row_values("rollout_logps", rollout_logps, lead)
    check_same_device(mask=mask, rollout_logps=rollout)
    rollout = as_rows(rollout.detach().float(), lead)
    rows = as_rows(mask, lead)
    seq = _sequence_log_weights(rows, inputs, rollout) if opts.sequence else None
    if run.rollout_weights is not None:
        flat = lambda x: None if x is None else x.reshape(-1).contiguous()  # noqa: E731
        weights, metrics = run.rollout_weights(
            mask, flat(inputs.old_logps), flat(rollout), seq, flat(inputs.importance_weights),
            opts, log_ratio_bound)
        weights = as_rows(weights, lead)
    else:
        weights, metrics = _weights(rows, inputs, rollout, seq, opts, log_ratio_bound)
    if opts.corrects:
        inputs = dataclasses.replace(inputs, importance_weights=weights)
    return inputs, metrics


def _clip(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    """``clip(x, -bound, bound)`` (None: no bound); a NaN stays NaN (detached values)."""
    return x if bound is None else x.clamp(-bound, bound)


def _sequence_log_weights(mask: torch.Tensor, inputs: TokenInputs,
                          rollout: torch.Tensor) -> torch.Tensor:
    """The sum of ``old - rollout`` over each token's sequence: ``[R, 1]`` (one sequence a
    row) or, with ``segment_ids``, ``[R, T]``."""
    lw = torch.where(mask, inputs.old_logps - rollout, 0.0)
    if inputs.segment_ids is None:
        return lw.sum(dim=-1, keepdim=True)
    return _objective.sequence_totals(lw, mask, inputs.segment_ids)


def _weights(mask: torch.Tensor, inputs: TokenInputs, rollout: torch.Tensor,
             seq: Optional[torch.Tensor], opts: RolloutOptions,
             bound: Optional[float]) -> Tuple[torch.Tensor, Metrics]:
    """``where(mask, w * iw, 0)`` ``[R, T]`` and the metrics, in framework ops."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    lw_tok = torch.where(mask, inputs.old_logps - rollout, zero)
    e = torch.exp(_clip(lw_tok if seq is None else seq, bound))
    outside = torch.zeros((), dtype=torch.bool, device=mask.device)
    w = torch.ones((), dtype=torch.float32, device=mask.device)
    if opts.masks:  # NaN is not outside: it stays NaN
        outside = (e < opts.low) | (e > opts.high)
        w = torch.where(outside, zero, e)
    elif opts.corrects:
        w = torch.where(e > opts.high, opts.high, e)
    w, outside = w.expand(mask.shape), outside.expand(mask.shape)
    d = _clip(lw_tok, bound)
    parts = torch.stack([w, outside.float(), torch.expm1(d) - d])
    sums = torch.where(mask, parts, zero).reshape(len(parts), -1).sum(dim=1)
    means = sums / mask.sum().clamp(min=1).float()
    iw = inputs.importance_weights
    weights = torch.where(mask, w if iw is None else w * iw, zero)
    return weights, dict(zip(ROLLOUT_METRIC_NAMES, means.unbind()))
