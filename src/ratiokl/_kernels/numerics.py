"""Device helpers shared by the kernels: online log-sum-exp step, KL estimators.

All math is float32. Row statistics are kept in base-2 units (logits times
``log2(e) / T``) so that the hot loop uses ``exp2``/``log2``.
"""

import triton
import triton.language as tl

from ratiokl._kernels.codes import K1, K2

#: log2(e): scales natural-log logits to base-2 units.
LOG2E = tl.constexpr(1.4426950408889634)
#: ln(2): converts base-2 log-sum-exps back to natural-log units.
LN2 = tl.constexpr(0.6931471805599453)
#: True in the interpreter twins of the kernels (``ratiokl._kernels.interpret`` sets it).
INTERPRETED = tl.constexpr(False)
#: Software-pipelining depth of the loops that stream logits (``tl.range(..., num_stages=)``):
#: the next two tiles are in flight (``cp.async`` into shared memory) while one is reduced,
#: so a tile's block reductions no longer wait on its loads. H200, bf16, N = 8192,
#: V = 151,936, user timing, 1 -> 3 stages: the fused loss fwd+bwd 2.02 -> 1.67 ms, its
#: forward 0.82 -> 0.76, ``selected_logprobs(return_entropy=True)`` 0.82 -> 0.71, ``ratio_kl``
#: with reference logits 1.21 -> 1.16 (2 stages: 1.89, 0.87, 0.83, 1.19; docs/performance.md).
STREAM_STAGES = tl.constexpr(3)


@triton.jit
def shift_of(m):
    """The max used to shift exponentials: ``m`` if finite, else 0 (as in ``ratiokl.spec``).

    A row of all ``-inf`` then sums to 0 (``lse = -inf``, ``logp = NaN``) and a
    ``+inf`` logit gives ``lse = +inf``, never ``inf - inf`` inside the sum.
    """
    return tl.where(tl.abs(m) < float("inf"), m, 0.0)


@triton.jit
def lse_step(x, m, s):
    """Fold one tile ``x`` (base-2 units) into the running ``(max m, sum s)`` of a row.

    ``s`` is the sum of ``exp2(x - shift_of(m))`` seen so far; a NaN in ``x``
    makes ``s`` NaN and keeps it so.
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = shift_of(m_new)
    # Rescale the old sum to the new max, then add this tile's terms.
    s = s * tl.exp2(m - shift) + tl.sum(tl.exp2(x - shift), axis=0)
    return m_new, s


#: Largest finite float32: a ``-inf`` logit is raised to ``-FLT_MAX`` where it multiplies 0.
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def lse_h_step(x, m, s, h):
    """:func:`lse_step` that also folds ``h = sum(exp2(x - shift) * x)`` (for the entropy).

    ``h`` rescales with ``s``. It is summed as ``sum e (x - shift) + shift sum e``: the
    shifted logits ``d = x - shift`` are the exponent's own operand, so ``x`` is dead once
    ``d`` is formed (``sum e x`` kept both alive: 90 registers instead of 56 for the
    entropy forward on sm_90, 96 instead of 71 for the forward-only fused loss). A
    ``-inf`` entry adds exactly 0: its ``e = 0`` multiplies ``max(d, -FLT_MAX)``, never
    ``-inf`` (one ``max`` and one FMA per element; every ``d`` with ``e > 0`` is finite).
    A NaN makes ``s`` NaN. The ``(m, s)`` it returns are :func:`lse_step`'s, bit for bit.
    With ``p = exp2(x - lse2)`` the entropy in nats is ``(lse2 - h / s) * ln 2``.
    """
    m_new = tl.maximum(m, tl.max(x, axis=0))
    shift = shift_of(m_new)
    scale = tl.exp2(m - shift)
    d = x - shift
    e = tl.exp2(d)
    se = tl.sum(e, axis=0)
    s = s * scale + se
    h = h * scale + (tl.sum(e * tl.maximum(d, -FLT_MAX), axis=0) + shift * se)
    return m_new, s, h


#: Adjacent logits a thread folds on its own in the entropy forward: a tile is read as
#: ``[BLOCK_V // LANE, LANE]`` and each of its rows (a "lane") keeps its own running
#: ``(m, s, h)`` (:func:`lane_lse_h_step`), so a tile costs no block reduction; the lanes meet
#: once a span (:func:`fold_lanes`). 8 bf16 = one 16-byte load per lane.
LANE = tl.constexpr(8)


@triton.jit
def lane_lse_h_step(raw, k, m, s, h):
    """Fold a tile ``raw [R, LANE]`` (float32 logits, natural units) into per-lane ``(m, s, h)``.

    ``(m, s, h)`` are ``[R]``, in base-2 units (``x = raw k``, ``k = log2(e) / T > 0``):
    lane ``r``'s running max, ``s = sum exp2(x - shift_of(m))`` and
    ``h = sum exp2(x - shift_of(m)) x`` over the entries it has seen, as
    :func:`lse_h_step` keeps them for a whole tile. Every reduction is along a lane,
    inside one thread: no shuffle, no barrier. The max is taken of ``raw`` and scaled
    once (``max(raw) k = max(raw k)`` for ``k > 0``; a poisoned ``k = NaN`` makes ``s``
    NaN either way), and ``d = raw k - shift`` is the exponent's FMA. ``-inf`` entries add
    exactly 0 to ``h`` (``max(d, -FLT_MAX)``, as in :func:`lse_h_step`); a NaN makes ``s``
    NaN.
    """
    m_new = tl.maximum(m, tl.max(raw, axis=1) * k)
    shift = shift_of(m_new)
    scale = tl.exp2(m - shift)
    d = raw * k - shift[:, None]
    e = tl.exp2(d)
    se = tl.sum(e, axis=1)
    s = s * scale + se
    h = h * scale + (tl.sum(e * tl.maximum(d, -FLT_MAX), axis=1) + shift * se)
    return m_new, s, h


@triton.jit
def fold_lanes(m, s, h):
    """The ``(m, s, h)`` of a span from its lanes' ``[R]`` triples (:func:`lane_lse_h_step`).

    One block reduction of each: ``m = max m_r``, ``s = sum s_r exp2(m_r - shift)``,
    ``h = sum h_r exp2(m_r - shift)`` with ``shift = shift_of(m)``; an empty lane
    (``-inf, 0, 0``) adds 0.
    """
    m_span = tl.max(m, axis=0)
    w = tl.exp2(m - shift_of(m_span))
    return m_span, tl.sum(s * w, axis=0), tl.sum(h * w, axis=0)


@triton.jit
def fold_lse2_h(m_acc, s_acc, h_acc, m, s, h):
    """Fold a span's ``(m, s, h)`` into the running triple (as ``fold_lse2`` folds ``(m, s)``)."""
    m_new = tl.maximum(m_acc, m)
    shift = shift_of(m_new)
    a, b = tl.exp2(m_acc - shift), tl.exp2(m - shift)
    return m_new, s_acc * a + s * b, h_acc * a + h * b


