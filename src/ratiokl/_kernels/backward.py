"""Backward kernel: the policy-logit gradient of a per-row log-prob.

``grad[v] = c * (onehot(a)[v] - exp(x[v] / T - lse)) / T`` for the per-row
upstream coefficient ``c = dL/dlogp = g_logp + g_ratio * ratio + g_kl * dkl``
(the upstream gradients of the forward's outputs; an absent term is 0),
formed in the kernel and written directly in the logits' dtype into a
row-major ``[N, V]`` buffer. Grid ``(N, S)``: program ``(i, j)``
writes the ``j``-th span of ``tiles_per_prog`` whole tiles of row ``i`` (the
last span also the masked tail), an unmasked main loop over whole blocks.
Each element depends only on its logit and the row's ``lse``, so ``S`` (more
programs when rows are few, ``heuristics.backward_splits``) changes no bit.
Inactive rows load nothing and store exact zeros (a loop of their own,
``grad_span``); an active row with a NaN ``lse`` (NaN logits or a poisoned id)
gets a NaN gradient. The id is compared with column indices, never used as an
address: an id outside ``[0, V)`` puts the one-hot on no column, which is what
a vocabulary shard that does not own the action needs (``a - vocab_start``).
"""

import triton
import triton.language as tl

from ratiokl._kernels.numerics import LN2, LOG2E, STREAM_STAGES, to_storage


@triton.jit
def tile_action(a, col0, BLOCK_V: tl.constexpr):
    """The action's int32 column within the tile starting at ``col0`` (-1: not in it).

    The one-hot compares it with the tile's int32 ``arange``: no int64 column
    vector stays alive in registers (it halved the fused loss's occupancy).
    """
    return tl.minimum(tl.maximum(a - col0, -1), BLOCK_V).to(tl.int32)


@triton.jit
def _tile_grad(x, cols, a_tile, k, lse2, c, ce, ent, ENTROPY: tl.constexpr):
    """``c * (onehot - softmax)`` of one float32 tile ``x``: ``[cols == a] c - p c`` with
    ``p = exp2(x k - lse2)``.

    ``cols``: the tile's ``arange``; ``a_tile``: :func:`tile_action`. ``ENTROPY``: minus
    ``ce * p * (log p + ent)`` too (the entropy's gradient, ``ce = g_entropy / T``; a
    ``p = 0`` column, a ``-inf`` logit, adds exactly 0), folded into one product
    ``p * ((c + ce ent) + ce ln2 u)`` with ``u = log2 p``: the ``p > 0`` select, one
    product and two FMAs per element. (Written as ``c * (onehot - p)`` minus a second
    product, the fused loss kernel held 128 registers instead of 96 on sm_90.)
    ``ce = 0`` with a finite ``ent`` gives the bits of the plain gradient.
    """
    if ENTROPY:
        u = x * k - lse2  # log2 p
        p = tl.exp2(u)
        # p = 0 (a -inf logit): its u term is 0, not 0 * inf; a NaN (p NaN) stays NaN.
        t = tl.where(p > 0.0, (ce * LN2) * u, 0.0)
        g = tl.where(cols == a_tile, c, 0.0) - p * ((c + ce * ent) + t)
    else:
        g = tl.where(cols == a_tile, c, 0.0) - tl.exp2(x * k - lse2) * c
    return g


