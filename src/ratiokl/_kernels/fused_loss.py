"""Fused policy-loss kernels: loss, metrics pieces and the policy-logit gradient in one program.

``policy_loss_kernel`` -- a row of ``[N, V]`` logits is cut into ``SPLITS``
spans of whole tiles (:func:`launch_plan`); on a GPU each span has its own
program, which

1. reads its span once for the partial log-sum-exp (the policy's, and the
   reference's in the same pass when reference logits are given) and the
   policy's entropy sum ``h = sum 2^(x - m) x`` (one more FMA per element, no
   more bytes) -- the forward kernel's ``span_stats`` -- and publishes them;
2. meets the row's other programs at a device-side counter and combines
   the ``SPLITS`` partials (``_meet``), all programs the same way, into the
   row's log-sum-exp and entropy ``H = lse - E_p[x / T]``;
3. computes the per-token objective of ``ratiokl.spec.policy_loss``
   (token-level ratio, ``objective.token_objective``) and its derivative
   ``dL/dlogp`` in registers, and with ``ENTROPY_GRAD`` the entropy bonus
   ``- entropy_coef * H``;
4. right away, while its span is still in L2, writes
   ``grad = w * dL/dlogp * (onehot(a) - p) / T + e * p * (log p + H)`` on the
   span in the logits' dtype, where ``p = softmax(x / T)``, ``w`` is the row's
   aggregation weight ``a_t / D`` and ``e = entropy_coef * w / T`` (the second
   term only with ``ENTROPY_GRAD``: ``dH/dx = -p (log p + H) / T``) -- unless
   ``WRITE_GRAD`` is off (no gradient wanted: the row is read once and the
   forward's memory is O(N)).

Spans are small so that the spans in flight fit in L2 and the second read
comes from L2 rather than HBM (on the H200 the kernel takes 1.60 ms against
1.16 for one read and one write of the logits: :func:`launch_plan`). The
wait is safe without a cooperative launch: work is taken in order from a
device counter, so a program only waits for spans that running programs
have taken or will take (the pattern of single-pass decoupled look-back
scans); it needs a row's programs resident together, ``SPLITS`` small
programs. A program that owns a whole row (``SPANS = SPLITS``: a row of one
span, or no gradient wanted and enough rows) keeps its partials in registers
and meets no one. Triton's
interpreter runs the GPU's plan too: programs run one after the other
there, so ``_stand_in_meeting`` orders a shared row's programs and
publishes the partials the others would have before the meeting. The
backward is ``scale_rows_kernel``, a
per-row scale of the stored gradient by the upstream value that skips rows
whose upstream value is exactly 1 (the usual ``loss.backward()``) and
inactive rows.

Inactive rows read nothing, write the neutral per-row values
(``loss = logp = kl = entropy = 0``, ``ratio = 1``, no clip bits) and an
exact-zero gradient row. An active row with an id outside ``[0, V)`` reads the clamped
id and is poisoned (NaN loss, metrics pieces and gradient), like the
forward kernel.
"""

import functools
from typing import NamedTuple

import triton
import triton.language as tl

from ratiokl._kernels.codes import KL_NONE
from ratiokl._kernels.backward import grad_span
from ratiokl._kernels.forward import span_stats, split_span, tail_stats
from ratiokl._kernels.heuristics import (
    LaunchConfig,
    SplitPlan,
    forward_config,
    split_plan,
    use_split_forward,
)
from ratiokl._kernels.numerics import (
    INTERPRETED,
    LN2,
    LOG2E,
    STREAM_STAGES,
    lse_h_step,
    lse_step,
    shift_of,
    to_storage,
)
from ratiokl._kernels.objective import token_objective

#: Spans of a row in the fused kernel (fewer when the row has fewer tiles).
_SPLITS = 10
#: Fields of a span's partial in the scratch ``part_ptr`` ``[N, SPLITS, PARTIAL_FIELDS]``:
#: the policy's ``(m, s)``, the reference's ``(m, s)``, the policy's entropy sum ``h``.
PARTIAL_FIELDS = tl.constexpr(5)