@triton.jit
def _expm1_tail(d):
    """``(expm1(d) - d) / d^2`` for ``|d| < 0.5`` (Taylor series, error below 1e-8 relative)."""
    c = 1.0 / 40320.0
    c = 1.0 / 5040.0 + d * c
    c = 1.0 / 720.0 + d * c
    c = 1.0 / 120.0 + d * c
    c = 1.0 / 24.0 + d * c
    c = 1.0 / 6.0 + d * c
    return 0.5 + d * c


@triton.jit
def kl_and_dkl(d, KL_CODE: tl.constexpr):
    """Schulman's estimator on ``d = logp_ref - logp`` and its derivative w.r.t. ``logp``.

    k1: ``-d``, 1; k2: ``d^2/2``, ``-d``; k3: ``exp(d) - d - 1``, ``-expm1(d)``.
    k3 uses a series near 0, where ``exp(d) - 1 - d`` would cancel to noise.
    """
    if KL_CODE == K1:
        kl = -d
        dkl = tl.full(d.shape, 1.0, tl.float32)
    elif KL_CODE == K2:
        kl = 0.5 * d * d
        dkl = -d
    else:
        small = tl.abs(d) < 0.5
        e = tl.exp(d)
        # kl3 = expm1(d) - d = d^2 * tail(d); expm1(d) = d + d^2 * tail(d).
        kl_series = d * d * _expm1_tail(tl.where(small, d, 0.0))
        kl = tl.where(small, kl_series, e - 1.0 - d)
        dkl = -tl.where(small, d + kl_series, e - 1.0)
    return kl, dkl


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """``x`` (float32) cast to the stored ``dtype``, rounded to nearest-even.

    The GPU rounds float32 -> bfloat16 to nearest-even, but Triton's CPU
    interpreter truncates; there the float32 bits are rounded first, so the
    interpreter checks the bits the GPU writes. (Compiled, that bit rounding
    cost the fused loss kernel 255 registers instead of 96.)
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(dtype)
