"""GAE as one pass over time: a reverse scan per block of rows, chunk by chunk, in registers.

``gae_kernel`` computes ``ratiokl.spec.reference_gae``'s raw advantages (before
whitening) and returns for ``BLOCK_B`` rows per program: one launch for the whole batch,
never one per position. The recursion is a composition of affine maps
(``ratiokl._core.advantages``: an unmasked position maps the carried state ``(A, V)`` -- the
next unmasked position's advantage and value -- to ``(gamma lam A + gamma V + r - v, v)``, a
masked one is the identity), so each ``[BLOCK_B, BLOCK_T]`` tile of time is one
``tl.associative_scan`` (reverse) of those maps, applied to the state carried in from the
tile after it. The program walks its rows' tiles from the last one back: every load is a
contiguous run of ``BLOCK_T`` elements of a row, and each byte is read and written once.

A masked position is read for its mask alone (its reward and value loads are masked off),
so whatever it holds never enters. ``GAMMA`` and ``LAM`` are ``tl.constexpr`` (fixed for a
run; a Python float passed as a plain argument would reach the kernel as fp32 eagerly and
fp64 compiled).
"""

import triton
import triton.language as tl

#: Rows per program and time steps per tile: B = 512 gives 256 programs (about two per SM on
#: an H100 / H200), a tile of 1,024 elements keeps the five scanned maps in registers.
GAE_BLOCK_B = 2
GAE_BLOCK_T = 512
GAE_WARPS = 4


@triton.jit
def _after(p2, q2, s2, u2, w2, p1, q1, s1, u1, w1):
    """The reverse scan's combine: ``(2)`` the maps of later positions (applied first),
    ``(1)`` the current one; returns ``(1) after (2)``."""
    return (p1 * p2, p1 * q2 + q1 * s2, s1 * s2, p1 * u2 + q1 * w2 + u1, s1 * w2 + w1)


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
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = rows < n_rows
    rows = rows.to(tl.int64)[:, None]
    offsets = tl.arange(0, BLOCK_T)[None, :]
    carry_a = tl.zeros([BLOCK_B], dtype=tl.float32)  # A of the next unmasked position
    carry_v = tl.zeros([BLOCK_B], dtype=tl.float32)  # V of the next unmasked position
    n_tiles = tl.cdiv(n_steps, BLOCK_T)
    for tile in range(0, n_tiles):
        cols = (n_tiles - 1 - tile) * BLOCK_T + offsets
        inside = live[:, None] & (cols < n_steps)
        on = (tl.load(mask_ptr + rows * stride_m + cols, mask=inside, other=0) != 0) & inside
        r = tl.load(rewards_ptr + rows * stride_r + cols, mask=on, other=0.0)
        v = tl.load(values_ptr + rows * stride_v + cols, mask=on, other=0.0)
        # Each position's map (masked: the identity), then their reverse composition.
        p = tl.where(on, GAMMA * LAM, 1.0)
        q = tl.where(on, GAMMA, 0.0)
        s = tl.where(on, 0.0, 1.0)
        p, q, s, u, w = tl.associative_scan((p, q, s, r - v, v), 1, _after, reverse=True)
        # Applied to the state carried in from the tiles after this one.
        a = p * carry_a[:, None] + q * carry_v[:, None] + u
        next_v = s * carry_v[:, None] + w
        tl.store(adv_ptr + rows * stride_o + cols, tl.where(on, a, 0.0), mask=inside)
        tl.store(ret_ptr + rows * stride_o + cols, tl.where(on, a + v, 0.0), mask=inside)
        # The state entering the tile before: this tile's first column.
        first = offsets == 0
        carry_a = tl.sum(tl.where(first, a, 0.0), axis=1)
        carry_v = tl.sum(tl.where(first, next_v, 0.0), axis=1)
