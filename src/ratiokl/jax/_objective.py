"""The route of ``ratiokl.jax.loss.policy_objective``: the policy loss on the trainer's own
per-token log-probs.

Validate (shapes, dtypes and Python scalars only: it works on tracers), lay the tokens out
as ``[R, T]`` rows, fold in the rollout correction, then the framework-neutral objective of
``ratiokl._core.objective`` on JAX's array adapter, which the two-pass ``policy_loss`` runs
too: ``jnp`` ops, no kernel and no backend. JAX's autodiff differentiates the result
through ``logps`` and (with an entropy bonus) ``entropy``; ``jit``, ``grad``, ``vmap`` and
``shard_map`` apply as to any ``jnp`` function.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._core import objective as _core
from ratiokl._core.route import as_rows
from ratiokl.jax import _checks, _rollout
from ratiokl.jax._arrays import XP
from ratiokl.spec import (check_loss_normalizer, check_term_normalizer, policy_loss_options,
                          rollout_options)

__all__ = ["policy_objective"]


def _values(name: str, values: Any, lead: Tuple[int, ...]) -> jax.Array:
    """A floating per-token array of ``lead`` as float32 ``[R, T]`` (differentiable)."""
    values = _checks.check_row_values(name, values, lead)
    return as_rows(values.astype(jnp.float32), lead)


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
                     log_ratio_bound) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``ratiokl.jax.loss.policy_objective`` (documented there)."""
    opts = policy_loss_options(
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
        ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
        ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
        entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
        kl_clamp=kl_clamp,
    )
    lead = tuple(getattr(logps, "shape", ()))  # not an array: check_row_values names it
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
    ref = None if ref_logps is None else lax.stop_gradient(_values("ref_logps", ref_logps, lead))
    ent = None if entropy is None else _values("entropy", entropy, lead)
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None)
    rollout_metrics: Dict[str, jax.Array] = {}
    if rollout is not None:
        inputs, rollout_metrics = _rollout.correct(mask.reshape(-1), lead, inputs,
                                                   rollout_logps, rollout, opts.log_ratio_bound)
    loss, metrics = _core.policy_objective(XP, logp, ref, as_rows(mask, lead), inputs,
                                           opts, ent)
    if opts.loss_agg == "none":
        loss = loss.reshape(lead)
    return loss, {**metrics, **rollout_metrics}
