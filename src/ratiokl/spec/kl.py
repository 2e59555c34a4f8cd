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

from ratiokl._codes import KL

__all__ = ["KLVariant", "KL_VARIANTS", "estimator_dlogp", "estimator_value"]


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
