"""GAE as one pass over time: a reverse recurrence per block of rows, held in registers.

``gae_kernel`` computes ``ratiokl.spec.reference_gae``'s raw advantages (before
whitening) for ``BLOCK_B`` rows per program, walking ``t = T-1 .. 0`` once with the
carried state (the next unmasked position's advantage and value) in registers: one launch
for the whole batch, never one per position. Each step reads column ``t`` of the mask,
then the rewards and values of the rows unmasked there only (a masked position is read for
its mask alone: whatever it holds never enters), and writes the advantage and the return
``A + V`` (0 where masked). Consecutive steps read neighbouring bytes of each row, so the
cache lines one step fetches serve the next ones.

``GAMMA`` and ``LAM`` are ``tl.constexpr`` (fixed for a run; a Python float passed as a
plain argument would reach the kernel as fp32 eagerly and fp64 compiled).
"""

import triton
import triton.language as tl

#: Rows per program: enough lanes to fill a warp group, few enough programs' columns to
#: stay in L1 between steps.
GAE_BLOCK_B = 64
GAE_WARPS = 2


@triton.jit
def gae_kernel(
    rewards_ptr,  # [B, T] f32 token-level rewards
    values_ptr,  # [B, T] f32 the critic's values
    mask_ptr,  # [B, T] bool, nonzero = response token
    adv_ptr,  # [B, T] f32 output: raw advantage A_t, 0 where masked
    ret_ptr,  # [B, T] f32 output: return A_t + V_t, 0 where masked
    n_rows,  # B
    n_steps,  # T
    stride_r,  # row stride of rewards (elements; column stride 1)
    stride_v,  # row stride of values
    stride_m,  # row stride of mask
    stride_o,  # row stride of both outputs
    GAMMA: tl.constexpr,
    LAM: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = rows < n_rows
    rows = rows.to(tl.int64)
    next_adv = tl.zeros([BLOCK_B], dtype=tl.float32)  # A of the next unmasked position
    next_value = tl.zeros([BLOCK_B], dtype=tl.float32)  # V of the next unmasked position
    for step in range(0, n_steps):
        t = n_steps - 1 - step
        on = (tl.load(mask_ptr + rows * stride_m + t, mask=live, other=0) != 0) & live
        r = tl.load(rewards_ptr + rows * stride_r + t, mask=on, other=0.0)
        v = tl.load(values_ptr + rows * stride_v + t, mask=on, other=0.0)
        # TD error against the next unmasked value, then the discounted sum of them.
        a = r + GAMMA * next_value - v + (GAMMA * LAM) * next_adv
        # A masked position carries the state over unchanged.
        next_adv = tl.where(on, a, next_adv)
        next_value = tl.where(on, v, next_value)
        tl.store(adv_ptr + rows * stride_o + t, tl.where(on, a, 0.0), mask=live)
        tl.store(ret_ptr + rows * stride_o + t, tl.where(on, a + v, 0.0), mask=live)