@triton.jit
def _grad_tile(row_ptr, grad_row, cols, a_tile, load_mask, store_mask, k, lse2, c, active,
               ce, ent, ENTROPY: tl.constexpr, EVICT: tl.constexpr):
    """Gradient of one masked tile (:func:`_tile_grad`), exact 0 on inactive rows.

    ``EVICT``: L2 eviction hint of the load and the store (``""``: none).
    """
    x = tl.load(row_ptr, mask=load_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    g = tl.where(active, _tile_grad(x, cols, a_tile, k, lse2, c, ce, ent, ENTROPY), 0.0)
    tl.store(grad_row, to_storage(g, grad_row.dtype.element_ty), mask=store_mask,
             eviction_policy=EVICT)


@triton.jit
def grad_span(row_ptr, grad_row, V, stride_v, a, k, lse2, c, active, t0, t1, tail_on,
              REVERSE: tl.constexpr, BLOCK_V: tl.constexpr, EVICT: tl.constexpr,
              ce=0.0, ent=0.0, ENTROPY: tl.constexpr = False):
    """Write ``c * (onehot(a) - exp2(x * k - lse2))`` on whole tiles ``[t0, t1)`` of a row.

    Plus the masked tail tile (``V % BLOCK_V`` columns) if ``tail_on``.
    ``row_ptr``: the row's logits (column stride ``stride_v``); ``grad_row``:
    its contiguous gradient row, written in its dtype. An inactive row reads
    nothing and gets exact zeros: the row's activity picks one of two loops,
    so the main loop's loads carry no mask (a masked loop held 24 more
    registers in the fused loss kernel on sm_90: 96 against 72). ``REVERSE``:
    visit the tiles last to first. ``EVICT``: the L2 hint of the loads and
    stores (``""``: none). ``ENTROPY``: with the entropy's term (:func:`_tile_grad`).
    Each element is independent: no order or split changes a bit.
    """
    cols = tl.arange(0, BLOCK_V)
    if V % BLOCK_V != 0:
        if tail_on:
            col0 = (V // BLOCK_V) * BLOCK_V
            offs = (col0 + cols).to(tl.int64)
            tail = offs < V
            _grad_tile(row_ptr + offs * stride_v, grad_row + offs, cols,
                       tile_action(a, col0, BLOCK_V), tail & active, tail, k, lse2, c, active,
                       ce, ent, ENTROPY, EVICT)
    if active:
        for i in tl.range(t0, t1, num_stages=STREAM_STAGES):
            if REVERSE:
                col0 = (t1 - 1 - (i - t0)) * BLOCK_V
            else:
                col0 = i * BLOCK_V
            offs = (col0 + cols).to(tl.int64)
            x = tl.load(row_ptr + offs * stride_v, eviction_policy=EVICT).to(tl.float32)
            g = _tile_grad(x, cols, tile_action(a, col0, BLOCK_V), k, lse2, c, ce, ent, ENTROPY)
            tl.store(grad_row + offs, to_storage(g, grad_row.dtype.element_ty),
                     eviction_policy=EVICT)
    else:
        zero = tl.zeros([BLOCK_V], tl.float32)
        for i in range(t0, t1):
            offs = (i * BLOCK_V + cols).to(tl.int64)
            tl.store(grad_row + offs, to_storage(zero, grad_row.dtype.element_ty),
                     eviction_policy=EVICT)


@triton.jit
def upstream_coefficient(
    row, active, g_logp_ptr, g_ratio_ptr, ratio_ptr, g_kl_ptr, dkl_ptr,
    stride_gl, stride_gr, stride_gk,
    HAS_G_LOGP: tl.constexpr, HAS_G_RATIO: tl.constexpr, HAS_G_KL: tl.constexpr,
):
    """``c = g_logp + g_ratio * ratio + g_kl * dkl`` of one row (absent terms 0), 0 if inactive.

    Inactive rows load nothing and select 0: a NaN upstream value there stays out.
    """
    c = 0.0
    if HAS_G_LOGP:
        c = c + tl.load(g_logp_ptr + row * stride_gl, mask=active, other=0.0).to(tl.float32)
    if HAS_G_RATIO:
        g = tl.load(g_ratio_ptr + row * stride_gr, mask=active, other=0.0).to(tl.float32)
        c = c + g * tl.load(ratio_ptr + row, mask=active, other=0.0)
    if HAS_G_KL:
        g = tl.load(g_kl_ptr + row * stride_gk, mask=active, other=0.0).to(tl.float32)
        c = c + g * tl.load(dkl_ptr + row, mask=active, other=0.0)
    return tl.where(active, c, 0.0)


@triton.jit
def logp_backward_kernel(
    # inputs
    logits_ptr,  # [N, V] policy logits (fp32/fp16/bf16), strides (stride_ln, stride_lv)
    ids_ptr,  # [N] int32/int64 action ids (local to the columns here; outside [0, V): none)
    mask_ptr,  # [N] bool, nonzero = active row
    temp_ptr,  # [N] f32 temperature at temp_ptr + i * stride_t (stride_t = 0: one scalar)
    lse_ptr,  # [N] f32 logsumexp(logits / T) from the forward
    g_logp_ptr,  # [N] upstream gradient of logp at g_logp_ptr + i * stride_gl; iff HAS_G_LOGP
    g_ratio_ptr,  # [N] upstream gradient of ratio (stride_gr); read iff HAS_G_RATIO
    ratio_ptr,  # [N] f32 ratio from the forward (contiguous); read iff HAS_G_RATIO
    g_kl_ptr,  # [N] upstream gradient of kl (stride_gk); read iff HAS_G_KL
    # (ENTROPY: of the entropy)
    dkl_ptr,  # [N] f32 d kl / d logp from the forward (contiguous); read iff HAS_G_KL
    # (ENTROPY: the entropy)
    # outputs
    grad_ptr,  # [N, V] gradient in the logits' dtype, row-major (row stride V)
    # sizes and strides (elements)
    V,
    stride_ln,
    stride_lv,
    stride_t,
    stride_gl,
    stride_gr,
    stride_gk,
    tiles_per_prog,  # whole tiles per program along grid axis 1 (>= cdiv(V, BLOCK_V): one)
    # compile-time options
    HAS_G_LOGP: tl.constexpr,  # which upstream gradients are given (absent: 0)
    HAS_G_RATIO: tl.constexpr,
    HAS_G_KL: tl.constexpr,
    ENTROPY: tl.constexpr,  # the kl slots hold the entropy: -g_H p (log p + H) / T added
    BLOCK_V: tl.constexpr,  # vocabulary tile (power of two)
):
    row = tl.program_id(0).to(tl.int64)
    active = tl.load(mask_ptr + row) != 0
    # Only compared, never an address: an id outside [0, V) matches no column (a vocabulary
    # shard passes ids local to it); a bad global id already made lse NaN in the forward.
    a = tl.load(ids_ptr + row).to(tl.int64)
    t = tl.where(active, tl.load(temp_ptr + row * stride_t), 1.0)
    lse2 = tl.where(active, tl.load(lse_ptr + row) * LOG2E, 0.0)
    c = upstream_coefficient(
        row, active, g_logp_ptr, g_ratio_ptr, ratio_ptr, g_kl_ptr, dkl_ptr,
        stride_gl, stride_gr, stride_gk, HAS_G_LOGP, HAS_G_RATIO, HAS_G_KL and not ENTROPY,
    ) / t
    ce = 0.0
    ent = 0.0
    if ENTROPY:
        if HAS_G_KL:
            ce = tl.load(g_kl_ptr + row * stride_gk, mask=active, other=0.0).to(tl.float32)
            ce = tl.where(active, ce, 0.0) / t
            ent = tl.load(dkl_ptr + row, mask=active, other=0.0)
    k = LOG2E / t
    # This program's span of whole tiles (grid axis 1 splits a row; 1 program: the whole row).
    n_full = V // BLOCK_V
    t0 = tl.program_id(1) * tiles_per_prog
    t1 = tl.minimum(t0 + tiles_per_prog, n_full)
    tail_on = (n_full >= t0) & (n_full < t0 + tiles_per_prog)
    grad_span(logits_ptr + row * stride_ln, grad_ptr + row * V, V, stride_lv, a, k, lse2, c,
              active, t0, t1, tail_on, False, BLOCK_V, "", ce, ent, ENTROPY)
