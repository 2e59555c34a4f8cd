"""A fused-kernel row's statistics from its spans, and the meeting of a row's programs.

A row of the fused policy-loss kernel (:mod:`ratiokl._kernels.fused_loss`) is cut into
``SPLITS`` spans (``heuristics.launch_plan``). Each span's partial is ``(m, s, h)`` of the
policy (the running max and sum of the log-sum-exp in base 2, and the entropy sum ``h = sum
2^(x - m) x``) and ``(m, s)`` of the reference:

* a program that owns its whole row folds every span in registers (:func:`row_partials`);
* programs that share a row publish their spans' partials (:func:`publish`) and meet at a
  device-side counter (:func:`meet`), which also combines them;
* either way the same vectors reach the same :func:`combine`: the same bits.

Triton's interpreter runs programs one after the other, so a program waiting at the meeting
would wait forever: :func:`stand_in_meeting` (interpreter only) orders a shared row's
programs and publishes the partials the others would have, and the kernel's own code runs
as on the GPU.
"""

import triton
import triton.language as tl

from ratiokl._kernels.spans import span_stats, split_span, tail_stats
from ratiokl._kernels.numerics import INTERPRETED, STREAM_STAGES, lse_h_step, lse_step, shift_of

__all__ = ["PARTIAL_FIELDS", "combine", "meet", "publish", "row_partials", "stand_in_meeting"]

#: Fields of a span's partial in the scratch ``part_ptr`` ``[N, SPLITS, PARTIAL_FIELDS]``:
#: the policy's ``(m, s)``, the reference's ``(m, s)``, the policy's entropy sum ``h``.
PARTIAL_FIELDS = tl.constexpr(5)


@triton.jit
def combine(ms, ss, hs, ENTROPY: tl.constexpr):
    """``(lse2, mean2)`` of a row's span partials ``(m_k, s_k, h_k)`` (vectors over spans).

    ``lse2 = log2(sum_k s_k 2^m_k)`` and, with ``ENTROPY``, ``mean2 = sum_k h_k 2^m_k /
    sum_k s_k 2^m_k``, the mean of ``x`` (base-2 units) under the row's softmax (else 0):
    the entropy is ``(lse2 - mean2) ln 2``. One max and one sum (two) over the spans, in a
    fixed order for a given launch configuration; unused lanes hold ``(-inf, 0, 0)``.
    """
    shift = shift_of(tl.max(ms, axis=0))
    scale = tl.exp2(ms - shift)
    total = tl.sum(ss * scale, axis=0)
    mean2 = 0.0
    if ENTROPY:
        mean2 = tl.sum(hs * scale, axis=0) / total
    return shift + tl.log2(total), mean2


