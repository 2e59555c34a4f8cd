"""The route of ``policy_objective`` (both frameworks): the policy loss on the trainer's
own per-token log-probs, written once.

Validate (shapes, dtypes and, in PyTorch, devices; no host sync), lay the tokens out as
``[R, T]`` rows, fold in the rollout correction, then :func:`ratiokl._core.objective.
policy_objective` on the framework's array adapter ``xp``, which the two-pass
``policy_loss`` runs too: ``[N]``-sized framework ops, no kernel and no backend. The
framework's autodiff differentiates the result through ``logps`` and (with an entropy
bonus) ``entropy``. The compute dtype follows ``logps``: float64 log-probs are computed in
float64 (``xp.for_dtype``), every other input cast to it; otherwise float32.

``checks`` is the framework's ``_checks`` module (``check_row_values``, ``check_mask``);
``xp`` also offers ``same_device(**arrays)`` (PyTorch: one device; JAX: nothing to
check).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from ratiokl._core import objective as _objective
from ratiokl._core.rollout import parity as rollout_parity
from ratiokl._core.route import loss_inputs, rollout_step, with_rollout
from ratiokl._core.sequences import as_rows
from ratiokl.spec import PolicyLossOptions, rollout_options

__all__ = ["policy_objective"]


def _values(xp, checks, name: str, values: Any, lead: Tuple[int, ...]):
    """A floating per-token array of ``lead`` as ``[R, T]`` in ``xp``'s compute dtype
    (differentiable)."""
    return as_rows(xp.as_float(checks.check_row_values(name, values, lead)), lead)


def _missing(name: str, coef: str) -> ValueError:
    return ValueError(
        f"`{coef}` != 0 needs `{name}` (per-token {name.replace('_', ' ')} of the leading "
        f"shape [...]); pass it, or {coef}=0.0"
    )


def policy_objective(xp, checks, opts: PolicyLossOptions, logps, old_logps, advantages, mask,
                     *, ref_logps, entropy, loss_normalizer, kl_entropy_normalizer,
                     segment_ids, importance_weights, rollout_logps, rollout_correction,
                     rollout_bounds) -> Tuple[Any, Dict[str, Any]]:
    """``ratiokl.<framework>.loss.policy_objective`` (documented there), its options in
    ``opts``."""
    lead = tuple(getattr(logps, "shape", ()))  # not an array: check_row_values names it
    logps = checks.check_row_values("logps", logps, lead)
    xp = xp.for_dtype(logps.dtype)  # float64 log-probs: float64 math, float64 results
    logp = as_rows(xp.as_float(logps), lead)
    if ref_logps is None and opts.uses_kl:
        raise _missing("ref_logps", "kl_coef")
    if entropy is None and opts.uses_entropy:
        raise _missing("entropy", "entropy_coef")
    ref = None if ref_logps is None else xp.stop_gradient(
        _values(xp, checks, "ref_logps", ref_logps, lead))
    ent = None if entropy is None else _values(xp, checks, "entropy", entropy, lead)
    mask = (xp.ones_like(logp) > 0 if mask is None  # None: every row active
            else checks.check_mask(mask, lead))
    inputs = loss_inputs(xp, opts, lead, old_logps, advantages, segment_ids,
                         importance_weights, loss_normalizer, kl_entropy_normalizer,
                         rollout_logps)
    xp.same_device(logps=logps, mask=mask, old_logps=old_logps, advantages=advantages,
                   ref_logps=ref_logps, entropy=entropy, segment_ids=segment_ids,
                   importance_weights=importance_weights, rollout_logps=rollout_logps)
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None,
                              cached=not xp.compiling())
    rollout_metrics: Dict[str, Any] = {}
    parity = None
    if rollout is not None:
        inputs, rollout_metrics = rollout_step(xp, mask.reshape(-1), lead, inputs, rollout,
                                               opts.log_ratio_bound)
        parity = rollout_parity(xp, as_rows(mask, lead), logp, inputs.rollout_logps)
    loss, metrics = _objective.policy_objective(xp, logp, ref, as_rows(mask, lead), inputs,
                                                opts, ent)
    if opts.loss_agg == "none":
        loss = loss.reshape(lead)
    return loss, with_rollout(metrics, rollout_metrics, parity)
