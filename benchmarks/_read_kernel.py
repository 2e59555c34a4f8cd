"""Pure-read Triton reductions: the read-bandwidth yardsticks the operators are held to.

``row_sum_kernel``: one program per row sums the row in fp32 and stores one
float: the whole tensor is read once and almost nothing is written. The
main loop is unmasked (``V`` is a compile-time constant, so the compiler
knows the alignment and vectorises the loads); a masked tail handles
``V % BLOCK``. ``chunk_sum_kernel``: the same read cut into equal
contiguous chunks, one program each, so that a few rows still fill the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["chunk_sum_kernel", "row_sum_kernel"]


@triton.jit
def row_sum_kernel(
    x_ptr,  # [N, V] any float dtype, rows contiguous
    out_ptr,  # [N] float32: the row sums
    stride_row,  # elements between rows
    V: tl.constexpr,  # row length
    BLOCK: tl.constexpr,  # elements per loop step
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V - V % BLOCK, BLOCK):
        acc += tl.load(base + start + cols).to(tl.float32)
    if V % BLOCK != 0:
        tail = (V - V % BLOCK) + cols
        acc += tl.load(base + tail, mask=tail < V, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


@triton.jit
def chunk_sum_kernel(
    x_ptr,  # [TOTAL] any float dtype, contiguous
    out_ptr,  # [programs] float32: each chunk's sum
    TOTAL: tl.constexpr,  # elements
    CHUNK: tl.constexpr,  # elements per program (a multiple of BLOCK)
    BLOCK: tl.constexpr,  # elements per loop step
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK):
        offs = pid * CHUNK + start + cols
        acc += tl.load(x_ptr + offs, mask=offs < TOTAL, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))
