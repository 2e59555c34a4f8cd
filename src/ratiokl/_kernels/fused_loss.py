"""Fused policy-loss kernels: loss, metrics pieces and the policy-logit gradient in one program.

``policy_loss_kernel`` -- a row of ``[N, V]`` logits is cut into ``SPLITS``
spans of whole tiles (``heuristics.launch_plan``); on a GPU each span has its own
program, which

1. reads its span once for the partial log-sum-exp (the policy's, and the
   reference's in the same pass when reference logits are given) and the
   policy's entropy sum ``h = sum 2^(x - m) x`` (one more FMA per element, no
   more bytes) -- the forward kernel's ``span_stats`` -- and publishes them;
2. meets the row's other programs at a device-side counter and combines
   the ``SPLITS`` partials (``meeting.meet``), all programs the same way, into the
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
1.16 for one read and one write of the logits: ``heuristics.launch_plan``). The
wait is safe without a cooperative launch: work is taken in order from a
device counter, so a program only waits for spans that running programs
have taken or will take (the pattern of single-pass decoupled look-back
scans); it needs a row's programs resident together, ``SPLITS`` small
programs. A program that owns a whole row (``SPANS = SPLITS``: a row of one
span, or no gradient wanted and enough rows) keeps its partials in registers
and meets no one. Triton's
interpreter runs the GPU's plan too: programs run one after the other
there, so ``meeting.stand_in_meeting`` orders a shared row's programs and
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

import triton
import triton.language as tl

from ratiokl._kernels.codes import KL_NONE
from ratiokl._kernels.backward import grad_span
from ratiokl._kernels.spans import span_stats, split_span
from ratiokl._kernels.meeting import combine, meet, publish, row_partials, stand_in_meeting
from ratiokl._kernels.numerics import INTERPRETED, LN2, LOG2E, to_storage
from ratiokl._kernels.objective import token_objective


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
            first = stand_in_meeting(p_row, r_row, part_ptr, count_ptr, row,
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
    # same vectors reach the same combine: the same bits.
    EVICT_1: tl.constexpr = "evict_last" if WRITE_GRAD else ""
    if ROW_PROGRAMS == 1:
        ms_p, ss_p, hs_p, ms_r, ss_r = row_partials(
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
            publish(part_ptr, row, first + j, m_p, s_p, h_p, m_r, s_r, SPLITS)
    if ROW_PROGRAMS == 1:
        lse2, mean2 = combine(ms_p, ss_p, hs_p, True)
        ref_lse2 = -float("inf")
        if HAS_REF:
            ref_lse2, _ = combine(ms_r, ss_r, ss_r, False)
    else:
        # Without a gradient only the row's first program (which stores the row's values)
        # waits.
        lse2, mean2, ref_lse2 = meet(part_ptr, count_ptr, row, active,
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
