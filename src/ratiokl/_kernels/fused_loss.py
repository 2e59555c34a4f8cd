"""Fused policy-loss kernels: loss, metrics pieces and the policy-logit gradient in one program.

``policy_loss_kernel`` -- one program per row of ``[N, V]`` logits:

1. one pass over the row for the log-sum-exp (the policy's, and the
   reference's in the same pass when reference logits are given), shared
   with the forward kernel (``forward._rows_lse2``);
2. the per-token objective of ``ratiokl.spec.policy_loss`` (token-level
   ratio) and its derivative ``dL/dlogp`` in registers;
3. right away, while the row is still in L2, a second sweep writing
   ``grad = w * dL/dlogp * (onehot(a) - softmax(x / T)) / T`` in the logits'
   dtype, where ``w`` is the row's aggregation weight ``a_t / D`` -- unless
   ``WRITE_GRAD`` is off (no gradient wanted: the row is read once and the
   forward's memory is O(N)).

Rows are strided over the programs, so the launch may use fewer programs
than rows (a persistent grid, :func:`launch_plan`); a row is always handled
whole by one program in the same tile order, so no grid changes any bit of
its results (batch invariance). Where the row is still in L2 for the second
sweep, a training step reads the policy row from HBM about once and writes
the gradient once (on the H200 at V = 151,936 it mostly is not: see
:func:`launch_plan`). The backward is ``scale_rows_kernel``, a per-row scale of
the stored gradient by the upstream value that skips rows whose upstream
value is exactly 1 (the usual ``loss.backward()``) and inactive rows.

Inactive rows read nothing, write the neutral per-row values
(``loss = logp = kl = 0``, ``ratio = 1``, no clip bits) and an exact-zero
gradient row. An active row with an id outside ``[0, V)`` reads the clamped
id and is poisoned (NaN loss, metrics pieces and gradient), like the
forward kernel.
"""

from typing import Tuple

import triton
import triton.language as tl

from ratiokl._kernels.backward import _grad_tile
from ratiokl._kernels.forward import _rows_lse2, _selected
from ratiokl._kernels.heuristics import LaunchConfig, forward_config
from ratiokl._kernels.numerics import LOG2E, kl_and_dkl, to_storage

#: Bits of the per-row clip code (``clip_ptr``): which branch of the surrogate was taken.
CLIP_LOW = tl.constexpr(1)  # A < 0 and r < 1 - clip_eps
CLIP_HIGH = tl.constexpr(2)  # A > 0 and r > ratio_high
CLIP_CAPPED = tl.constexpr(4)  # A < 0 and r > neg_cap (dual clip / ratio_cap)


#: Programs of the persistent grid: 16 per SM of the H200 (132 SMs).
_PROGRAMS = 2112


def launch_plan(n_rows: int, vocab: int, itemsize: int) -> Tuple[LaunchConfig, int]:
    """Tile/warps and the number of programs (rows are strided over them) of the fused kernel.

    Measured on the H200 (bf16, N = 8192, V = 151,936, reference log-probs,
    kernel alone, ``V`` a compile-time constant as in both launches): 4096 x
    4 warps, one program per row 1.81 ms, 2112 programs 1.82, 1056 1.86;
    8192 x 8 warps on 528 programs 2.23; 16384 x 16 on 264 2.53 (with ``V`` a
    runtime integer each was 0.13-0.48 ms slower: 2.29 ms at 2112). A grid
    small enough for the rows in flight to stay in L2 (<= ~160 rows of 304
    KB) starves HBM of requests, so the gradient sweep mostly re-reads the
    row from HBM; L2 eviction hints, 32-warp programs and splitting a row
    over programs that meet at a device-side counter (the row's statistics
    combined, each program then writing its own span from L2 or registers)
    reached 1.72, 1.61 and 2.05 ms (``benchmarks/fused_loss_variants.py``):
    not enough to pay for a spinning wait. A row is handled whole by one
    program in a fixed tile order, so the grid changes no bit (batch invariance).
    """
    return forward_config(vocab, itemsize), max(1, min(n_rows, _PROGRAMS))


@triton.jit
def _bounded(x, BOUND: tl.constexpr):
    """``clip(x, -BOUND, BOUND)`` (``BOUND = 0``: no bound)."""
    if BOUND > 0:
        x = tl.minimum(tl.maximum(x, -BOUND), BOUND)
    return x


@triton.jit
def _inside(x, y, BOUND: tl.constexpr):
    """``y`` where ``|x| <= BOUND``, else 0: the gradient a bound implies (``BOUND = 0``: ``y``)."""
    if BOUND > 0:
        y = tl.where(tl.abs(x) <= BOUND, y, 0.0)
    return y


