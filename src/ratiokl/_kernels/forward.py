"""Forward kernel: per-row log-prob, ratio, KL and log-sum-exp in one pass.

One program per row of ``[N, V]`` logits. The policy and (optionally) the
reference row are streamed once, block by block, through an online
log-sum-exp: one running ``(max, sum)`` pair per tensor, updated with one
block reduction per tile. The row's tiles form fixed spans
(``heuristics.split_plan``, a function of ``V`` and the tile only): each
span's pair starts from ``(-inf, 0)`` and is folded into the row's pair at
the span's end, exactly as ``split_forward`` folds its per-split partials
when rows are few, so both paths give a row the same bits in any batch.
In the ``ENTROPY`` mode (no reference) the tile is read as ``[BLOCK_V / LANE, LANE]``
and each lane of ``LANE`` adjacent logits keeps its own ``(max, sum, h)`` inside its
thread (``numerics.lane_lse_h_step``), the lanes meeting once a span
(``numerics.fold_lanes``): the entropy's third sum then costs no block reduction per
tile (H200: 1.00x the plain forward's time, was 1.11x). Logits are scaled to base-2
units (``x * log2(e) / T``) so that the exponentials are ``exp2``.

Inactive rows (mask 0) run zero loop iterations and a fully masked tail, so
no logit of theirs is read; they write the neutral values
``logp = 0, ratio = 1, kl = 0, dkl = 0, lse = 0``. An active row whose id is
outside ``[0, V)`` reads the clamped id (never out of bounds) and is
poisoned: ``logp``, ``ratio``, ``kl``, ``dkl`` and ``lse`` become NaN, so the
backward is NaN too.

Sizes and strides are ordinary arguments for the PyTorch launch (Triton
specialises them on divisibility by 16 and on the value 1) and compile-time
constants for the jax-triton launch, which gives runtime integers no
alignment facts (see ``../shared/PERF.md``); the main loop is unmasked over
whole blocks either way, with one masked tail block.
"""

import triton
import triton.language as tl

from ratiokl._kernels.codes import KL_NONE
from ratiokl._kernels.numerics import (
    LN2,
    LOG2E,
    STREAM_STAGES,
    fold_lanes,
    fold_lse2_h,
    kl_and_dkl,
    lse_step,
    shift_of,
)
from ratiokl._kernels.spans import (
    empty_lanes,
    entropy_tail_lanes,
    span_stats,
    tail_stats,
    tile_lanes,
)


@triton.jit
def _rows_lse2(
    p_row, r_row, V, stride_pv, stride_rv, k, n_full, active,
    HAS_REF: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Base-2 ``(lse2, ref_lse2, mean2)`` of ``p_row * k`` and ``r_row * k`` in one pass.

    ``k = log2(e) / T``. One running pair over the whole row, no spans (the shard
    statistics): ``span_stats`` over all ``n_full`` whole tiles plus the tail.
    Both rows advance through the same tiles, so their loads are in flight
    together; without ``HAS_REF`` the reference result is ``-inf``. With ``ENTROPY``,
    ``mean2`` is the mean of ``p_row * k`` under the row's softmax (0 where the row has
    no mass, ``s = 0``); else 0. Inactive rows pass ``n_full = 0`` and
    ``active = False``: nothing is read.
    """
    m_p, s_p, h_p, m_r, s_r = span_stats(
        p_row, r_row, V, stride_pv, stride_rv, k, 0, n_full, active, HAS_REF, ENTROPY, BLOCK_V,
        ""
    )
    mean2 = 0.0
    if ENTROPY:
        mean2 = tl.where(s_p > 0.0, h_p / s_p, 0.0)
    return shift_of(m_p) + tl.log2(s_p), shift_of(m_r) + tl.log2(s_r), mean2


@triton.jit
def _selected(row_ptr, a, stride_v, t, lse2, active):
    """``x[a] / T - lse`` in natural-log units, from the base-2 log-sum-exp ``lse2``."""
    x_a = tl.load(row_ptr + a * stride_v, mask=active, other=0.0).to(tl.float32)
    return x_a / t - lse2 * LN2


@triton.jit
def store_partial(part_ptr, row, split, m_p, s_p, m_r, s_r, SPLITS: tl.constexpr):
    """Store split ``split``'s partial ``(m_p, s_p, m_r, s_r)`` at ``part[row, split]``.

    ``part_ptr``: ``[N, SPLITS, 4]`` float32 (policy and reference ``(max, sum)``, base 2).
    """
    part = part_ptr + (row * SPLITS + split) * 4
    tl.store(part, m_p)
    tl.store(part + 1, s_p)
    tl.store(part + 2, m_r)
    tl.store(part + 3, s_r)


@triton.jit
def fold_lse2(m_acc, s_acc, m, s):
    """Fold a split's partial ``(m, s)`` into the running pair (the same code on every path)."""
    m_new = tl.maximum(m_acc, m)
    shift = shift_of(m_new)
    return m_new, s_acc * tl.exp2(m_acc - shift) + s * tl.exp2(m - shift)


