"""Split forward for few rows: a program per (row, vocabulary split), then a per-row combine.

When the rows alone cannot fill the GPU (``heuristics.use_split_forward``),
``lse_partials_kernel`` runs on a ``(N, SPLITS)`` grid: program ``(i, c)``
streams split ``c`` of row ``i`` (whole tiles of policy and reference,
``heuristics.split_plan``) and writes its partial base-2 ``(max, sum)`` pairs.
``logp_combine_kernel`` (grid ``N``) folds the ``SPLITS`` partials of a row
in order and writes the very outputs of ``logp_forward_kernel``.

Both kernels use the helpers of ``forward`` (``span_stats``, ``split_span``,
``fold_lse2``, ``forward_epilogue``) with the spans of ``split_plan``, which
depends on ``V`` and the element size only; the one-program-per-row kernel
folds the same partials in the same order, so a row's bits are the same on
either path and in any batch (batch invariance). Inactive rows read no logit
(their partials are ``(-inf, 0)``) and get the neutral outputs.
"""

import triton
import triton.language as tl

from ratiokl._kernels.forward import fold_lse2, forward_epilogue, store_partial
from ratiokl._kernels.spans import entropy_span_stats, span_stats, split_span
from ratiokl._kernels.numerics import LOG2E, fold_lse2_h


@triton.jit
def lse_partials_kernel(
    # inputs
    policy_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_pn, stride_pv)
    ref_ptr,  # [N, V] reference logits, strides (stride_rn, stride_rv); read iff HAS_REF
    mask_ptr,  # [N] bool, nonzero = active row
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    # outputs
    part_ptr,  # [N, SPLITS, 4] f32 (m_policy, s_policy, m_ref, s_ref) per split, base 2;
    # ENTROPY: (m_policy, s_policy, h_policy, 0), h the entropy's sum (no reference)
    # sizes and strides (elements)
    V, stride_pn, stride_pv, stride_rn, stride_rv, stride_t,
    # compile-time options
    HAS_REF: tl.constexpr,  # reference logits given
    ENTROPY: tl.constexpr,  # the entropy's sum too (no reference)
    SPLITS: tl.constexpr,  # splits per row (heuristics.split_plan)
    TILES_PER_SPLIT: tl.constexpr,  # whole tiles per split
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    active = tl.load(mask_ptr + row) != 0
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    t0, t1, tail_on = split_span(split, V, active, TILES_PER_SPLIT, BLOCK_V)
    if ENTROPY:  # no reference: h takes its slot
        m_p, s_p, h_p = entropy_span_stats(policy_ptr + row * stride_pn, V, stride_pv,
                                           LOG2E / t, t0, t1, tail_on, BLOCK_V)
        store_partial(part_ptr, row, split, m_p, s_p, h_p, 0.0, SPLITS)
    else:
        m_p, s_p, _, m_r, s_r = span_stats(
            policy_ptr + row * stride_pn, ref_ptr + row * stride_rn, V, stride_pv, stride_rv,
            LOG2E / t, t0, t1, tail_on, HAS_REF, False, BLOCK_V, "",
        )
        store_partial(part_ptr, row, split, m_p, s_p, m_r, s_r, SPLITS)


@triton.jit
def logp_combine_kernel(
    # inputs
    policy_ptr,  # [N, V] policy logits (only the action's logit is read)
    ref_ptr,  # [N, V] reference logits (only the action's logit is read; iff HAS_REF)
    ids_ptr,  # [N] int32/int64 action ids
    mask_ptr,  # [N] bool, nonzero = active row
    old_ptr,  # [N] f32 behaviour-policy log-probs; read iff KL_CODE != KL_NONE
    ref_logps_ptr,  # [N] f32 reference log-probs; read iff KL_CODE != KL_NONE and not HAS_REF
    temp_ptr,  # [N] f32 temperature (stride_t = 0: one scalar)
    part_ptr,  # [N, SPLITS, 4] f32 partials from lse_partials_kernel
    # outputs: as logp_forward_kernel
    logp_ptr,
    ratio_ptr,
    kl_ptr,
    dkl_ptr,
    lse_ptr,
    # sizes and strides (elements)
    V, stride_pn, stride_pv, stride_rn, stride_rv, stride_t,
    # compile-time options
    HAS_REF: tl.constexpr,
    KL_CODE: tl.constexpr,
    ENTROPY: tl.constexpr,  # partials hold (m, s, h): the entropy too (no reference)
    SPLITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    m_p = -float("inf")
    s_p = 0.0
    m_r = -float("inf")
    s_r = 0.0
    if ENTROPY:  # m_r carries the entropy's sum h, folded with (m_p, s_p)
        m_r = 0.0
        for split in range(0, SPLITS):
            part = part_ptr + (row * SPLITS + split) * 4
            m_p, s_p, m_r = fold_lse2_h(m_p, s_p, m_r, tl.load(part), tl.load(part + 1),
                                        tl.load(part + 2))
    else:
        for split in range(0, SPLITS):
            part = part_ptr + (row * SPLITS + split) * 4
            m_p, s_p = fold_lse2(m_p, s_p, tl.load(part), tl.load(part + 1))
            m_r, s_r = fold_lse2(m_r, s_r, tl.load(part + 2), tl.load(part + 3))
    forward_epilogue(
        row, policy_ptr + row * stride_pn, ref_ptr + row * stride_rn, ids_ptr, mask_ptr,
        old_ptr, ref_logps_ptr, temp_ptr, logp_ptr, ratio_ptr, kl_ptr, dkl_ptr, lse_ptr,
        V, stride_pv, stride_rv, stride_t, m_p, s_p, m_r, s_r, HAS_REF, KL_CODE, ENTROPY,
    )
