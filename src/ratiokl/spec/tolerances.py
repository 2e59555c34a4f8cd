"""Comparison tolerances, one table keyed by the logits' dtype.

Every backend upcasts logits to float32 before any arithmetic, and the
fixtures' low-precision inputs are exactly representable, so the *forward*
error is float32 rounding in every dtype: a few ulps of the log-sum-exp,
which grow with the magnitude of the scaled logits (``|z|`` near 1e4 makes
one fp32 ulp about 1e-3). The *gradient* is written in the logits' dtype, so
it carries one rounding of that dtype on top (unit roundoff ``u``).

``allclose(actual, expected)`` means
``|actual - expected| <= atol + rtol * |expected|`` elementwise, with NaN
expected exactly where NaN is found and equal infinities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

__all__ = ["GRAD_ROUNDOFF", "Tolerance", "forward_tolerance", "grad_tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """Elementwise bound ``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float

    def as_dict(self) -> Dict[str, float]:
        return {"rtol": self.rtol, "atol": self.atol}


#: Unit roundoff of the dtype the gradient is stored in (half an ulp at 1.0).
GRAD_ROUNDOFF: Dict[str, float] = {
    "float32": 2.0**-24,  # fp32 math dominates: handled by the forward term
    "float16": 2.0**-11,  # 10 stored mantissa bits
    "bfloat16": 2.0**-8,  # 7 stored mantissa bits
}

#: float32 unit roundoff; the fp32 forward loses a small multiple of it.
_FP32_U = 2.0**-24
#: Headroom over one ulp: the log-sum-exp, the subtraction and exp each round
#: once, and block-wise sums reorder the reduction (about log2(V) roundings).
_FORWARD_ULPS = 64.0


def forward_tolerance(logit_scale: float) -> Tolerance:
    """Tolerance of ``logp``, ``ratio``, ``kl`` when ``max |logits/T| = logit_scale``.

    The absolute error of ``logp`` is a few fp32 ulps of the larger of 1 and
    the scaled logits' magnitude; ``ratio`` and ``kl`` inherit it relatively.
    """
    scale = max(1.0, float(logit_scale))
    return Tolerance(rtol=_FORWARD_ULPS * _FP32_U * scale, atol=_FORWARD_ULPS * _FP32_U * scale)


def grad_tolerance(dtype: str, logit_scale: float, grad_scale: float) -> Tolerance:
    """Tolerance of the policy-logit gradient stored in ``dtype``.

    ``grad_scale`` is the largest ``|expected gradient|`` of the case: the
    dtype's rounding is relative to the element, the fp32 forward error is
    relative to the row's coefficient, bounded by ``grad_scale``.
    """
    u = GRAD_ROUNDOFF[dtype]
    fwd = forward_tolerance(logit_scale)
    return Tolerance(rtol=2.0 * u + fwd.rtol, atol=fwd.atol * max(1.0, float(grad_scale)) + 1e-30)
