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

import math
from dataclasses import dataclass
from typing import Dict, Optional

__all__ = ["GRAD_ROUNDOFF", "Tolerance", "forward_tolerance", "grad_tolerance",
           "linear_forward_tolerance", "linear_grad_operand", "linear_grad_tolerance",
           "paths_tolerance",
           "autocast_tolerance", "reduction_tolerance", "rounding_tolerance",
           "trainer_tolerance", "update_tolerance"]


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
    # the gradient GEMMs of fp32_matmul="bf16x3": d loss / d x and the float32 operands as
    # two bfloat16 pieces each (16 significant bits)
    "bf16x2": 2.0**-16,
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


#: The ops from hidden states keep each chunk's logits in float32 by default; with
#: ``logits_dtype="input"`` they round each logit to the inputs' dtype in their chunk buffer:
#: the GEMM's result once, then (PyTorch, in place) each of the softcap's three steps once.
_LOGIT_ROUNDINGS = 4.0


def linear_forward_tolerance(dtype: str, logit_scale: float, vocab: int,
                             entropy: bool = False, logits_dtype: str = "float32") -> Tolerance:
    """Tolerance of ``logp`` (or, with ``entropy``, the entropy) of the ops from hidden
    states against float64 on the inputs' own values (``dtype``: the hidden states' and
    weight's; ``logit_scale``: ``max |x / T|``; ``logits_dtype``: the chunk's logits, float32
    unless ``logits_dtype="input"`` made them ``dtype``).

    :func:`forward_tolerance`, plus the logits' rounding to ``logits_dtype`` in the chunk
    buffer: each ``x / T`` moves by up to ``4 u max(1, |x / T|)``, which moves ``logp`` by
    twice that and the entropy by ``E_p |log p + H|`` times that, at most about ``2 + ln V``.
    With float32 logits (the default) that is a few float32 ulps: the GEMM's float32
    accumulator is the logit, whatever ``dtype`` the operands had (their products are exact
    in float32).
    """
    fwd = forward_tolerance(logit_scale)
    moved = _LOGIT_ROUNDINGS * GRAD_ROUNDOFF[logits_dtype] * max(1.0, float(logit_scale))
    factor = 2.0 + math.log(max(vocab, 1)) if entropy else 2.0
    return Tolerance(rtol=fwd.rtol, atol=fwd.atol + moved * factor)


def linear_grad_tolerance(dtype: str, logit_scale: float, magnitude: float,
                          logits_dtype: str = "float32",
                          stored: Optional[str] = None) -> Tolerance:
    """Tolerance of ``d hidden``, ``d weight`` or ``d bias`` of the ops from hidden states.

    Each is a sum of products ``du * other`` (over the vocabulary or the rows), so its error
    is relative to ``magnitude``, the largest entry of the same sum of ``|du| * |other|``
    (``ratiokl.spec.linear_grad_magnitudes``): ``du`` is rounded to ``dtype`` (the inputs'
    half-precision dtype, as the gradient GEMMs take it: 2 u, with the result's rounding;
    :func:`linear_grad_operand` names it), and the logits' rounding to ``logits_dtype`` moves
    each softmax term by up to twice the :func:`linear_forward_tolerance` shift, on top of the
    float32 forward's error. ``stored``: the dtype the gradient is returned in, its
    argument's, when not ``dtype`` (a mixed head: ``du`` in float32, ``d hidden`` in
    bfloat16): its rounding, ``2 u`` of ``stored`` relative to the entry.
    """
    u = GRAD_ROUNDOFF[dtype]
    shift = _LOGIT_ROUNDINGS * GRAD_ROUNDOFF[logits_dtype] * max(1.0, float(logit_scale))
    relative = 2.0 * u + 2.0 * shift + forward_tolerance(logit_scale).rtol
    return Tolerance(rtol=2.0 * GRAD_ROUNDOFF[stored or dtype],
                     atol=relative * float(magnitude) + 1e-30)


def linear_grad_operand(hidden_dtype: str, weight_dtype: str) -> str:
    """The :data:`GRAD_ROUNDOFF` key of ``du = d loss / d x`` as the gradient GEMMs of the
    ops from hidden states take it (``ratiokl.spec.head_dtypes``): the inputs' dtype when they
    share one; for a mixed head (bfloat16 hidden states with a float32 weight, or the
    reverse) float32, which the default ``fp32_matmul="bf16x3"`` takes on a GPU as two
    bfloat16 pieces, ``"bf16x2"`` (the CPU's float32 GEMMs are finer)."""
    return hidden_dtype if hidden_dtype == weight_dtype else "bf16x2"


#: Unit roundoff of the dtype a whole computation runs in (float64: the spec's own paths).
_UNIT_ROUNDOFF: Dict[str, float] = {"float64": 2.0**-53, "float32": _FP32_U}


