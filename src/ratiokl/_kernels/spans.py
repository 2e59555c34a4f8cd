"""A row's span statistics: whole tiles and the masked tail folded into running sums.

A span is a run of whole tiles of one row (``heuristics.split_plan``), the masked tail
joining the row's last span (:func:`split_span`). Its partial is the base-2 log-sum-exp's
running ``(max, sum)`` of the policy row (and of the reference row) and, for the entropy,
the policy's ``h = sum 2^(x - m) x``, each span folded from ``(-inf, 0, 0)``: by whole
tiles (:func:`span_stats`), or lane by lane inside each thread (:func:`entropy_span_stats`).
Every kernel that reads a span -- the row forward (:mod:`ratiokl._kernels.forward`), the
split forward, the fused loss -- folds it with these functions, so a span's partial has
the same bits whichever kernel read it.
"""

import triton
import triton.language as tl

from ratiokl._kernels.numerics import (
    LANE,
    STREAM_STAGES,
    fold_lanes,
    lane_lse_h_step,
    lse_h_step,
    lse_step,
)

__all__ = [
    "empty_lanes", "entropy_span_stats", "entropy_tail_lanes", "fold_tile", "lane_offsets",
    "span_stats", "split_span", "tail_stats", "tile_lanes",
]


@triton.jit
def fold_tile(x, m, s, h, ENTROPY: tl.constexpr):
    """One tile into the running ``(m, s)`` and, with ``ENTROPY``, the entropy's sum ``h``."""
    if ENTROPY:
        m, s, h = lse_h_step(x, m, s, h)
    else:
        m, s = lse_step(x, m, s)
    return m, s, h