@triton.jit
def _policy_kl(d, r, dr, KL_CODE: tl.constexpr, BOUND: tl.constexpr):
    """KL variant on ``d = logp_ref - logp`` (``ratiokl.spec.POLICY_KL_ESTIMATORS``) and d/dlogp."""
    k3, dk3 = kl_and_dkl(_bounded(d, BOUND), 3)  # expm1(d_b) - d_b and -expm1(d_b)
    dk3 = _inside(d, dk3, BOUND)
    if KL_CODE == 1:  # k1
        kl, dkl = -d, 1.0
    elif KL_CODE == 2:  # k2
        kl, dkl = 0.5 * d * d, -d
    elif KL_CODE == 3:  # k3
        kl, dkl = k3, dk3
    elif KL_CODE == 4:  # k1+: value of k1, gradient of k2
        kl, dkl = -d, -d
    elif KL_CODE == 5:  # k3+: value of k3, gradient of k2
        kl, dkl = k3, -d
    else:  # k3-is: r * k3, product rule through both
        kl, dkl = r * k3, dr * k3 + r * dk3
    return kl, dkl


@triton.jit
def _token_objective(
    logp, old, adv, iw, logp_ref,
    KL_CODE: tl.constexpr, KL_COEF: tl.constexpr, RATIO_LOW: tl.constexpr,
    RATIO_HIGH: tl.constexpr, NEG_CAP: tl.constexpr, BOUND: tl.constexpr,
):
    """``(loss_t, dloss_t/dlogp, r, kl, clip bits)`` of one active token (spec formulas)."""
    lr = logp - old
    r = tl.exp(_bounded(lr, BOUND))
    dr = _inside(lr, r, BOUND)  # no gradient beyond the bound
    high = (adv > 0) & (r > RATIO_HIGH)
    low = (adv < 0) & (r < RATIO_LOW)
    if NEG_CAP > 0:
        capped = (adv < 0) & (r > NEG_CAP)
    else:
        capped = adv < -float("inf")  # never (NaN included)
    q = tl.where(high, RATIO_HIGH, tl.where(low, RATIO_LOW, tl.where(capped, NEG_CAP, r)))
    clipped = high | low | capped
    loss = -adv * q * iw
    # A clipped branch carries no gradient (selected, so an infinite dr stays out).
    dloss = tl.where(clipped, 0.0, -adv * dr * iw)
    kl = 0.0
    if KL_CODE > 0:
        kl, dkl = _policy_kl(logp_ref - logp, r, dr, KL_CODE, BOUND)
        if KL_COEF != 0:  # kl_coef = 0: the KL is only logged (0 * inf would be NaN)
            loss = loss + KL_COEF * kl
            dloss = dloss + KL_COEF * dkl
    bits = tl.where(low, CLIP_LOW, 0) + tl.where(high, CLIP_HIGH, 0)
    bits = bits + tl.where(capped, CLIP_CAPPED, 0)
    return loss, dloss, r, kl, bits


@triton.jit
def _grad_sweep(p_row, grad_row, V, stride_pv, a, k, lse2, c, active, BLOCK_V: tl.constexpr):
    """``grad_row = c * (onehot(a) - exp2(p_row * k - lse2))``, exact 0 on an inactive row.

    Tiles are visited last to first: the tiles the log-sum-exp pass read most
    recently are the likeliest to be still in L2. Each element is independent,
    so the order changes no bit of the result.
    """
    cols = tl.arange(0, BLOCK_V)
    n_full = V // BLOCK_V
    if V % BLOCK_V != 0:
        offs = (n_full * BLOCK_V + cols).to(tl.int64)
        tail = offs < V
        _grad_tile(
            p_row + offs * stride_pv, grad_row + offs, offs, tail & active, tail,
            a, k, lse2, c, active,
        )
    on = tl.full([BLOCK_V], 1, tl.int1) & active
    for i in range(0, n_full):
        offs = ((n_full - 1 - i) * BLOCK_V + cols).to(tl.int64)
        _grad_tile(p_row + offs * stride_pv, grad_row + offs, offs, on, None, a, k, lse2, c, active)


