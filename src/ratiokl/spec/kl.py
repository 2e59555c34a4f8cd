r"""The KL estimators on :math:`d = \log p_\mathrm{ref} - \log p`: one table.

Schulman's three estimators of :math:`\mathrm{KL}(\pi \,\|\, \pi_\mathrm{ref})` and their
derivatives with respect to :math:`\log p` (:math:`\partial d / \partial \log p = -1`):

.. math::

    \mathrm{k1} = -d, \quad 1; \qquad
    \mathrm{k2} = d^2 / 2, \quad -d; \qquad
    \mathrm{k3} = e^{d} - d - 1, \quad 1 - e^{d}

(k3 is evaluated as ``expm1(d) - d``; in ``policy_loss`` at :math:`d` clipped to
``log_ratio_bound``, its derivative 0 beyond the bound). ``policy_loss``'s variants
(:data:`KL_VARIANTS`) take the value of one estimator and the gradient of another, and
may weigh it by the importance ratio :math:`r` (differentiated through both:
:math:`\partial (r\,\mathrm{k3}) = \partial r\, \mathrm{k3} + r\, \partial\mathrm{k3}`).

:func:`estimator_value` / :func:`estimator_dlogp` are written once for any array
namespace with ``expm1`` and ``ones_like`` (NumPy in the float64 spec, the frameworks'
adapters in ``ratiokl._core.objective``, whose autodiff takes the derivative); the
kernels (``ratiokl._kernels.numerics.kl_and_dkl``, ``ratiokl._kernels.objective``) branch
on the same codes (``ratiokl._codes.KL``).
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np

from ratiokl._codes import KL
from ratiokl.spec.options import kl_estimator_code

__all__ = ["KLVariant", "KL_VARIANTS", "estimator_dlogp", "estimator_value", "kl_dlogp",
           "kl_value", "policy_kl_terms"]


def estimator_value(xp, d, code: int):
    """k1 ``-d``, k2 ``d^2/2`` or k3 ``expm1(d) - d`` (``code``: ``KL.K1`` .. ``KL.K3``)."""
    if code == KL.K1:
        return -d
    if code == KL.K2:
        return 0.5 * d * d
    return xp.expm1(d) - d


def estimator_dlogp(xp, d, code: int):
    """``d estimator_value / d logp``: k1 ``1``, k2 ``-d``, k3 ``-expm1(d)``."""
    if code == KL.K1:
        return xp.ones_like(d)
    if code == KL.K2:
        return -d
    return -xp.expm1(d)


class KLVariant(NamedTuple):
    """A ``policy_loss`` KL variant: the estimator giving its value, the one giving its
    gradient (another one: straight-through, the value detached) and whether the importance
    ratio multiplies it."""

    value: KL
    gradient: KL
    ratio_weighted: bool = False

    @property
    def straight_through(self) -> bool:
        """Whether the value is detached and the gradient another estimator's."""
        return self.value != self.gradient


#: ``POLICY_KL_ESTIMATORS``' codes -> their :class:`KLVariant`: ``k1+`` / ``k3+`` the value
#: of k1 / k3 with the gradient of k2 (verl), ``k3-is`` ``r * k3`` (TRL/Liger
#: ``use_bias_correction_kl``, DeepSeek-V3.2).
KL_VARIANTS: Mapping[int, KLVariant] = {
    KL.K1: KLVariant(KL.K1, KL.K1),
    KL.K2: KLVariant(KL.K2, KL.K2),
    KL.K3: KLVariant(KL.K3, KL.K3),
    KL.K1_PLUS: KLVariant(KL.K1, KL.K2),
    KL.K3_PLUS: KLVariant(KL.K3, KL.K2),
    KL.K3_IS: KLVariant(KL.K3, KL.K3, ratio_weighted=True),
}


def kl_value(d: np.ndarray, kl_estimator: str) -> np.ndarray:
    """KL estimator of ``d = logp_ref - logp``: k1 ``-d``, k2 ``d^2/2``, k3 ``exp(d) - d - 1``
    (``ratiokl.spec.estimator_value``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return estimator_value(np, d, kl_estimator_code(kl_estimator))


def kl_dlogp(d: np.ndarray, kl_estimator: str) -> np.ndarray:
    """Derivative of the KL estimator with respect to ``logp`` (``dd/dlogp = -1``;
    ``ratiokl.spec.estimator_dlogp``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return estimator_dlogp(np, d, kl_estimator_code(kl_estimator))


def policy_kl_terms(d, kind: int, r, dr, bound, clamp=None):
    """Float64 value and derivative w.r.t. ``logp`` of the variant ``kind``
    (:data:`KL_VARIANTS`) on ``d`` ``[...]``; ``r`` / ``dr`` the ratio and its derivative
    (read by ``k3-is``), ``bound`` ``log_ratio_bound`` (None: none).

    ``clamp`` (``kl_clamp``): the value clipped to ``[-c, c]``; the gradient is 0 where the
    value lies beyond (at ``|value| = c`` it is kept, as ``torch.clamp``'s), except for the
    straight-through ``k1+`` / ``k3+``, whose k2 gradient the detached value never touches.
    """
    value, grad = _kl_unclamped(d, kind, r, dr, bound)
    if clamp is None:
        return value, grad
    straight = KL_VARIANTS[kind].straight_through
    beyond = np.abs(value) > clamp  # a NaN value is not beyond: its gradient stays NaN
    return np.clip(value, -clamp, clamp), np.where(beyond & ~straight, 0.0, grad)


def _kl_unclamped(d, kind: int, r, dr, bound):
    """The variant's value and gradient before ``kl_clamp``;
    k3 reads ``d`` clipped to the bound and has no gradient beyond it."""
    variant = KL_VARIANTS[kind]
    # A NaN d is not beyond the bound: its gradient stays NaN (never a silent 0).
    inside = np.ones_like(d, dtype=bool) if bound is None else ~(np.abs(d) > bound)
    d_b = d if bound is None else np.clip(d, -bound, bound)
    value = estimator_value(np, d_b if variant.value == KL.K3 else d, variant.value)
    grad = estimator_dlogp(np, d, variant.gradient)
    if variant.gradient == KL.K3:
        grad = np.where(inside, grad, 0.0)
    if variant.ratio_weighted:
        value, grad = r * value, dr * value + r * grad
    return value, grad
