"""Per-row vectors around the fused policy loss: aggregation weights before it, metrics after.

The fused kernel (``fused_loss.policy_loss_kernel``) takes each row's weight
``w_t = a_t / D`` and gives each row's values; turning a mask into weights
and the row values into the logged means are a chain of small framework ops
(about 30 PyTorch launches per step, 1-2 us of device time each). Each
kernel here is one program that streams the ``[N]`` vectors in blocks:

* ``token_weights_kernel`` -- ``w_t = mask_t / D`` for ``token-mean`` (``D`` = the
  active count clamped at 1: a count on the device, no host round trip; a ``D``
  the host knows is one framework op there);
* ``policy_metrics_kernel`` -- the eight means over active rows of
  ``ratiokl.spec.policy_loss``'s metrics, and the loss (the sum of the
  kernel's weighted per-row losses: no separate sum launch); with the engine's
  log-probs (``HAS_ROLLOUT``) also the two trainer/sampler parity fractions of
  ``ratiokl.spec.rollout_parity``.

Sums run in a fixed order (per lane, then one tree reduction), so a launch
gives the same bits every time. Divisions are rounded to nearest
(``div_rn``), as the frameworks' own division is. PyTorch
(``ratiokl.torch._launch``) and JAX (``ratiokl.jax._launch``) launch the same
two kernels and decide where the weights kernel applies with
``ratiokl.spec.PolicyLossOptions.uniform_weight`` (host-side aggregation policy: this
package imports only Triton).
"""

from typing import Dict, Tuple

import triton
import triton.language as tl

from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW

#: The order of ``policy_metrics_kernel``'s eight means.
METRIC_NAMES: Tuple[str, ...] = (
    "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
    "ratio_mean", "kl_mean", "approx_kl", "entropy_mean",
)

#: The parity fractions ``policy_metrics_kernel`` adds after ``METRIC_NAMES`` with
#: ``HAS_ROLLOUT`` (``ratiokl.spec.ROLLOUT_PARITY_NAMES``).
PARITY_METRICS = 2


def parity_constexprs(tolerances: Tuple[float, float]) -> Dict[str, float]:
    """:func:`policy_metrics_kernel`'s compile-time bands ``[1 - tol, 1 + tol]``, for both
    bindings, from the parity tolerances (``ratiokl.spec.ROLLOUT_PARITY_TOLERANCES``)."""
    near, far = tolerances
    return {"LOW_A": 1.0 - near, "HIGH_A": 1.0 + near, "LOW_B": 1.0 - far, "HIGH_B": 1.0 + far}


#: Rows per block of the one-program loops, and the program's warps (N = 8192: two
#: blocks; the metrics took 14 us of device time with 1024 rows x 4 warps).
ROWS_BLOCK = 4096
ROWS_WARPS = 8


@triton.jit
def token_weights_kernel(
    mask_ptr,  # [N] bool, nonzero = active row
    w_ptr,  # [N] f32 output: mask / D
    N,
    BLOCK: tl.constexpr,
):
    """``w = where(mask, 1 / D, 0)``, ``D = max(number of active rows, 1)``; one program."""
    cols = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + cols
        count += (tl.load(mask_ptr + offs, mask=offs < N, other=0) != 0).to(tl.int32)
    inv = tl.div_rn(1.0, tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32))
    for start in range(0, N, BLOCK):
        offs = start + cols
        inside = offs < N
        active = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
        tl.store(w_ptr + offs, tl.where(active, inv, 0.0), mask=inside)


