"""Backward kernel: the policy-logit gradient of a per-row log-prob.

``grad[v] = c * (onehot(a)[v] - exp(x[v] / T - lse)) / T`` for the per-row
upstream coefficient ``c`` (``dL/dlogp``), written directly in the logits'
dtype into a row-major ``[N, V]`` buffer. Grid ``(N, S)``: program ``(i, j)``
writes the ``j``-th span of ``tiles_per_prog`` whole tiles of row ``i`` (the
last span also the masked tail), an unmasked main loop over whole blocks.
Each element depends only on its logit and the row's ``lse``, so ``S`` (more
programs when rows are few, ``heuristics.backward_splits``) changes no bit.
Inactive rows load nothing (their loads are predicated off) and store
exact zeros; an active row with a NaN ``lse`` (NaN logits or a poisoned id)
gets a NaN gradient. The id is compared with column indices, never used as an
address: an id outside ``[0, V)`` puts the one-hot on no column, which is what
a vocabulary shard that does not own the action needs (``a - vocab_start``).
"""

import triton
import triton.language as tl

from ratiokl._kernels.numerics import LOG2E, to_storage


@triton.jit
def _grad_tile(row_ptr, grad_row, offs, load_mask, store_mask, a, k, lse2, c, active):
    """Gradient of one tile: ``c * (onehot - softmax)``, exact 0 on inactive rows."""
    x = tl.load(row_ptr, mask=load_mask, other=0.0).to(tl.float32)
    p = tl.exp2(x * k - lse2)
    g = c * (tl.where(offs == a, 1.0, 0.0) - p)
    g = tl.where(active, g, 0.0)
    tl.store(grad_row, to_storage(g, grad_row.dtype.element_ty), mask=store_mask)


@triton.jit
def logp_backward_kernel(
    # inputs
    logits_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_ln, stride_lv)
    ids_ptr,  # [N] int32/int64 action ids (local to the columns here; outside [0, V): none)
    mask_ptr,  # [N] bool (torch) or int8 (jax), nonzero = active row
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    lse_ptr,  # [N] f32 logsumexp(logits / T) from the forward
    coef_ptr,  # [N] f32 upstream coefficient c = dL/dlogp
    # outputs
    grad_ptr,  # [N, V] gradient in the logits' dtype, row-major (row stride V)
    # sizes and strides (elements)
    V,
    stride_ln,
    stride_lv,
    stride_t,
    tiles_per_prog,  # whole tiles per program along grid axis 1 (>= cdiv(V, BLOCK_V): one)
    # compile-time options
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0
    # Only compared, never an address: an id outside [0, V) matches no column (a vocabulary
    # shard passes ids local to it); a bad global id already made lse NaN in the forward.
    a = tl.load(ids_ptr + row).to(tl.int64)
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    lse2 = tl.where(active, tl.load(lse_ptr + row) * LOG2E, 0.0)
    c = tl.where(active, tl.load(coef_ptr + row) / t, 0.0)
    k = LOG2E / t
    row_ptr = logits_ptr + row * stride_ln
    grad_row = grad_ptr + row * V
    cols = tl.arange(0, BLOCK_V)
    on = tl.full([BLOCK_V], 1, tl.int1) & active
    # This program's span of whole tiles (grid axis 1 splits a row; 1 program: the whole row).
    n_full = V // BLOCK_V
    t0 = tl.program_id(1) * tiles_per_prog
    for b in range(t0, tl.minimum(t0 + tiles_per_prog, n_full)):
        offs = (b * BLOCK_V + cols).to(tl.int64)
        # Loads predicated on the row being active (uniform per row: still wide).
        _grad_tile(
            row_ptr + offs * stride_lv, grad_row + offs, offs, on, None, a, k, lse2, c, active
        )
    if V % BLOCK_V != 0:
        offs = (n_full * BLOCK_V + cols).to(tl.int64)
        tail = (offs < V) & (n_full >= t0) & (n_full < t0 + tiles_per_prog)
        _grad_tile(
            row_ptr + offs * stride_lv, grad_row + offs, offs, tail & active, tail,
            a, k, lse2, c, active,
        )
