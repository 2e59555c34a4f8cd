"""Float64 reference of ``ratio_kl``: the per-token importance ratio and KL penalty.

The formulas are :mod:`ratiokl.spec.reference`'s (``ratio = exp(logp - old_logp)``, ``kl``
one of :data:`ratiokl.spec.KL_ESTIMATORS` on ``d = logp_ref - logp``, the gradient through
``logp`` only); inactive rows give ``ratio = 1``, ``kl = 0`` and a zero gradient.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ratiokl.spec.kl import kl_dlogp, kl_value
from ratiokl.spec.reference import ArrayLike, selected_logprobs, selected_logprobs_grad

__all__ = ["ratio_kl", "ratio_kl_grad"]


def _ref_logps(ref_logits, ref_logps, action_ids, mask, temperature):
    if ref_logps is not None:
        return np.where(mask, np.asarray(ref_logps, dtype=np.float64), 0.0)
    if ref_logits is None:
        raise ValueError("pass either `ref_logits` or `ref_logps`")
    return selected_logprobs(ref_logits, action_ids, mask, temperature=temperature)


def ratio_kl(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: np.ndarray, *, ref_logps: Optional[np.ndarray] = None,
    kl_estimator: str = "k3", temperature: ArrayLike = 1.0,
) -> Tuple[np.ndarray, np.ndarray]:
    """Per-token importance ratio and KL penalty, float64 ``[...]`` each.

    ``ratio = exp(logp - old_logp)``; ``kl`` by ``kl_estimator`` on
    ``d = logp_ref - logp``. Inactive rows: ``ratio = 1``, ``kl = 0``.
    """
    mask = np.asarray(mask, dtype=bool)
    logp = selected_logprobs(policy_logits, action_ids, mask, temperature=temperature)
    logp_ref = _ref_logps(ref_logits, ref_logps, action_ids, mask, temperature)
    old = np.where(mask, np.asarray(old_logps, dtype=np.float64), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        ratio = np.exp(logp - old)
        kl = kl_value(logp_ref - logp, kl_estimator)
    return np.where(mask, ratio, 1.0), np.where(mask, kl, 0.0)


def ratio_kl_grad(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: np.ndarray, grad_ratio: np.ndarray, grad_kl: np.ndarray, *,
    ref_logps: Optional[np.ndarray] = None, kl_estimator: str = "k3", temperature: ArrayLike = 1.0,
) -> np.ndarray:
    """Gradient of ``sum(grad_ratio * ratio + grad_kl * kl)`` w.r.t. ``policy_logits``.

    The per-row coefficient is ``c = grad_ratio * ratio + grad_kl * dkl/dlogp``
    and the result is :func:`selected_logprobs_grad` with ``grad_logp = c``.
    Nothing flows to ``ref_logits``, ``ref_logps`` or ``old_logps``.
    """
    mask = np.asarray(mask, dtype=bool)
    ratio, _ = ratio_kl(
        policy_logits, ref_logits, action_ids, mask, old_logps,
        ref_logps=ref_logps, kl_estimator=kl_estimator, temperature=temperature,
    )
    logp = selected_logprobs(policy_logits, action_ids, mask, temperature=temperature)
    logp_ref = _ref_logps(ref_logits, ref_logps, action_ids, mask, temperature)
    g_ratio = np.where(mask, np.asarray(grad_ratio, dtype=np.float64), 0.0)
    g_kl = np.where(mask, np.asarray(grad_kl, dtype=np.float64), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        coef = g_ratio * ratio + g_kl * kl_dlogp(logp_ref - logp, kl_estimator)
    return selected_logprobs_grad(
        policy_logits, action_ids, mask, np.where(mask, coef, 0.0), temperature=temperature
    )