@triton.jit
def policy_metrics_kernel(
    mask_ptr,  # [N] bool, nonzero = active row
    logp_ptr,  # [N] f32 policy log-prob (0 on inactive rows)
    ratio_ptr,  # [N] f32 ratio
    kl_ptr,  # [N] f32 KL value
    ent_ptr,  # [N] f32 entropy
    clip_ptr,  # [N] int32 clip bits (objective.CLIP_*)
    old_ptr,  # [N] f32 behaviour log-probs (anything on inactive rows)
    loss_ptr,  # [N] f32 weighted per-row losses w_t * loss_t (0 on inactive rows)
    rollout_ptr,  # [N] f32 the engine's log-probs (rollout_logps); read iff HAS_ROLLOUT
    out_ptr,  # [8] f32 output: the means below ([8 + PARITY_METRICS] with HAS_ROLLOUT)
    total_ptr,  # [] f32 output: the loss
    N,
    HAS_ROLLOUT: tl.constexpr,
    LOW_A: tl.constexpr,  # the parity bands (parity_constexprs); read iff HAS_ROLLOUT
    HIGH_A: tl.constexpr,
    LOW_B: tl.constexpr,
    HIGH_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Means over active rows, 0 when none is: ``out = (clip_fraction, clip_fraction_low,
    clip_fraction_high, dual_clip_fraction, ratio_mean, kl_mean, approx_kl,
    entropy_mean)``, with ``HAS_ROLLOUT`` then the fractions of rows whose
    ``exp(logp - rollout)`` lies outside ``[LOW_A, HIGH_A]`` and ``[LOW_B, HIGH_B]`` (NaN:
    outside); ``total`` is the loss, the sum of ``loss_ptr`` over active rows.

    ``clip_fraction`` counts rows clipped low or high; ``approx_kl`` is the
    mean of ``old - logp``. Inactive rows are selected out (never multiplied),
    so NaN there stays out. One program.
    """
    cols = tl.arange(0, BLOCK)
    count = tl.zeros([BLOCK], tl.int32)
    n_clip = tl.zeros([BLOCK], tl.int32)
    n_low = tl.zeros([BLOCK], tl.int32)
    n_high = tl.zeros([BLOCK], tl.int32)
    n_capped = tl.zeros([BLOCK], tl.int32)
    ratio = tl.zeros([BLOCK], tl.float32)
    kl = tl.zeros([BLOCK], tl.float32)
    approx = tl.zeros([BLOCK], tl.float32)
    ent = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    off_a = tl.zeros([BLOCK], tl.int32)
    off_b = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        offs = start + cols
        inside = offs < N
        active = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
        bits = tl.where(active, tl.load(clip_ptr + offs, mask=inside, other=0), 0)
        low = (bits & CLIP_LOW) != 0
        high = (bits & CLIP_HIGH) != 0
        count += active.to(tl.int32)
        n_clip += (low | high).to(tl.int32)
        n_low += low.to(tl.int32)
        n_high += high.to(tl.int32)
        n_capped += ((bits & CLIP_CAPPED) != 0).to(tl.int32)
        ratio += tl.where(active, tl.load(ratio_ptr + offs, mask=inside, other=0.0), 0.0)
        kl += tl.where(active, tl.load(kl_ptr + offs, mask=inside, other=0.0), 0.0)
        logp = tl.load(logp_ptr + offs, mask=inside, other=0.0)
        approx += tl.where(active, tl.load(old_ptr + offs, mask=inside, other=0.0) - logp, 0.0)
        if HAS_ROLLOUT:
            # Trainer/sampler parity: e = p / p_engine, off outside a band (NaN is outside).
            e = tl.exp(logp - tl.load(rollout_ptr + offs, mask=active, other=0.0))
            off_a += (active & ~((e >= LOW_A) & (e <= HIGH_A))).to(tl.int32)
            off_b += (active & ~((e >= LOW_B) & (e <= HIGH_B))).to(tl.int32)
        ent += tl.where(active, tl.load(ent_ptr + offs, mask=inside, other=0.0), 0.0)
        total += tl.where(active, tl.load(loss_ptr + offs, mask=inside, other=0.0), 0.0)
    n = tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    tl.store(out_ptr, tl.div_rn(tl.sum(n_clip, axis=0).to(tl.float32), n))
    tl.store(out_ptr + 1, tl.div_rn(tl.sum(n_low, axis=0).to(tl.float32), n))
    tl.store(out_ptr + 2, tl.div_rn(tl.sum(n_high, axis=0).to(tl.float32), n))
    tl.store(out_ptr + 3, tl.div_rn(tl.sum(n_capped, axis=0).to(tl.float32), n))
    tl.store(out_ptr + 4, tl.div_rn(tl.sum(ratio, axis=0), n))
    tl.store(out_ptr + 5, tl.div_rn(tl.sum(kl, axis=0), n))
    tl.store(out_ptr + 6, tl.div_rn(tl.sum(approx, axis=0), n))
    tl.store(out_ptr + 7, tl.div_rn(tl.sum(ent, axis=0), n))
    if HAS_ROLLOUT:
        tl.store(out_ptr + 8, tl.div_rn(tl.sum(off_a, axis=0).to(tl.float32), n))
        tl.store(out_ptr + 9, tl.div_rn(tl.sum(off_b, axis=0).to(tl.float32), n))
    tl.store(total_ptr, tl.sum(total, axis=0))