class FusedPlan(NamedTuple):
    """Launch of the fused kernel: tile and warps, the row's spans, spans per program."""

    config: LaunchConfig
    spans: SplitPlan
    spans_per_program: int

    @property
    def row_programs(self) -> int:
        """Programs per row (1: a program per row, no device counter)."""
        return self.spans.splits // self.spans_per_program

    def programs(self, n_rows: int) -> int:
        """Programs of the launch: one per (row, group of ``spans_per_program`` spans)."""
        return n_rows * self.row_programs

    def counters(self, n_rows: int) -> int:
        """int32 counters the launch needs zeroed (``count_ptr``): ``n_rows + 1``, or none
        (0) with a program per row, which takes its row by program id and waits for none."""
        return n_rows + 1 if self.row_programs > 1 else 0


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def launch_plan(vocab: int, itemsize: int, n_rows: int, write_grad: bool) -> FusedPlan:
    """How the fused kernel cuts a row: ``_SPLITS`` spans, one program each (on a GPU).

    A row's programs each read their span (the log-sum-exp partials), meet at
    a device-side counter to combine the row's statistics, then write their
    span's gradient while it is still in L2. On the H200 (bf16, N = 8192,
    V = 151,936) 10 spans of 4096 x 4 warps were the best of the plans tried;
    one program per row and spans held in registers were slower, and without
    a gradient one program per row is best once enough rows fill the GPU
    (``heuristics.use_split_forward``): the measurements are in
    docs/performance.md ("Experiments retired from benchmarks/"). The plan is
    the same on a GPU and in Triton's interpreter.
    The spans depend only on ``V`` and the element size and every program
    combines them the same way: no launch changes a bit (batch invariance).
    """
    config = forward_config(vocab, itemsize)
    spans = split_plan(vocab, config.block_v, _SPLITS)
    whole_rows = not (write_grad or use_split_forward(n_rows, spans))
    return FusedPlan(config, spans, spans.splits if whole_rows else 1)


#: Warps of ``scale_rows_kernel`` (a plain streaming read-modify-write).
SCALE_WARPS = 8


def scale_block(vocab: int) -> int:
    """``scale_rows_kernel``'s tile: the row rounded up to a power of two, 16 to 4096."""
    return min(4096, max(16, 1 << (vocab - 1).bit_length()))


@triton.jit
def _combine(ms, ss, hs, ENTROPY: tl.constexpr):
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
def _row_partials(p_row, r_row, V, stride_pv, stride_rv, k, active, HAS_REF: tl.constexpr,
                  SPLITS: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, BLOCK_V: tl.constexpr,
                  EVICT: tl.constexpr):
    """Every span's partial of a row its program owns, in one pipelined loop over the row.

    Returns ``(ms_p, ss_p, hs_p, ms_r, ss_r)``, one lane per span (unused lanes
    ``(-inf, 0, 0)``), each span folded tile by tile from ``(-inf, 0, 0)`` exactly as
    :func:`~ratiokl._kernels.forward.span_stats` folds it -- the same bits as the
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
def _publish(part_ptr, row, span, m_p, s_p, h_p, m_r, s_r, SPLITS: tl.constexpr):
    """Store span ``span``'s partial at ``part[row, span]`` (``PARTIAL_FIELDS`` floats)."""
    part = part_ptr + (row * SPLITS + span) * PARTIAL_FIELDS
    tl.store(part, m_p)
    tl.store(part + 1, s_p)
    tl.store(part + 2, m_r)
    tl.store(part + 3, s_r)
    tl.store(part + 4, h_p)