@triton.jit
def forward_epilogue(
    row, p_row, r_row, ids_ptr, mask_ptr, old_ptr, ref_logps_ptr, temp_ptr,
    logp_ptr, ratio_ptr, kl_ptr, dkl_ptr, lse_ptr,
    V, stride_pv, stride_rv, stride_t, m_p, s_p, m_r, s_r,
    HAS_REF: tl.constexpr, KL_CODE: tl.constexpr, ENTROPY: tl.constexpr,
):
    """Per-row outputs of the forward from the folded ``(max, sum)`` pairs of policy and ref.

    ``ENTROPY`` (no reference, ``KL_CODE = KL_NONE``): ``m_r`` holds the policy's entropy sum
    ``h`` and the row's entropy (nats) is written to both ``kl_ptr`` and ``dkl_ptr``.
    """
    active = tl.load(mask_ptr + row) != 0
    a = tl.load(ids_ptr + row).to(tl.int64)
    bad = active & ((a < 0) | (a >= V))
    # Clamp before any read: an out-of-range id never leaves the row.
    a = tl.minimum(tl.maximum(a, 0), V - 1)
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    lse2 = shift_of(m_p) + tl.log2(s_p)
    lse = lse2 * LN2
    logp = _selected(p_row, a, stride_pv, t, lse2, active)
    nan = float("nan")
    logp = tl.where(bad, nan, logp)
    lse = tl.where(bad, nan, lse)
    tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
    tl.store(lse_ptr + row, tl.where(active, lse, 0.0))

    ratio = 1.0
    kl = 0.0
    dkl = 0.0
    if ENTROPY:  # entropy = lse - E_p[z] = (lse2 - h / s) ln 2
        kl = tl.where(bad, nan, (lse2 - m_r / s_p) * LN2)
        kl = tl.where(active, kl, 0.0)
        dkl = kl
    if KL_CODE != KL_NONE:
        if HAS_REF:
            ref_lse2 = shift_of(m_r) + tl.log2(s_r)
            logp_ref = _selected(r_row, a, stride_rv, t, ref_lse2, active)
            logp_ref = tl.where(bad, nan, logp_ref)
        else:
            logp_ref = tl.load(ref_logps_ptr + row, mask=active, other=0.0)
        old = tl.load(old_ptr + row, mask=active, other=0.0)
        ratio = tl.exp(logp - old)
        kl, dkl = kl_and_dkl(logp_ref - logp, KL_CODE)
        ratio = tl.where(active, ratio, 1.0)
        kl = tl.where(active, kl, 0.0)
        dkl = tl.where(active, dkl, 0.0)
    tl.store(ratio_ptr + row, ratio)
    tl.store(kl_ptr + row, kl)
    tl.store(dkl_ptr + row, dkl)


