"""The ``check_ids`` test in one launch: does an active row hold a bad id or temperature.

``active_check_kernel`` streams the ``[N]`` rows in blocks (one program) and
writes two int32 flags: ``flags[0]`` = some active row has an id outside
``[0, V)``, ``flags[1]`` = some active row has a temperature outside
``(0, inf)`` (NaN included). It replaces a chain of framework ops (two
comparisons, their ``|`` and ``&``, a reduction per test and a stack: about
six launches of host and device time) ahead of the call's kernels; in PyTorch
the flags go straight to a pinned host slot, which the host reads behind an
event once those kernels are queued (``ratiokl.torch._checks.ActiveCheck``).
Inactive rows are selected out: what they hold never sets a flag.
"""

import triton
import triton.language as tl

#: Rows per block of the one-program loop, and its warps.
CHECK_BLOCK = 2048
CHECK_WARPS = 4


@triton.jit
def active_check_kernel(
    ids_ptr,  # [N] int32/int64 action ids; read iff CHECK_IDS
    mask_ptr,  # [N] bool, nonzero = active row
    temp_ptr,  # [N] float temperature at temp_ptr + i * stride_t; read iff CHECK_TEMP
    flags_ptr,  # [2] int32 output: (bad id, bad temperature) on some active row
    N,
    V,  # vocabulary size: ids must lie in [0, V)
    stride_t,  # 0: one temperature for every row
    CHECK_IDS: tl.constexpr,
    CHECK_TEMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    bad_id = tl.zeros([BLOCK], tl.int32)
    bad_temp = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        offs = (start + cols).to(tl.int64)
        inside = offs < N
        active = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
        if CHECK_IDS:
            a = tl.load(ids_ptr + offs, mask=inside, other=0).to(tl.int64)
            bad_id = tl.maximum(bad_id, (active & ((a < 0) | (a >= V))).to(tl.int32))
        if CHECK_TEMP:
            t = tl.load(temp_ptr + offs * stride_t, mask=inside, other=1.0).to(tl.float32)
            valid = (t > 0.0) & (t < float("inf"))  # False for NaN
            bad_temp = tl.maximum(bad_temp, (active & (valid == 0)).to(tl.int32))
    tl.store(flags_ptr, tl.max(bad_id, axis=0))
    tl.store(flags_ptr + 1, tl.max(bad_temp, axis=0))