@triton.jit
def _meet(part_ptr, count_ptr, row, active, wait, HAS_REF: tl.constexpr,
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
    combination is not used. Returns ``(lse2, mean2, ref_lse2)`` (:func:`_combine`).
    """
    if active:
        tl.debug_barrier()  # every thread's partial stores precede the release
        tl.atomic_add(count_ptr + row, SPANS, sem="release")
        if wait:
            seen = tl.atomic_add(count_ptr + row, 0, sem="acquire")
            if INTERPRETED:  # nothing else runs meanwhile: see _stand_in_meeting
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
        ref_lse2, _ = _combine(ms_r, ss_r, ss_r, False)
    lse2, mean2 = _combine(tl.load(part, mask=ok, other=-float("inf"), cache_modifier=".cg"),
                           tl.load(part + 1, mask=ok, other=0.0, cache_modifier=".cg"),
                           tl.load(part + 4, mask=ok, other=0.0, cache_modifier=".cg"), True)
    return lse2, mean2, ref_lse2


@triton.jit
def _stand_in_meeting(p_row, r_row, part_ptr, count_ptr, row, own, a, active, k, V,
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
                _publish(part_ptr, row, s, m_p, s_p, h_p, m_r, s_r, SPLITS)
        tl.atomic_add(count_ptr + row, SPLITS - SPANS)
    return first


@triton.jit
def policy_loss_kernel(
    # inputs
    policy_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_pn, stride_pv);
    # overwritten by the gradient when grad_ptr is policy_ptr (inplace_grad)
    ref_ptr,  # [N, V] reference logits, strides (stride_rn, stride_rv); read iff HAS_REF
    ids_ptr,  # [N] int32/int64 action ids
    mask_ptr,  # [N] bool, nonzero = active row
    old_ptr,  # [N] f32 behaviour-policy log-probs; read iff not ON_POLICY
    ref_logps_ptr,  # [N] f32 reference log-probs; read iff KL_CODE != KL_NONE and not HAS_REF
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    adv_ptr,  # [N // adv_rows] f32 advantages: row i reads adv[i // adv_rows]
    iw_ptr,  # [N] f32 importance weights; read iff HAS_IW
    w_ptr,  # [N] f32 aggregation weight a_t / D (0 on inactive rows)
    coef_ptr,  # [5] f32 (kl_coef, 1 - clip_eps, min(1 + clip_eps_high, ratio_cap), neg_cap,
    # entropy_coef); entropy_coef read iff ENTROPY_GRAD
    # outputs
    loss_ptr,  # [N] f32 w * loss_t (the loss is their sum)
    logp_ptr,  # [N] f32 log-prob of the action under the policy
    ratio_ptr,  # [N] f32 r = exp(bounded logp - old)
    kl_ptr,  # [N] f32 KL value of the chosen variant (0 when KL_CODE == KL_NONE)
    ent_ptr,  # [N] f32 entropy H of the row's softmax(x / T) (nats)
    clip_ptr,  # [N] int32 clip bits (CLIP_LOW | CLIP_HIGH | CLIP_CAPPED)
    grad_ptr,  # [N, V] d(sum of loss_ptr)/d policy, logits' dtype, row-major (row stride V);
    # written iff WRITE_GRAD (may be policy_ptr itself: each tile is read before it is written)
    part_ptr,  # [N, SPLITS, PARTIAL_FIELDS] f32 scratch: each span's (m_p, s_p, m_r, s_r, h_p)
    count_ptr,  # [N + 1] int32, zero at launch: spans published per row; [N]: work taken
    # (never touched with one program per row: any int32 buffer)
    # sizes and strides (elements)
    N,
    V: tl.constexpr,  # a constant in both launches: 2.29 -> 1.81 ms at the headline shape
    stride_pn,
    stride_pv,
    stride_rn,
    stride_rv,
    stride_t,
    adv_rows,  # rows per advantage: 1, or T (one per sequence of T rows: no copy)
    # compile-time options (fixed for a run)
    HAS_REF: tl.constexpr,  # reference logits given (else ref_logps, or no reference)
    HAS_IW: tl.constexpr,  # importance weights given
    KL_CODE: tl.constexpr,  # 0: no reference (kl = 0); 1..6: POLICY_KL_ESTIMATORS
    HAS_NEG_CAP: tl.constexpr,  # coef_ptr[3] = min(dual_clip, ratio_cap) caps A < 0
    BOUND: tl.constexpr,  # log_ratio_bound; 0: no bound
    OBJECTIVE: tl.constexpr,  # OBJECTIVES: 0 PPO, 1 CISPO
    ON_POLICY: tl.constexpr,  # no old log-probs: old = sg(logp), r = 1 (dr/dlogp = 1)
    ENTROPY_GRAD: tl.constexpr,  # entropy_coef may be non-zero: - coef * H in loss and gradient
    WRITE_GRAD: tl.constexpr,  # False: no gradient wanted, the row is read once (forward only)
    SPLITS: tl.constexpr,  # spans of a row (launch_plan)
    TILES_PER_SPLIT: tl.constexpr,  # whole tiles per span
    SPANS: tl.constexpr,  # spans per program: 1 (GPU), or SPLITS (one program per row)
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    # Work is taken in order from a device counter, not by program id: a program
    # waits only for spans already taken or still to be taken, never for a
    # program the GPU has not started, so it needs a row's programs resident.
    # A program per row waits for nothing and takes its row by program id.
    ROW_PROGRAMS: tl.constexpr = SPLITS // SPANS
    if ROW_PROGRAMS == 1:
        item = tl.program_id(0).to(tl.int64)
    else:
        item = tl.atomic_add(count_ptr + N, 1).to(tl.int64)
    row = item // ROW_PROGRAMS
    first = (item % ROW_PROGRAMS) * SPANS
    active = tl.load(mask_ptr + row) != 0
    a = tl.load(ids_ptr + row).to(tl.int64)
    bad = active & ((a < 0) | (a >= V))
    a = tl.minimum(tl.maximum(a, 0), V - 1)  # clamp before any read
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    k = LOG2E / t
    p_row = policy_ptr + row * stride_pn
    r_row = ref_ptr + row * stride_rn
    if INTERPRETED:
        if ROW_PROGRAMS > 1:
            first = _stand_in_meeting(p_row, r_row, part_ptr, count_ptr, row,
                                      item % ROW_PROGRAMS, a, active, k, V, stride_pv,
                                      stride_rv, HAS_REF, SPLITS, TILES_PER_SPLIT, SPANS,
                                      BLOCK_V)
    # The action's logits, read before this program publishes: in the in-place mode the
    # span holding them is overwritten by its program once every program has published.
    x_a = tl.load(p_row + a * stride_pv, mask=active, other=0.0).to(tl.float32)
    y_a = 0.0
    if HAS_REF:
        y_a = tl.load(r_row + a * stride_rv, mask=active, other=0.0).to(tl.float32)
    # The row's other inputs, requested now so that their latency hides behind pass 1
    # (any row's are valid addresses; an inactive row's values are never selected).
    logp_ref = 0.0
    if KL_CODE != KL_NONE:
        if not HAS_REF:
            logp_ref = tl.load(ref_logps_ptr + row)
    old = 0.0
    if not ON_POLICY:
        old = tl.load(old_ptr + row)
    adv = tl.load(adv_ptr + row // adv_rows)
    iw = 1.0
    if HAS_IW:
        iw = tl.load(iw_ptr + row)
    w = tl.load(w_ptr + row)
    # Pass 1: this program's spans of the row's log-sum-exp(s) and entropy sum, kept in L2
    # if re-read soon. A program that owns its row keeps the partials in registers (lanes of
    # one vector per field); a shared row publishes them for the meeting. Either way the
    # same vectors reach the same _combine: the same bits.
    EVICT_1: tl.constexpr = "evict_last" if WRITE_GRAD else ""
    if ROW_PROGRAMS == 1:
        ms_p, ss_p, hs_p, ms_r, ss_r = _row_partials(
            p_row, r_row, V, stride_pv, stride_rv, k, active, HAS_REF, SPLITS,
            TILES_PER_SPLIT, BLOCK_V, EVICT_1
        )
    else:
        for j in range(0, SPANS):
            t0, t1, tail_on = split_span(first + j, V, active, TILES_PER_SPLIT, BLOCK_V)
            m_p, s_p, h_p, m_r, s_r = span_stats(
                p_row, r_row, V, stride_pv, stride_rv, k, t0, t1, tail_on, HAS_REF, True,
                BLOCK_V, EVICT_1
            )
            _publish(part_ptr, row, first + j, m_p, s_p, h_p, m_r, s_r, SPLITS)
    if ROW_PROGRAMS == 1:
        lse2, mean2 = _combine(ms_p, ss_p, hs_p, True)
        ref_lse2 = -float("inf")
        if HAS_REF:
            ref_lse2, _ = _combine(ms_r, ss_r, ss_r, False)
    else:
        # Without a gradient only the row's first program (which stores the row's values)
        # waits.
        lse2, mean2, ref_lse2 = _meet(part_ptr, count_ptr, row, active,
                                      WRITE_GRAD or (first == 0), HAS_REF, SPLITS, SPANS)
    nan = float("nan")
    lse2 = tl.where(bad, nan, lse2)
    logp = x_a / t - lse2 * LN2
    # The entropy H = lse - E_p[x / T] (NaN on a poisoned row), stored at once: without
    # ENTROPY_GRAD nothing keeps it live past here.
    ent = (lse2 - mean2) * LN2
    if first == 0:
        tl.store(ent_ptr + row, tl.where(active, ent, 0.0))

    # Epilogue: the token's objective and dL/dlogp, in registers (every program of the
    # row computes the same values; the first stores them).
    if KL_CODE != KL_NONE:
        if HAS_REF:
            logp_ref = tl.where(bad, nan, y_a / t - ref_lse2 * LN2)
    # The coefficients are read here, not with the row's inputs above: live across pass 1
    # they cost 8 registers (72 -> 80 for the headline's meeting plan: 7 -> 6 blocks/SM).
    kl_coef = tl.load(coef_ptr)
    ratio_low = tl.load(coef_ptr + 1)
    ratio_high = tl.load(coef_ptr + 2)
    neg_cap = tl.load(coef_ptr + 3)
    if ON_POLICY:  # a constant to token_objective: lr = 0, its gradient through logp alone
        old = logp
    loss, dloss, r, kl, bits = token_objective(
        logp, old, adv, iw, logp_ref, kl_coef, ratio_low, ratio_high, neg_cap, KL_CODE,
        HAS_NEG_CAP, BOUND, OBJECTIVE
    )
    if ENTROPY_GRAD:  # the entropy bonus; a zero coefficient (a tensor's) adds nothing
        ent_coef = tl.load(coef_ptr + 4)
        loss = tl.where(ent_coef != 0.0, loss - ent_coef * ent, loss)
    if first == 0:
        tl.store(loss_ptr + row, tl.where(active, w * loss, 0.0))
        tl.store(logp_ptr + row, tl.where(active, logp, 0.0))
        tl.store(ratio_ptr + row, tl.where(active, r, 1.0))
        tl.store(kl_ptr + row, tl.where(active, kl, 0.0))
        tl.store(clip_ptr + row, tl.where(active, bits, 0))

    # Pass 2 (this program's spans, still in L2): grad = c * (onehot - softmax), c = w *
    # dL/dlogp / T, minus ce * p * (log p + H) with ce = dL/dH * w / T = -entropy_coef * w / T
    # (ENTROPY_GRAD); streamed out with eviction-first hints.
    if WRITE_GRAD:
        c = tl.where(active, w * dloss / t, 0.0)
        lse2 = tl.where(active, lse2, 0.0)
        ce = 0.0
        ent_g = 0.0
        if ENTROPY_GRAD:  # ce = 0 (a zero coefficient, an inactive row): H stays out too
            ce = tl.where(active & (ent_coef != 0.0), -ent_coef * w / t, 0.0)
            ent_g = tl.where(ce != 0.0, ent, 0.0)
        # This program's tiles (an inactive row's too: they get exact zeros, nothing read).
        t0 = first * TILES_PER_SPLIT
        t1 = tl.minimum(t0 + SPANS * TILES_PER_SPLIT, V // BLOCK_V)
        tail_on = ((V // BLOCK_V) >= t0) & ((V // BLOCK_V) < t0 + SPANS * TILES_PER_SPLIT)
        # Last tile first: the tiles pass 1 read most recently are the likeliest in L2.
        grad_span(p_row, grad_ptr + row * V, V, stride_pv, a, k, lse2, c, active, t0, t1,
                  tail_on, True, BLOCK_V, "evict_first", ce, ent_g, ENTROPY_GRAD)


@triton.jit
def scale_rows_kernel(
    # inputs
    grad_in_ptr,  # [N, V] stored gradient (row-major), any float dtype
    g_ptr,  # [N] f32 upstream value per row at g_ptr + i * stride_g (stride_g = 0: one scalar)
    mask_ptr,  # [N] bool, nonzero = active row
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
