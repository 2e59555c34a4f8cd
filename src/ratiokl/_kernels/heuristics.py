"""Launch configurations by heuristic (never autotuned), shared by both frameworks.

A configuration depends only on the vocabulary size and the logits' element
size -- never on the number of rows or on values -- so a row's reduction
order, hence its bits, is the same in any batch (batch invariance), and
jax-triton launches stay valid under CUDA-graph capture.

Measured on the H200 (bf16, N=8192, V=151,936, ``benchmarks/gpu_smoke.py
--sweep``): the forward, which streams two tensors, is fastest with 4 warps
and 64 bytes per thread per tensor and tile (4096 x 4 warps: 1.17 ms, about 94 %
of the read ceiling in PERF.md; 8 warps: 1.36 ms); the backward (one read, one
write) is within 2 % across 8-16 warps and 16-64 bytes per thread, best at
16 warps and 32 bytes (8192 x 16 warps: 1.24 ms).
"""

from typing import NamedTuple

__all__ = ["LaunchConfig", "backward_config", "forward_config"]

#: Smallest tile: keeps tiny vocabularies to one masked block.
_MIN_BLOCK = 16


class LaunchConfig(NamedTuple):
    """Tile size over the vocabulary and the warps of one row's program."""

    block_v: int
    num_warps: int


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _config(vocab: int, itemsize: int, num_warps: int, bytes_per_thread: int) -> LaunchConfig:
    """Tile of ``num_warps * 32`` threads x ``bytes_per_thread``, shrunk to the vocabulary.

    A shrunk tile keeps at least one 16-byte vector per thread by using fewer warps.
    """
    block = num_warps * 32 * max(1, bytes_per_thread // itemsize)
    block = max(_MIN_BLOCK, min(block, _next_pow2(vocab)))
    warps = max(1, min(num_warps, block // (32 * max(1, 16 // itemsize))))
    return LaunchConfig(block_v=block, num_warps=warps)


def forward_config(vocab: int, itemsize: int) -> LaunchConfig:
    """Forward tile for ``[N, vocab]`` logits of ``itemsize`` bytes (4096 x 4 warps in bf16)."""
    return _config(vocab, itemsize, num_warps=4, bytes_per_thread=64)


def backward_config(vocab: int, itemsize: int) -> LaunchConfig:
    """Backward tile (8192 x 16 warps in bf16)."""
    return _config(vocab, itemsize, num_warps=16, bytes_per_thread=32)
