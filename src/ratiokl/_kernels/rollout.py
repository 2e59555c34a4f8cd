"""The rollout correction's weights and metrics on ``[N]`` vectors, in one program.

``rollout_weights_kernel`` computes ``ratiokl.spec.rollout``'s weight ``w`` per
row, writes ``w * importance_weight`` (the weight the fused loss and the two-pass
objective take as their ``importance_weights``) and the three metrics' means over
active rows. One launch instead of about fifteen framework ops on ``[N]`` (each
1-2 us of device time and several of host time; a trainer calls the loss many
times a step). The sequence-level log-weight (a sum over each sequence) comes in
precomputed: ``[R]`` row sums (``seq_width = T``) or per-token segment sums
(``seq_width = 1``).

Sums run in a fixed order (per lane, then one tree reduction), so a launch gives
the same bits every time. Inactive rows read nothing and get weight 0; NaN stays
NaN on active rows (selected, never ``min``/``max``, which drop a NaN on a GPU).
"""

import math
from typing import Any, Dict

import triton
import triton.language as tl

from ratiokl._kernels.codes import K3
from ratiokl._kernels.loss_rows import ROWS_BLOCK
from ratiokl._kernels.numerics import kl_and_dkl

#: ``CORRECT`` codes: no weight (metrics only), truncate, mask.
NONE = tl.constexpr(0)
TRUNCATE = tl.constexpr(1)
MASK = tl.constexpr(2)


def rollout_constexprs(masks: bool, corrects: bool, low: float, high: float, bound: float,
                       sequence: bool, has_iw: bool) -> Dict[str, Any]:
    """:func:`rollout_weights_kernel`'s compile-time arguments, for both bindings: a
    correction that ``masks`` (else truncates where it ``corrects``, else none), its
    ``[low, high]`` (``high`` may be inf: no ceiling), ``bound`` (``log_ratio_bound``, 0:
    none), a ``sequence`` log-weight, importance weights."""
    finite = high < math.inf
    correct = MASK if masks else TRUNCATE if corrects else NONE
    return dict(LOW=low, HIGH=high if finite else 0.0, HAS_HIGH=finite, BOUND=bound,
                CORRECT=correct.value, SEQUENCE=sequence, HAS_IW=has_iw, BLOCK=ROWS_BLOCK)


@triton.jit
def _clip(x, BOUND: tl.constexpr):
    """``clip(x, -BOUND, BOUND)`` (``BOUND = 0``: no bound), selected so a NaN stays NaN."""
    if BOUND > 0:
        x = tl.where(x > BOUND, BOUND, tl.where(x < -BOUND, -BOUND, x))
    return x


@triton.jit
def rollout_weights_kernel(
    mask_ptr,  # [N] bool, nonzero = active row
    old_ptr,  # [N] f32 the trainer's behaviour log-probs (old_logps)
    rollout_ptr,  # [N] f32 the engine's log-probs (rollout_logps)
    seq_ptr,  # [N // seq_width] f32 sequence log-weights; read iff SEQUENCE
    iw_ptr,  # [N] f32 importance weights; read iff HAS_IW
    w_ptr,  # [N] f32 output: w * importance weight, 0 on inactive rows
    out_ptr,  # [3] f32 output: rollout_weight_mean, rollout_masked_fraction, rollout_k3
    N,
    seq_width,  # rows per sequence log-weight: T (one per row of [R, T]) or 1 (per token)
    LOW: tl.constexpr,  # lo (mask modes)
    HIGH: tl.constexpr,  # hi (0 with HAS_HIGH off)
    HAS_HIGH: tl.constexpr,  # False: hi = inf (mask modes only)
    BOUND: tl.constexpr,  # log_ratio_bound (0: none)
    CORRECT: tl.constexpr,  # NONE, TRUNCATE or MASK
    SEQUENCE: tl.constexpr,  # the log-weight is the sequence's (seq_ptr)
    HAS_IW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Weights and metrics of ``ratiokl.spec.rollout`` over ``N`` rows; one program."""
    count = tl.zeros([BLOCK], tl.int32)  # per lane: active rows,
    n_masked = tl.zeros([BLOCK], tl.int32)  # those the mask modes give weight 0,
    w_sum = tl.zeros([BLOCK], tl.float32)  # their weights w (before importance weights)
    k3_sum = tl.zeros([BLOCK], tl.float32)  # and their k3 of the token log-weight
    cols = tl.arange(0, BLOCK)
    for start in range(0, N, BLOCK):
        offs = start + cols
        inside = offs < N
        active = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
        # The token log-weight lw_t = old - rollout; inactive rows read nothing.
        lw_tok = tl.load(old_ptr + offs, mask=active, other=0.0) - tl.load(
            rollout_ptr + offs, mask=active, other=0.0)
        k3, _ = kl_and_dkl(_clip(lw_tok, BOUND), K3)  # exp(d) - d - 1 (series near 0)
        lw = lw_tok
        if SEQUENCE:  # the sum over the token's sequence, precomputed
            lw = tl.load(seq_ptr + offs // seq_width, mask=active, other=0.0)
        e = tl.exp(_clip(lw, BOUND))
        outside = active & (e < -1.0)  # never (NaN included)
        w = tl.full([BLOCK], 1.0, tl.float32)
        if CORRECT == MASK:  # weight 0 outside [lo, hi]; NaN is not outside
            outside = e < LOW
            if HAS_HIGH:
                outside = outside | (e > HIGH)
            w = tl.where(outside, 0.0, e)
        elif CORRECT == TRUNCATE:  # min(e, hi), NaN kept
            w = tl.where(e > HIGH, HIGH, e)
        weight = w
        if HAS_IW:
            weight = w * tl.load(iw_ptr + offs, mask=active, other=0.0)
        tl.store(w_ptr + offs, tl.where(active, weight, 0.0), mask=inside)
        count += active.to(tl.int32)
        n_masked += (active & outside).to(tl.int32)
        w_sum += tl.where(active, w, 0.0)
        k3_sum += tl.where(active, k3, 0.0)
    n = tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    tl.store(out_ptr, tl.div_rn(tl.sum(w_sum, axis=0), n))
    tl.store(out_ptr + 1, tl.div_rn(tl.sum(n_masked, axis=0).to(tl.float32), n))
    tl.store(out_ptr + 2, tl.div_rn(tl.sum(k3_sum, axis=0), n))
