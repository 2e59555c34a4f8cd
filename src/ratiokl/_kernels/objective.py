"""The per-token PPO/GRPO objective of ``ratiokl.spec.policy_loss`` and its derivative, in-kernel.

:func:`token_objective` gives, for one active token with log-prob ``logp``,
``(loss_t, dloss_t/dlogp, r, kl, clip bits)``:

* ``r = exp(clip(logp - old, -B, B))`` (``B = log_ratio_bound``; no gradient beyond it);
* the surrogate ``-A * q * iw`` with ``q`` the ratio clipped to ``[ratio_low,
  ratio_high]`` by the sign of the advantage ``A`` (and capped at ``neg_cap`` for
  ``A < 0`` when ``HAS_NEG_CAP``: dual clip / ratio cap); a clipped branch carries
  no gradient;
* with ``OBJECTIVE = CISPO`` the policy term is ``-A * wc * iw * logp`` instead, with
  ``wc = clip(r, ratio_low, ratio_high)`` detached (for every advantage): the gradient
  ``-A * wc * iw`` on every active token (the clip bits say where ``wc`` was clipped);
* plus ``kl_coef * kl(logp_ref - logp)`` for the chosen estimator
  (``ratiokl.spec.POLICY_KL_ESTIMATORS``); ``kl_coef = 0`` adds nothing (the KL
  is then only logged: ``0 * inf`` would be NaN).

The coefficients are run-time values (read from device memory by the caller's
kernel), not compile-time constants: a trainer may change them every step
(an adaptive KL controller) without a compile or a host round trip.

Used by the fused loss kernel (``fused_loss.policy_loss_kernel``).
"""

import triton
import triton.language as tl

from ratiokl._kernels.codes import CISPO, K1, K1_PLUS, K2, K3, K3_PLUS, KL_NONE
from ratiokl._kernels.numerics import kl_and_dkl

#: Bits of the per-row clip code (``clip_ptr``): which branch of the surrogate was taken.
CLIP_LOW = tl.constexpr(1)  # A < 0 and r < 1 - clip_eps
CLIP_HIGH = tl.constexpr(2)  # A > 0 and r > ratio_high
CLIP_CAPPED = tl.constexpr(4)  # A < 0 and r > neg_cap (dual clip / ratio_cap)


@triton.jit
def _bounded(x, BOUND: tl.constexpr):
    """``clip(x, -BOUND, BOUND)`` (``BOUND = 0``: no bound); a NaN stays NaN.

    Selected, not ``tl.minimum(tl.maximum(...))``: on a GPU those are ``max.f32`` /
    ``min.f32``, which return the non-NaN operand, so a NaN log-ratio (a poisoned row,
    NaN ``old_logps``) became the bound and the row's loss finite (so does Triton
    >= 3.7's interpreter); ``np.clip`` in the spec keeps it NaN.
    """
    if BOUND > 0:
        x = tl.where(x > BOUND, BOUND, tl.where(x < -BOUND, -BOUND, x))
    return x


@triton.jit
def _inside(x, y, BOUND: tl.constexpr):
    """``y``, or 0 where ``|x| > BOUND``: the gradient a bound implies (``BOUND = 0``: ``y``).

    A NaN ``x`` is not beyond the bound: ``y`` (NaN) stays, as in the spec and the native
    backends (``|x| <= BOUND`` would have made a NaN log-ratio's gradient a silent 0).
    """
    if BOUND > 0:
        y = tl.where(tl.abs(x) > BOUND, 0.0, y)
    return y


@triton.jit
def _policy_kl(d, r, dr, KL_CODE: tl.constexpr, BOUND: tl.constexpr):
    """KL variant on ``d = logp_ref - logp`` (``ratiokl.spec.POLICY_KL_ESTIMATORS``) and d/dlogp."""
    k3, dk3 = kl_and_dkl(_bounded(d, BOUND), K3)  # expm1(d_b) - d_b and -expm1(d_b)
    dk3 = _inside(d, dk3, BOUND)
    if KL_CODE == K1:
        kl, dkl = -d, 1.0
    elif KL_CODE == K2:
        kl, dkl = 0.5 * d * d, -d
    elif KL_CODE == K3:
        kl, dkl = k3, dk3
    elif KL_CODE == K1_PLUS:  # the value of k1, the gradient of k2
        kl, dkl = -d, -d
    elif KL_CODE == K3_PLUS:  # the value of k3, the gradient of k2
        kl, dkl = k3, -d
    else:  # K3_IS: r * k3, product rule through both
        kl, dkl = r * k3, dr * k3 + r * dk3
    return kl, dkl


@triton.jit(noinline=True)  # a call, not inlined: 72 -> 56 registers for the fused kernel
def token_objective(
    logp, old, adv, iw, logp_ref,
    kl_coef, ratio_low, ratio_high, neg_cap,
    KL_CODE: tl.constexpr, HAS_NEG_CAP: tl.constexpr, BOUND: tl.constexpr,
    OBJECTIVE: tl.constexpr,
):
    """``(loss_t, dloss_t/dlogp, r, kl, clip bits)`` of one active token (spec formulas)."""
    lr = logp - old
    r = tl.exp(_bounded(lr, BOUND))
    dr = _inside(lr, r, BOUND)  # no gradient beyond the bound
    if OBJECTIVE == CISPO:  # clip(r) for every advantage, a detached weight on logp
        high = r > ratio_high
        low = r < ratio_low
        capped = adv < -float("inf")  # never (dual_clip is rejected with CISPO)
        wc = tl.where(high, ratio_high, tl.where(low, ratio_low, r))
        loss = -adv * wc * iw * logp
        dloss = -adv * wc * iw
    else:
        high = (adv > 0) & (r > ratio_high)
        low = (adv < 0) & (r < ratio_low)
        if HAS_NEG_CAP:
            capped = (adv < 0) & (r > neg_cap)
        else:
            capped = adv < -float("inf")  # never (NaN included)
        q = tl.where(high, ratio_high, tl.where(low, ratio_low, tl.where(capped, neg_cap, r)))
        clipped = high | low | capped
        loss = -adv * q * iw
        # A clipped branch carries no gradient (selected, so an infinite dr stays out).
        dloss = tl.where(clipped, 0.0, -adv * dr * iw)
    kl = 0.0
    if KL_CODE != KL_NONE:
        kl, dkl = _policy_kl(logp_ref - logp, r, dr, KL_CODE, BOUND)
        weighted = kl_coef != 0.0  # 0: the KL is only logged (0 * inf would be NaN)
        loss = tl.where(weighted, loss + kl_coef * kl, loss)
        dloss = tl.where(weighted, dloss + kl_coef * dkl, dloss)
    bits = tl.where(low, CLIP_LOW, 0) + tl.where(high, CLIP_HIGH, 0)
    bits = bits + tl.where(capped, CLIP_CAPPED, 0)
    return loss, dloss, r, kl, bits