def rounding_tolerance(roundings: int, dtype: str = "float32") -> Tolerance:
    """Tolerance of a value that ``roundings`` correctly rounded ``dtype`` operations (a
    division, a product, a conversion; no sum that may cancel, no ``exp`` / ``log``) stand
    between, on both sides taken together: each moves it by at most ``u`` relative, so
    ``rtol = roundings * u`` and ``atol = 0`` (a token weight, a ratio of counts)."""
    return Tolerance(rtol=max(int(roundings), 1) * _UNIT_ROUNDOFF[dtype], atol=0.0)


def reduction_tolerance(terms: int, magnitude: float = 1.0, dtype: str = "float32") -> Tolerance:
    """Tolerance of one ``dtype`` evaluation against the exact (float64) value, where the
    value sums ``terms`` per-token results (a loss, a metric, a rollout weight).

    Each per-token result carries :func:`forward_tolerance`'s ``64 u`` relative error, and a
    sum of ``terms`` summands in any order adds up to ``(terms - 1) u`` times the sum of their
    magnitudes (recursive summation's worst case), which ``magnitude`` bounds (``1`` for means
    and for values whose summands share their sign)::

        rtol = (64 + terms) u        atol = (64 + terms) u * magnitude
    """
    ulps = (_FORWARD_ULPS + max(int(terms), 1)) * _UNIT_ROUNDOFF[dtype]
    return Tolerance(rtol=ulps, atol=ulps * float(magnitude))


def paths_tolerance(terms: int = 1, magnitude: float = 1.0, dtype: str = "float32") -> Tolerance:
    """Tolerance between two ``dtype`` evaluations of one formula that differ only in the
    order of their roundings: an interpreted kernel and the native path, eager and compiled,
    ``jit`` and eager, one call and a ``vmap``, PyTorch and JAX.

    Each side is within :func:`reduction_tolerance` of the exact value, so the two are within
    twice it: ``rtol = atol / magnitude = 2 (64 + terms) u``. ``terms`` is the length of the
    longest sum behind the value (the vocabulary for a gradient, the tokens for a loss);
    ``magnitude`` bounds the summands' absolute sum (the largest ``|value|`` where they share
    a sign).
    """
    one = reduction_tolerance(terms, magnitude, dtype)
    return Tolerance(rtol=2.0 * one.rtol, atol=2.0 * one.atol)


#: The absolute floor of :func:`trainer_tolerance`, in float32 ulps at 1: where a loss's
#: positive and negative terms cancel (``sum |terms| >> |loss|``), what stays of the terms'
#: own rounding (observed: a quarter of an ulp, at a loss of 6e-4 whose terms are O(1)).
_TRAINER_FLOOR_ULPS = 4.0


def trainer_tolerance(terms: int) -> Tolerance:
    """Tolerance of ratiokl's float32 loss or logged metric against a trainer's own exact
    (float64) evaluation of it on the same batch; between two float32 evaluations (the
    trainer's code in another order): ``two_paths`` of it.

    The value sums ``terms`` per-token results (the batch's tokens): relative to the value,
    :func:`reduction_tolerance`'s ``(64 + terms) u``; absolute, a few ulps
    (``_TRAINER_FLOOR_ULPS``) for a value that cancels to near 0::

        rtol = (64 + terms) u        atol = 4 u
    """
    return Tolerance(rtol=reduction_tolerance(terms).rtol, atol=_TRAINER_FLOOR_ULPS * _FP32_U)


def autocast_tolerance(dtype: str, logit_scale: float, magnitude: float) -> Tolerance:
    """Tolerance between a loss step under ``dtype`` autocast and a trainer's own under the
    same autocast (the loss, a parameter's gradient; ``magnitude``: its largest ``|value|``):
    each side rounds once to ``dtype`` what the other may round elsewhere, on top of the
    float32 forward's error: :func:`grad_tolerance` on each side::

        rtol = 2 (2 u + 64 u32 s)        atol = 2 * 64 u32 s * max(1, magnitude)
    """
    one = grad_tolerance(dtype, logit_scale, magnitude)
    return Tolerance(rtol=2.0 * one.rtol, atol=2.0 * one.atol)


def update_tolerance(step: Tolerance, param_magnitude: float) -> Tolerance:
    """Tolerance of an optimizer step's update read back as ``after - before`` (float32),
    on the same ``before``: the step's own tolerance ``step`` (its gradient's, scaled as
    the update), plus ``after``'s rounding on each side, ``u |after|``, which
    ``param_magnitude`` (the largest ``|after|``) bounds."""
    return Tolerance(rtol=step.rtol, atol=step.atol + 2.0 * _FP32_U * float(param_magnitude))