@triton.jit
def row_partials(p_row, r_row, V, stride_pv, stride_rv, k, active, HAS_REF: tl.constexpr,
                  SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
                  EVICT: tl.constexpr):
    """Every span's partial of a row its program owns, in one pipelined loop over the row.

    Returns ``(ms_p, ss_p, hs_p, ms_r, ss_r)``, one lane per span (unused lanes
    ``(-inf, 0, 0)``), each span folded tile by tile from ``(-inf, 0, 0)`` exactly as
    :func:`~ratiokl._kernels.spans.span_stats` folds it -- the same bits as the
    meeting's published partials -- but with no pipeline drain at span ends (a loop per
    span restarted the loads ``SPLITS`` times a row). The masked tail joins the last
    span, as ``split_span`` assigns it. An inactive row reads nothing.
    """
    spans = tl.arange(0, triton.next_power_of_2(SPLITS))
    ms_p = tl.full(spans.shape, -float("inf"), tl.float32)
    ss_p = tl.zeros(spans.shape, tl.float32)
    hs_p = tl.zeros(spans.shape, tl.float32)
    ms_r = tl.full(spans.shape, -float("inf"), tl.float32)
    ss_r = tl.zeros(spans.shape, tl.float32)
    ninf = -float("inf")
    m_p, s_p, h_p, m_r, s_r = ninf, 0.0, 0.0, ninf, 0.0
    cols = tl.arange(0, BLOCK_V)
    n_full = tl.where(active, V // BLOCK_V, 0)
    for b in tl.range(0, n_full, num_stages=STREAM_STAGES):
        offs = (b * BLOCK_V + cols).to(tl.int64)
        x = tl.load(p_row + offs * stride_pv, eviction_policy=EVICT).to(tl.float32) * k
        m_p, s_p, h_p = lse_h_step(x, m_p, s_p, h_p)
        if HAS_REF:
            y = tl.load(r_row + offs * stride_rv, eviction_policy=EVICT).to(tl.float32) * k
            m_r, s_r = lse_step(y, m_r, s_r)
        end = (b % TILES_PER_SPLIT) == TILES_PER_SPLIT - 1
        here = end & (spans == b // TILES_PER_SPLIT)
        ms_p, ss_p = tl.where(here, m_p, ms_p), tl.where(here, s_p, ss_p)
        hs_p = tl.where(here, h_p, hs_p)
        ms_r, ss_r = tl.where(here, m_r, ms_r), tl.where(here, s_r, ss_r)
        m_p, s_p, h_p = tl.where(end, ninf, m_p), tl.where(end, 0.0, s_p), tl.where(end, 0.0, h_p)
        m_r, s_r = tl.where(end, ninf, m_r), tl.where(end, 0.0, s_r)
    if V % BLOCK_V != 0:
        m_p, s_p, h_p, m_r, s_r = tail_stats(p_row, r_row, V, stride_pv, stride_rv, k, active,
                                             m_p, s_p, h_p, m_r, s_r, HAS_REF, True, BLOCK_V,
                                             EVICT)
    # The open span (whole tiles short of a span, or the tail): the row's last.
    if ((V % BLOCK_V) != 0) | (((V // BLOCK_V) % TILES_PER_SPLIT) != 0):
        here = active & (spans == (V // BLOCK_V) // TILES_PER_SPLIT)
        ms_p, ss_p = tl.where(here, m_p, ms_p), tl.where(here, s_p, ss_p)
        hs_p = tl.where(here, h_p, hs_p)
        ms_r, ss_r = tl.where(here, m_r, ms_r), tl.where(here, s_r, ss_r)
    return ms_p, ss_p, hs_p, ms_r, ss_r


@triton.jit
def publish(part_ptr, row, span, m_p, s_p, h_p, m_r, s_r, SPLITS: tl.constexpr):
    """Store span ``span``'s partial at ``part[row, span]`` (``PARTIAL_FIELDS`` floats)."""
    part = part_ptr + (row * SPLITS + span) * PARTIAL_FIELDS
    tl.store(part, m_p)
    tl.store(part + 1, s_p)
    tl.store(part + 2, m_r)
    tl.store(part + 3, s_r)
    tl.store(part + 4, h_p)


@triton.jit
def meet(part_ptr, count_ptr, row, active, wait, HAS_REF: tl.constexpr,
          SPLITS: tl.constexpr, SPANS: tl.constexpr):
    """Publish this program's ``SPANS`` partials, wait for the row's ``SPLITS``, combine them.

    For rows shared by several programs (``SPANS < SPLITS``). The partials
    ``part[row, s] = (m_p, s_p, m_r, s_r, h_p)`` were stored just before; a barrier
    orders every thread's stores before the release of the row's counter,
    which counts the spans published, and the program waits until all
    ``SPLITS`` are (acquire). The partials are read back with ``.cg`` (from
    L2, never a stale L1 line). Every program of a row combines the same
    values the same way, so all get the same bits, whichever program computed
    which span. Inactive rows publish nothing and wait for nothing; a program
    that does not ``wait`` (it needs no statistics) only publishes, and its
    combination is not used. Returns ``(lse2, mean2, ref_lse2)`` (:func:`combine`).
    """
    if active:
        tl.debug_barrier()  # every thread's partial stores precede the release
        tl.atomic_add(count_ptr + row, SPANS, sem="release")
        if wait:
            seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
            if INTERPRETED:  # nothing else runs meanwhile: see stand_in_meeting
                tl.device_assert(seen >= SPLITS, "interpreter: the row's spans are missing")
            while seen < SPLITS:
                seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
    spans = tl.arange(0, triton.next_power_of_2(SPLITS))
    part = part_ptr + (row * SPLITS + spans) * PARTIAL_FIELDS
    ok = (spans < SPLITS) & active
    ref_lse2 = -float("inf")
    if HAS_REF:
        ms_r = tl.load(part + 2, mask=ok, other=-float("inf"), cache_modifier=".cg")
        ss_r = tl.load(part + 3, mask=ok, other=0.0, cache_modifier=".cg")
        ref_lse2, _ = combine(ms_r, ss_r, ss_r, False)
    lse2, mean2 = combine(tl.load(part, mask=ok, other=-float("inf"), cache_modifier=".cg"),
                           tl.load(part + 1, mask=ok, other=0.0, cache_modifier=".cg"),
                           tl.load(part + 4, mask=ok, other=0.0, cache_modifier=".cg"), True)
    return lse2, mean2, ref_lse2


@triton.jit
def stand_in_meeting(p_row, r_row, part_ptr, count_ptr, row, own, a, active, k, V,
                      stride_pv, stride_rv, HAS_REF: tl.constexpr, SPLITS: tl.constexpr,
                      TILES_PER_SPLIT: tl.constexpr, SPANS: tl.constexpr,
                      BLOCK_V: tl.constexpr):
    """Interpreter only: run a shared row's programs in an order the meeting allows.

    Triton's interpreter runs programs one after the other, so a program that
    waited at the meeting for its row's other programs would wait forever.
    Here the row's programs take their spans starting after the span that
    holds the action (whose logit every program reads before the meeting, and
    which, in the in-place mode, its own program overwrites), and the row's
    first program to run also computes and publishes the partials of the
    row's other spans, as those programs would have before the meeting on a
    GPU. Every later program recomputes its own partial (the same bits) and
    finds the row complete: the kernel's own code -- work counter, publish,
    release, acquire, the combine read from memory, one span's gradient --
    runs as on the GPU. Returns this program's first span.
    """
    ROW_PROGRAMS: tl.constexpr = SPLITS // SPANS
    action_program = (a // BLOCK_V) // TILES_PER_SPLIT // SPANS
    first = ((own + action_program + 1) % ROW_PROGRAMS) * SPANS
    if active & (own == 0):
        for s in range(0, SPLITS):
            if (s < first) | (s >= first + SPANS):
                t0, t1, tail_on = split_span(s, V, active, TILES_PER_SPLIT, BLOCK_V)
                m_p, s_p, h_p, m_r, s_r = span_stats(p_row, r_row, V, stride_pv, stride_rv,
                                                     k, t0, t1, tail_on, HAS_REF, True,
                                                     BLOCK_V, "")
                publish(part_ptr, row, s, m_p, s_p, h_p, m_r, s_r, SPLITS)
        tl.atomic_add(count_ptr + row, SPLITS - SPANS)
    return first