@triton.jit
def logp_forward_kernel(
    # inputs
    policy_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_pn, stride_pv)
    ref_ptr,  # [N, V] reference logits, strides (stride_rn, stride_rv); read iff HAS_REF
    ids_ptr,  # [N] int32/int64 action ids
    mask_ptr,  # [N] bool, nonzero = active row
    old_ptr,  # [N] f32 behaviour-policy log-probs; read iff KL_CODE != KL_NONE
    ref_logps_ptr,  # [N] f32 reference log-probs; read iff KL_CODE != KL_NONE and not HAS_REF
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    # outputs
    logp_ptr,  # [N] f32 log-prob of the action under the policy
    ratio_ptr,  # [N] f32 exp(logp - old); 1 when KL_CODE == KL_NONE
    kl_ptr,  # [N] f32 KL estimate on d = logp_ref - logp; 0 when KL_CODE == KL_NONE
    dkl_ptr,  # [N] f32 d kl / d logp (for the backward); 0 when KL_CODE == KL_NONE
    lse_ptr,  # [N] f32 logsumexp(policy / T) (for the backward)
    # sizes and strides (elements)
    V, stride_pn, stride_pv, stride_rn, stride_rv, stride_t,
    # compile-time options
    HAS_REF: tl.constexpr,  # reference logits given (else ref_logps, or none)
    KL_CODE: tl.constexpr,  # 0: log-prob only; 1/2/3: ratio and KL estimator k1/k2/k3
    ENTROPY: tl.constexpr,  # also the entropy, into kl_ptr and dkl_ptr (no ref, KL_CODE 0)
    TILES_PER_SPLIT: tl.constexpr,  # whole tiles per span (heuristics.split_plan)
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    k = LOG2E / t
    p_row = policy_ptr + row * stride_pn
    r_row = ref_ptr + row * stride_rn
    cols = tl.arange(0, BLOCK_V)
    n_full = tl.where(active, V // BLOCK_V, 0)  # inactive rows: no iteration
    ninf = -float("inf")
    # (m, s): the open span, folded from (-inf, 0) tile by tile as span_stats does; at the
    # end of each span it is folded into the row's (M, S) as logp_combine_kernel folds the
    # split partials, so both paths give the same bits. One loop keeps the loads pipelined.
    mp, sp, mr, sr = ninf, 0.0, ninf, 0.0
    m_p, s_p, m_r, s_r = ninf, 0.0, ninf, 0.0
    if ENTROPY:  # the same spans, each folded lane by lane (entropy_span_stats); h in m_r
        h_p = 0.0
        ml, sl, hl = empty_lanes(BLOCK_V)
        for b in tl.range(0, n_full, num_stages=STREAM_STAGES):
            ml, sl, hl = tile_lanes(p_row, b, stride_pv, k, ml, sl, hl, BLOCK_V)
            if (b % TILES_PER_SPLIT) == TILES_PER_SPLIT - 1:  # a span ends: its lanes meet
                fm, fs, fh = fold_lanes(ml, sl, hl)
                m_p, s_p, h_p = fold_lse2_h(m_p, s_p, h_p, fm, fs, fh)
                ml, sl, hl = empty_lanes(BLOCK_V)
        if V % BLOCK_V != 0:
            ml, sl, hl = entropy_tail_lanes(p_row, V, stride_pv, k, active, ml, sl, hl, BLOCK_V)
        if ((V % BLOCK_V) != 0) | ((n_full % TILES_PER_SPLIT) != 0):  # the open span
            fm, fs, fh = fold_lanes(ml, sl, hl)
            m_p, s_p, h_p = fold_lse2_h(m_p, s_p, h_p, fm, fs, fh)
        forward_epilogue(
            row, p_row, r_row, ids_ptr, mask_ptr, old_ptr, ref_logps_ptr, temp_ptr,
            logp_ptr, ratio_ptr, kl_ptr, dkl_ptr, lse_ptr,
            V, stride_pv, stride_rv, stride_t, m_p, s_p, h_p, 0.0, False, 0, True,
        )
    else:
        for b in tl.range(0, n_full, num_stages=STREAM_STAGES):
            offs = (b * BLOCK_V + cols).to(tl.int64)
            mp, sp = lse_step(tl.load(p_row + offs * stride_pv).to(tl.float32) * k, mp, sp)
            if HAS_REF:
                mr, sr = lse_step(tl.load(r_row + offs * stride_rv).to(tl.float32) * k, mr, sr)
            end = (b % TILES_PER_SPLIT) == TILES_PER_SPLIT - 1
            fm, fs = fold_lse2(m_p, s_p, mp, sp)
            m_p, s_p = tl.where(end, fm, m_p), tl.where(end, fs, s_p)
            mp, sp = tl.where(end, ninf, mp), tl.where(end, 0.0, sp)
            if HAS_REF:
                fm, fs = fold_lse2(m_r, s_r, mr, sr)
                m_r, s_r = tl.where(end, fm, m_r), tl.where(end, fs, s_r)
                mr, sr = tl.where(end, ninf, mr), tl.where(end, 0.0, sr)
        # The last span: the tail (if any) joins it; fold it unless it is empty.
        if V % BLOCK_V != 0:
            mp, sp, _, mr, sr = tail_stats(
                p_row, r_row, V, stride_pv, stride_rv, k, active, mp, sp, 0.0, mr, sr,
                HAS_REF, False, BLOCK_V, "",
            )
        open_span = ((V % BLOCK_V) != 0) | ((n_full % TILES_PER_SPLIT) != 0)
        fm, fs = fold_lse2(m_p, s_p, mp, sp)
        m_p, s_p = tl.where(open_span, fm, m_p), tl.where(open_span, fs, s_p)
        fm, fs = fold_lse2(m_r, s_r, mr, sr)
        m_r, s_r = tl.where(open_span, fm, m_r), tl.where(open_span, fs, s_r)
        forward_epilogue(
            row, p_row, r_row, ids_ptr, mask_ptr, old_ptr, ref_logps_ptr, temp_ptr,
            logp_ptr, ratio_ptr, kl_ptr, dkl_ptr, lse_ptr,
            V, stride_pv, stride_rv, stride_t, m_p, s_p, m_r, s_r, HAS_REF, KL_CODE, False,
        )
