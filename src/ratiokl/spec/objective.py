"""Float64 reference of ``policy_objective``: the policy loss on given per-token log-probs.

The loss, the metrics and the gradients of ``ratiokl.spec.policy_loss`` (whose module
docstring has the formulas), for a caller that holds the log-probs ``logps [...]`` (and
the entropies ``entropy [...]``) instead of logits: ``policy_loss`` of some logits equals
``policy_objective`` of their ``selected_logprobs`` and ``entropy``, and its logit
gradient is ``d logp / d logits`` times :func:`policy_objective_grad`'s ``d logps`` (plus
``d H / d logits`` times ``d entropy``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ratiokl.spec.policy_loss import _scaled
from ratiokl.spec.policy_terms import policy_loss_terms
from ratiokl.spec.reference import ArrayLike

__all__ = ["policy_objective", "policy_objective_grad"]

#: ``policy_objective``'s array keywords besides ``ref_logps`` and ``entropy``.
_ARRAYS = ("loss_normalizer", "segment_ids", "importance_weights", "kl_entropy_normalizer")


def _terms(logps, old_logps, advantages, mask, ref_logps, entropy, options):
    arrays = {k: options.pop(k, None) for k in _ARRAYS}
    return policy_loss_terms(np.asarray(logps, np.float64), ref_logps, old_logps, advantages,
                             mask, entropy, **arrays, **options)


def policy_objective(
    logps: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike,
    mask: np.ndarray, *, ref_logps: Optional[np.ndarray] = None,
    entropy: Optional[np.ndarray] = None, **options,
) -> Tuple[object, Dict[str, float]]:
    """Float64 ``(loss, metrics)``: a float, or with ``loss_agg="none"`` the per-token loss
    ``[...]`` (0 on inactive tokens). ``options``: ``policy_loss``'s other keywords
    (``clip_eps`` ... ``rollout_bounds``); ``entropy_mean`` is reported when ``entropy``
    is given. Inactive tokens' inputs are never read."""
    loss, _, _, metrics = _terms(logps, old_logps, advantages, mask, ref_logps, entropy,
                                 dict(options))
    return loss, metrics


def policy_objective_grad(
    logps: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike,
    mask: np.ndarray, *, ref_logps: Optional[np.ndarray] = None,
    entropy: Optional[np.ndarray] = None, loss_cotangent: ArrayLike = 1.0, **options,
) -> Tuple[np.ndarray, np.ndarray]:
    """Float64 ``(d logps, d entropy)`` ``[...]`` of ``loss_cotangent * loss`` (a number, or
    ``[...]`` per token with ``loss_agg="none"``); 0 on inactive tokens, whatever the
    cotangent holds there."""
    _, dlogp, dent, _ = _terms(logps, old_logps, advantages, mask, ref_logps, entropy,
                               dict(options))
    return _scaled(dlogp, loss_cotangent, mask), _scaled(dent, loss_cotangent, mask)
