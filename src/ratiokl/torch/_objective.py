"""The route of ``ratiokl.torch.loss.policy_objective``: the policy loss on the trainer's own
per-token log-probs.

Validate (shapes, dtypes and devices only: no host sync), lay the tokens out as ``[R, T]``
rows, fold in the rollout correction, then the framework-neutral objective of
``ratiokl._core.objective`` on PyTorch's array adapter, which the two-pass
``policy_loss`` runs too: ``[N]``-sized framework ops, no kernel and no backend. Autograd
differentiates the result through ``logps`` and (with an entropy bonus) ``entropy``.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from ratiokl._core import objective as _core
from ratiokl._core.route import as_rows
from ratiokl.spec import (check_loss_normalizer, check_term_normalizer, policy_loss_options,
                          rollout_options)
from ratiokl.torch import _checks, _rollout
from ratiokl.torch._arrays import XP

__all__ = ["policy_objective"]


def _values(name: str, values: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """A floating per-token tensor of ``lead`` as float32 ``[R, T]`` (differentiable)."""
    values = _checks.check_row_values(name, values, lead)
    return as_rows(values.float(), lead)


def _missing(name: str, coef: str) -> ValueError:
    return ValueError(
        f"`{coef}` != 0 needs `{name}` (per-token {name.replace('_', ' ')} of the leading "
        f"shape [...]); pass it, or {coef}=0.0"
    )


def policy_objective(logps, old_logps, advantages, mask, *, ref_logps, entropy, clip_eps,
                     clip_eps_high, dual_clip, ratio_cap, kl_coef, kl_estimator, loss_agg,
                     loss_normalizer, ratio_level, objective, entropy_coef, kl_agg,
                     entropy_agg, kl_entropy_normalizer, kl_clamp, segment_ids,
                     importance_weights, rollout_logps, rollout_correction, rollout_bounds,
                     log_ratio_bound) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``ratiokl.torch.loss.policy_objective`` (documented there)."""
    compiling = torch.compiler.is_compiling()
    opts = policy_loss_options(
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
        ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
        ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
        entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
        kl_clamp=kl_clamp, cached=not compiling,
    )
    lead = tuple(getattr(logps, "shape", ()))  # not a tensor: check_row_values names it
    logp = _values("logps", logps, lead)
    mask = _checks.check_mask(mask, lead)
    if ref_logps is None and opts.uses_kl:
        raise _missing("ref_logps", "kl_coef")
    if entropy is None and opts.uses_entropy:
        raise _missing("entropy", "entropy_coef")
    check_loss_normalizer(loss_agg, loss_normalizer)
    check_term_normalizer(opts, kl_entropy_normalizer)
    inputs = _checks.token_inputs(lead, old_logps, advantages, segment_ids,
                                  importance_weights, loss_normalizer,
                                  kl_entropy_normalizer)
    _checks.check_same_device(
        logps=logps, mask=mask, old_logps=old_logps, advantages=advantages,
        ref_logps=ref_logps, entropy=entropy, segment_ids=segment_ids,
        importance_weights=importance_weights)
    ref = None if ref_logps is None else _values("ref_logps", ref_logps, lead).detach()
    ent = None if entropy is None else _values("entropy", entropy, lead)
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None, cached=not compiling)
    rollout_metrics: Dict[str, torch.Tensor] = {}
    if rollout is not None:
        inputs, rollout_metrics = _rollout.correct(mask.reshape(-1), lead, inputs,
                                                   rollout_logps, rollout, opts.log_ratio_bound)
    loss, metrics = _core.policy_objective(XP, logp, ref, as_rows(mask, lead), inputs,
                                           opts, ent)
    if opts.loss_agg == "none":
        loss = loss.reshape(lead)
    return loss, {**metrics, **rollout_metrics}