@triton.jit
def tail_stats(p_row, r_row, V, stride_pv, stride_rv, k, on, m_p, s_p, h_p, m_r, s_r,
               HAS_REF: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
               EVICT: tl.constexpr):
    """Fold the masked tail tile (``V % BLOCK_V`` columns; none read unless ``on``)."""
    offs = ((V // BLOCK_V) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    tail = (offs < V) & on
    x = tl.load(p_row + offs * stride_pv, mask=tail, other=-float("inf"), eviction_policy=EVICT)
    m_p, s_p, h_p = fold_tile(x.to(tl.float32) * k, m_p, s_p, h_p, ENTROPY)
    if HAS_REF:
        y = tl.load(r_row + offs * stride_rv, mask=tail, other=-float("inf"),
                    eviction_policy=EVICT)
        m_r, s_r = lse_step(y.to(tl.float32) * k, m_r, s_r)
    return m_p, s_p, h_p, m_r, s_r


@triton.jit
def span_stats(
    p_row, r_row, V, stride_pv, stride_rv, k, t0, t1, tail_on,
    HAS_REF: tl.constexpr, ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, EVICT: tl.constexpr,
):
    """``(m_p, s_p, h_p, m_r, s_r)`` of whole tiles ``[t0, t1)`` and, if ``tail_on``, the tail.

    A split's partial base-2 log-sum-exp of the policy row (and of the reference row,
    with ``HAS_REF``; else ``(-inf, 0)``) and, with ``ENTROPY``, the policy's entropy sum
    ``h_p = sum exp2(x - shift) x`` (``numerics.lse_h_step``; else 0), folded tile by
    tile from ``(-inf, 0, 0)`` exactly as ``logp_forward_kernel`` folds the same span,
    so the partial's bits do not depend on the kernel. ``(m_p, s_p)`` have the same bits
    with or without ``ENTROPY``. ``EVICT``: the loads' L2 eviction hint (``""``: none;
    the fused loss keeps the rows it is about to re-read with ``"evict_last"``).
    """
    cols = tl.arange(0, BLOCK_V)
    m_p = -float("inf")
    s_p = 0.0
    h_p = 0.0
    m_r = -float("inf")
    s_r = 0.0
    for b in tl.range(t0, t1, num_stages=STREAM_STAGES):
        offs = (b * BLOCK_V + cols).to(tl.int64)
        x = tl.load(p_row + offs * stride_pv, eviction_policy=EVICT).to(tl.float32) * k
        m_p, s_p, h_p = fold_tile(x, m_p, s_p, h_p, ENTROPY)
        if HAS_REF:
            y = tl.load(r_row + offs * stride_rv, eviction_policy=EVICT).to(tl.float32) * k
            m_r, s_r = lse_step(y, m_r, s_r)
    if V % BLOCK_V != 0:
        if tail_on:
            m_p, s_p, h_p, m_r, s_r = tail_stats(
                p_row, r_row, V, stride_pv, stride_rv, k, tail_on, m_p, s_p, h_p, m_r, s_r,
                HAS_REF, ENTROPY, BLOCK_V, EVICT,
            )
    return m_p, s_p, h_p, m_r, s_r


@triton.jit
def lane_offsets(b, BLOCK_V: tl.constexpr):
    """Offsets of tile ``b``'s columns as ``[BLOCK_V // LANE, LANE]``: a lane per row."""
    lanes = tl.arange(0, BLOCK_V // LANE)
    return (b * BLOCK_V + lanes[:, None] * LANE + tl.arange(0, LANE)[None, :]).to(tl.int64)


@triton.jit
def empty_lanes(BLOCK_V: tl.constexpr):
    """Per-lane ``(m, s, h) = (-inf, 0, 0)`` of a tile's ``BLOCK_V // LANE`` lanes."""
    zero = tl.full((BLOCK_V // LANE,), 0.0, tl.float32)
    return tl.full((BLOCK_V // LANE,), -float("inf"), tl.float32), zero, zero


@triton.jit
def tile_lanes(p_row, b, stride_pv, k, m, s, h, BLOCK_V: tl.constexpr):
    """Fold whole tile ``b`` of the policy row into the lanes (``numerics.lane_lse_h_step``)."""
    x = tl.load(p_row + lane_offsets(b, BLOCK_V) * stride_pv).to(tl.float32)
    return lane_lse_h_step(x, k, m, s, h)


@triton.jit
def entropy_tail_lanes(p_row, V, stride_pv, k, on, m, s, h, BLOCK_V: tl.constexpr):
    """Fold the masked tail tile into the lanes (nothing read unless ``on``)."""
    offs = lane_offsets(V // BLOCK_V, BLOCK_V)
    x = tl.load(p_row + offs * stride_pv, mask=(offs < V) & on, other=-float("inf"))
    return lane_lse_h_step(x.to(tl.float32), k, m, s, h)


@triton.jit
def entropy_span_stats(p_row, V, stride_pv, k, t0, t1, tail_on, BLOCK_V: tl.constexpr):
    """``(m, s, h)`` of the policy row's whole tiles ``[t0, t1)`` and, if ``tail_on``, the tail.

    The entropy forward's span partial (no reference): folded lane by lane
    (``numerics.lane_lse_h_step``) from ``(-inf, 0, 0)`` and the lanes met at the end
    (``numerics.fold_lanes``), exactly as ``logp_forward_kernel`` folds the same span, so
    the partial's bits do not depend on the kernel. Summed in another order than
    :func:`span_stats`, so its ``(m, s)`` may differ from the plain forward's in the last
    bits.
    """
    m, s, h = empty_lanes(BLOCK_V)
    for b in tl.range(t0, t1, num_stages=STREAM_STAGES):
        m, s, h = tile_lanes(p_row, b, stride_pv, k, m, s, h, BLOCK_V)
    if V % BLOCK_V != 0:
        if tail_on:
            m, s, h = entropy_tail_lanes(p_row, V, stride_pv, k, tail_on, m, s, h, BLOCK_V)
    return fold_lanes(m, s, h)


@triton.jit
def split_span(split, V, active, TILES_PER_SPLIT: tl.constexpr, BLOCK_V: tl.constexpr):
    """Whole tiles ``[t0, t1)`` of split ``split``; whether it owns the tail (never if inactive)."""
    n_full = V // BLOCK_V
    t0 = split * TILES_PER_SPLIT
    t1 = tl.where(active, tl.minimum(t0 + TILES_PER_SPLIT, n_full), t0)
    tail_on = active & (n_full >= t0) & (n_full < t0 + TILES_PER_SPLIT)
    return t0, t1, tail_on