@triton.jit
def policy_loss_kernel(
    # inputs
    policy_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_pn, stride_pv)
    ref_ptr,  # [N, V] reference logits, strides (stride_rn, stride_rv); read iff HAS_REF
    ids_ptr,  # [N] int32/int64 action ids
    mask_ptr,  # [N] bool (torch) or int8 (jax), nonzero = active row
    old_ptr,  # [N] f32 behaviour-policy log-probs
    ref_logps_ptr,  # [N] f32 reference log-probs; read iff KL_CODE > 0 and not HAS_REF
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    adv_ptr,  # [N] f32 advantages
    iw_ptr,  # [N] f32 importance weights; read iff HAS_IW
    w_ptr,  # [N] f32 aggregation weight a_t / D (0 on inactive rows)
    # outputs
    loss_ptr,  # [N] f32 w * loss_t (the loss is their sum)
    logp_ptr,  # [N] f32 log-prob of the action under the policy
    ratio_ptr,  # [N] f32 r = exp(bounded logp - old)
    kl_ptr,  # [N] f32 KL value of the chosen variant (0 when KL_CODE == 0)
    clip_ptr,  # [N] int32 clip bits (CLIP_LOW | CLIP_HIGH | CLIP_CAPPED)
    grad_ptr,  # [N, V] d(sum of loss_ptr)/d policy, logits' dtype, row-major (row stride V);
    # written iff WRITE_GRAD
    # sizes and strides (elements)
    N,
    V: tl.constexpr,  # a constant in both launches: 2.29 -> 1.81 ms at the headline shape
    stride_pn,
    stride_pv,
    stride_rn,
    stride_rv,
    stride_t,
    # compile-time options (fixed for a run)
    HAS_REF: tl.constexpr,  # reference logits given (else ref_logps, or no reference)
    HAS_IW: tl.constexpr,  # importance weights given
    KL_CODE: tl.constexpr,  # 0: no reference (kl = 0); 1..6: POLICY_KL_ESTIMATORS
    KL_COEF: tl.constexpr,  # kl_coef
    RATIO_LOW: tl.constexpr,  # 1 - clip_eps
    RATIO_HIGH: tl.constexpr,  # min(1 + clip_eps_high, ratio_cap)
    NEG_CAP: tl.constexpr,  # min(dual_clip, ratio_cap) for A < 0; 0: off
    BOUND: tl.constexpr,  # log_ratio_bound; 0: no bound
    WRITE_GRAD: tl.constexpr,  # False: no gradient wanted, the row is read once (forward only)
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    # Rows are strided over the programs: grid = N gives one row per program; a
    # smaller (persistent) grid bounds the rows in flight, i.e. the L2 working set.
    first = tl.program_id(0)
    step = tl.num_programs(0)
    for j in range(0, (N - first + step - 1) // step):
        row = (first + j * step).to(tl.int64)
        active = tl.load(mask_ptr + row) != 0
        a = tl.load(ids_ptr + row).to(tl.int64)
        bad = active & ((a < 0) | (a >= V))
        a = tl.minimum(tl.maximum(a, 0), V - 1)  # clamp before any read
        t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
        k = LOG2E / t
        n_full = tl.where(active, V // BLOCK_V, 0)
        p_row = policy_ptr + row * stride_pn
        r_row = ref_ptr + row * stride_rn

        # Pass 1: log-sum-exp of the policy (and reference) row.
        lse2, ref_lse2 = _rows_lse2(
            p_row, r_row, V, stride_pv, stride_rv, k, n_full, active, HAS_REF, BLOCK_V
        )
        nan = float("nan")
        lse2 = tl.where(bad, nan, lse2)
        logp = _selected(p_row, a, stride_pv, t, lse2, active)

        # Epilogue: the token's objective and dL/dlogp, all in registers.
        logp_ref = 0.0
        if KL_CODE > 0:
            if HAS_REF:
                logp_ref = tl.where(bad, nan, _selected(r_row, a, stride_rv, t, ref_lse2, active))
            else:
                logp_ref = tl.load(ref_logps_ptr + row, mask=active, other=0.0)
        old = tl.load(old_ptr + row, mask=active, other=0.0)
        adv = tl.load(adv_ptr + row, mask=active, other=0.0)
        iw = 1.0
        if HAS_IW:
            iw = tl.load(iw_ptr + row, mask=active, other=0.0)
        w = tl.load(w_ptr + row, mask=active, other=0.0)
        loss, dloss, r, kl, bits = _token_objective(
            logp, old, adv, iw, logp_ref, KL_CODE, KL_COEF, RATIO_LOW, RATIO_HIGH, NEG_CAP, BOUND
        )
        tl.store(loss_ptr + row, tl.where(active, w * loss, 0.0))
        tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
        tl.store(ratio_ptr + row, tl.where(active, r, 1.0))
        tl.store(kl_ptr + row, tl.where(active, kl, 0.0))
        tl.store(clip_ptr + row, tl.where(active, bits, 0))

        # Pass 2 (row still in L2): grad = c * (onehot - softmax), c = w * dL/dlogp / T.
        if WRITE_GRAD:
            c = tl.where(active, w * dloss / t, 0.0)
            lse2 = tl.where(active, lse2, 0.0)
            _grad_sweep(p_row, grad_ptr + row * V, V, stride_pv, a, k, lse2, c, active, BLOCK_V)


@triton.jit
def scale_rows_kernel(
    # inputs
    grad_in_ptr,  # [N, V] stored gradient (row-major), any float dtype
    g_ptr,  # [N] f32 upstream value per row at g_ptr + i * stride_g (stride_g = 0: one scalar)
    mask_ptr,  # [N] bool (torch) or int8 (jax), nonzero = active row
    # outputs
    grad_out_ptr,  # [N, V] the same buffer as grad_in_ptr (in place / aliased)
    # sizes and strides (elements)
    V,
    stride_g,
    # compile-time options
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    """``grad[i] *= g[i]`` in place; rows with ``g[i] == 1`` or inactive rows are not touched."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.load(g_ptr + row * stride_g)
    if (tl.load(mask_ptr + row) != 0) & (g != 1.0):
        cols = tl.arange(0, BLOCK_V)
        for start in range(0, V, BLOCK_V):
            offs = (start + cols).to(tl.int64)
            inside = offs < V
            x = tl.load(grad_in_ptr + row * V + offs, mask=inside, other=0.0)
            y = x.to(tl.float32) * g
            out = grad_out_ptr + row * V + offs
            tl.store(out, to_storage(y, grad_out_ptr.dtype.element_ty), mask=inside)
