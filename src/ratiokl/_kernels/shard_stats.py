"""Statistics kernel of one vocabulary shard (tensor parallelism).

A rank holding columns ``[start, start + V)`` of ``[N, V_global]`` logits
cannot finish a row's log-sum-exp alone. Per row, this kernel writes the
shard's partial statistics, which the caller combines across ranks:

* ``lse_r = log sum_v exp(x[v] / T)`` over the shard's columns, in natural-log
  units. It is the pair ``(m, s)`` of the online log-sum-exp folded into one
  number (``lse_r = shift(m) + log s``): combining ``lse_r`` as ``(m, s) =
  (lse_r, 1)`` across shards gives the row's log-sum-exp. ``-inf`` for a shard
  whose row is all ``-inf``; ``+inf`` / NaN when the shard holds ``+inf`` / NaN.
* with ``SELECT``, the selected logit ``x[a - start] / T`` when the global
  action id ``a`` lies in this shard, else 0 (the owning rank contributes it,
  the others add 0);
* with ``ENTROPY``, ``mu_r = sum_v p_r[v] x[v] / T``, the mean scaled logit under
  the shard's own softmax ``p_r`` (0 on a shard row of no mass): with the shards'
  weights ``W_r = exp(lse_r - lse)`` the row's entropy is ``lse - sum_r W_r mu_r``
  (one more ``[N]`` term in the caller's sum all-reduce).

The same for the reference logits with ``HAS_REF``, in the same pass. The
log-sum-exp loop is the forward kernel's (``_rows_lse2``), so every byte of an
active row is read once, plus the one selected element. Inactive rows (mask 0)
read no logit and write 0. A global id outside ``[0, V_global)`` is not this
kernel's business: it only selects no column; the caller poisons the row.
"""

import triton
import triton.language as tl

from ratiokl._kernels.forward import _rows_lse2
from ratiokl._kernels.numerics import LN2, LOG2E


@triton.jit
def _owned_logit(row_ptr, a_local, stride_v, t, owned):
    """``x[a_local] / T`` where ``owned`` (then ``0 <= a_local < V``), else 0; reads iff owned."""
    x_a = tl.load(row_ptr + a_local * stride_v, mask=owned, other=0.0).to(tl.float32)
    return tl.where(owned, x_a / t, 0.0)


@triton.jit
def shard_stats_kernel(
    # inputs
    policy_ptr,  # [N, V] this shard's policy logits (fp32/fp16/bf16), strides stride_pn/_pv
    ref_ptr,  # [N, V] this shard's reference logits, strides stride_rn/_rv; read iff HAS_REF
    ids_ptr,  # [N] int32/int64 global action ids; read iff SELECT
    mask_ptr,  # [N] bool, nonzero = active row
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    start_ptr,  # [1] int32/int64 global column of this shard's first column; read iff SELECT
    # outputs
    lse_ptr,  # [N] f32 shard log-sum-exp of policy / T (natural log); 0 on inactive rows
    ref_lse_ptr,  # [N] f32 the same for the reference; 0 without HAS_REF
    sel_ptr,  # [N] f32 policy[a - start] / T on owned rows, else 0; written iff SELECT
    ref_sel_ptr,  # [N] f32 the same for the reference (0 without HAS_REF); iff SELECT
    mean_ptr,  # [N] f32 mu_r, the policy's mean x / T under the shard softmax; iff ENTROPY
    # sizes and strides (elements)
    V, stride_pn, stride_pv, stride_rn, stride_rv, stride_t,
    # compile-time options
    HAS_REF: tl.constexpr,  # reference logits given
    SELECT: tl.constexpr,  # also write the selected logits (needs ids and start)
    ENTROPY: tl.constexpr,  # also write mu_r (the entropy's shard term)
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    n_full = tl.where(active, V // BLOCK_V, 0)
    p_row = policy_ptr + row * stride_pn
    r_row = ref_ptr + row * stride_rn
    # The forward's one-pass loop: inactive rows run no iteration and a fully masked tail.
    lse2, ref_lse2, mean2 = _rows_lse2(
        p_row, r_row, V, stride_pv, stride_rv, LOG2E / t, n_full, active, HAS_REF, ENTROPY,
        BLOCK_V
    )
    tl.store(lse_ptr + row, tl.where(active, lse2 * LN2, 0.0))
    ref_lse = 0.0
    if HAS_REF:
        ref_lse = tl.where(active, ref_lse2 * LN2, 0.0)
    tl.store(ref_lse_ptr + row, ref_lse)
    if ENTROPY:  # base 2 -> natural units: mean2 = E[x k] = E[x / T] log2(e)
        tl.store(mean_ptr + row, tl.where(active, mean2 * LN2, 0.0))
    if SELECT:
        a_local = tl.load(ids_ptr + row).to(tl.int64) - tl.load(start_ptr).to(tl.int64)
        owned = active & (a_local >= 0) & (a_local < V)
        # Clamped for the address only; the load is predicated on ownership.
        a_local = tl.minimum(tl.maximum(a_local, 0), V - 1)
        tl.store(sel_ptr + row, _owned_logit(p_row, a_local, stride_pv, t, owned))
        ref_sel = 0.0
        if HAS_REF:
            ref_sel = _owned_logit(r_row, a_local, stride_rv, t, owned)
        tl.store(ref_sel_ptr + row, ref_sel)
