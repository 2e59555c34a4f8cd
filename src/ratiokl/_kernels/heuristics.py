"""Launch configurations by heuristic (never autotuned), shared by both frameworks.

A configuration depends only on the vocabulary size and the logits' element
size -- never on the number of rows or on values -- so a row's reduction
order, hence its bits, is the same in any batch (batch invariance), and
jax-triton launches stay valid under CUDA-graph capture.

Measured on the H200 (bf16, N=8192, V=151,936; docs/performance.md, "Experiments
retired from benchmarks/"): the forward, which streams two tensors, is fastest with 4 warps
and 64 bytes per thread per tensor and tile (4096 x 4 warps: 1.17 ms, about 94 %
of the read ceiling in PERF.md; 8 warps: 1.36 ms); the backward (one read, one
write) is within 2 % across 8-16 warps and 16-64 bytes per thread, best at
16 warps and 32 bytes (8192 x 16 warps: 1.24 ms; 16384 x 16 warps 1.23 since the kernel
holds 32 registers instead of 62, within run-to-run noise, so unchanged; a device copy of
the same bytes 1.16 ms).
"""

import functools
from typing import NamedTuple, Optional, Tuple

__all__ = [
    "BackwardPlan",
    "ForwardPlan",
    "FusedPlan",
    "SCALE_WARPS",
    "LaunchConfig",
    "SplitPlan",
    "backward_config",
    "backward_plan",
    "backward_splits",
    "forward_config",
    "forward_plan",
    "launch_plan",
    "scale_block",
    "split_plan",
    "use_split_forward",
]

#: Smallest tile: keeps tiny vocabularies to one masked block.
_MIN_BLOCK = 16
#: Vocabulary splits of a row's log-sum-exp (fewer when the row has fewer tiles). H200,
#: bf16, V = 151,936, ratio_kl forward as a CUDA graph: N = 128 at 948 GB/s unsplit, 2,370
#: with 4 splits, 2,980 with 8, 2,870 with 13; N = 8192 (one program per row) 1.258 ms with
#: 1 span, 1.262 with 4, 1.264 with 8, 1.266 with 13 (spans cost nothing there).
_SPLITS = 8
#: Below this many rows the forward runs one program per (row, split) plus a combine
#: (N = 1024 one program per row: 3,600 GB/s, already near the N = 8192 rate).
_SPLIT_BELOW_ROWS = 1024
#: Programs the backward aims for (132 SMs x 4) when rows alone are fewer.
_BACKWARD_PROGRAMS = 528


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


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def forward_config(vocab: int, itemsize: int) -> LaunchConfig:
    """Forward tile for ``[N, vocab]`` logits of ``itemsize`` bytes (4096 x 4 warps in bf16)."""
    return _config(vocab, itemsize, num_warps=4, bytes_per_thread=64)


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def backward_config(vocab: int, itemsize: int) -> LaunchConfig:
    """Backward tile (8192 x 16 warps in bf16)."""
    return _config(vocab, itemsize, num_warps=16, bytes_per_thread=32)


class SplitPlan(NamedTuple):
    """A row's tiles cut into ``splits`` consecutive spans of ``tiles_per_split`` tiles."""

    splits: int
    tiles_per_split: int


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def split_plan(vocab: int, block_v: int, max_splits: int = _SPLITS) -> SplitPlan:
    """How the forward's log-sum-exp of a row is cut into partial ``(max, sum)`` pairs.

    ``block_v`` is the forward tile (``forward_config``). A function of the
    vocabulary and the tile alone (never of the row count): both forward
    paths -- one program per row, or one per (row, split) plus a combine --
    fold the same spans in the same order, so a row's bits do not depend on
    the batch or on which path ran. No split is empty. ``max_splits`` is for
    tuning sweeps only; the library always uses the default.
    """
    tiles = -(-vocab // block_v)
    per_split = -(-tiles // max(1, max_splits))
    return SplitPlan(splits=-(-tiles // per_split), tiles_per_split=per_split)


def use_split_forward(n_rows: int, plan: SplitPlan) -> bool:
    """Whether the forward launches a program per (row, split): too few rows to fill the GPU.

    Speed only: both paths give the same bits (see :func:`split_plan`).
    """
    return n_rows < _SPLIT_BELOW_ROWS and plan.splits > 1


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def backward_splits(n_rows: int, vocab: int, itemsize: int) -> int:
    """Programs per row of the backward (each takes a span of whole tiles).

    The backward is elementwise given the forward's log-sum-exp, so the split
    changes no bit; it only fills the GPU when rows are few.
    """
    tiles = -(-vocab // backward_config(vocab, itemsize).block_v)
    want = -(-_BACKWARD_PROGRAMS // max(1, n_rows))
    return max(1, min(tiles, want))


class ForwardPlan(NamedTuple):
    """The row forward's launches for ``n_rows`` rows: the tile, the row's spans, and
    whether a program runs per (row, span) plus a per-row combine (``split``; else one
    program per row). Both bindings and the tests' plan enumerator read it."""

    config: LaunchConfig
    spans: SplitPlan
    split: bool


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def forward_plan(n_rows: int, vocab: int, itemsize: int, config: Optional[LaunchConfig] = None,
                 spans: Optional[SplitPlan] = None,
                 split: Optional[bool] = None) -> ForwardPlan:
    """The row forward's plan (:func:`forward_config`, :func:`split_plan` of its tile,
    :func:`use_split_forward`); ``config``, ``spans`` and ``split`` override a choice (tuning
    sweeps and tests; the spans then follow the overriding tile)."""
    config = config or forward_config(vocab, itemsize)
    spans = spans or split_plan(vocab, config.block_v)
    return ForwardPlan(config, spans, use_split_forward(n_rows, spans) if split is None
                       else split)


class BackwardPlan(NamedTuple):
    """The backward's launch: the tile, and whole tiles per program; the grid is ``(N,
    programs_per_row)``."""

    config: LaunchConfig
    tiles_per_program: int
    programs_per_row: int

    def grid(self, n_rows: int) -> Tuple[int, int]:
        """The launch grid for ``n_rows`` rows."""
        return n_rows, self.programs_per_row


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def backward_plan(n_rows: int, vocab: int, itemsize: int,
                  config: Optional[LaunchConfig] = None) -> BackwardPlan:
    """The backward's plan: :func:`backward_splits` programs' worth of whole tiles each;
    ``config`` overrides the tile (tuning sweeps), the split count stays the default's."""
    config = config or backward_config(vocab, itemsize)
    tiles = -(-vocab // config.block_v)
    per_program = -(-tiles // backward_splits(n_rows, vocab, itemsize))
    return BackwardPlan(config, per_program, -(-tiles // per_program))


#: Spans of a row in the fused kernel (fewer when the row has fewer tiles).
_FUSED_SPLITS = 10


class FusedPlan(NamedTuple):
    """Launch of the fused kernel: tile and warps, the row's spans, spans per program."""

    config: LaunchConfig
    spans: SplitPlan
    spans_per_program: int

    @property
    def row_programs(self) -> int:
        """Programs per row (1: a program per row, no device counter)."""
        return self.spans.splits // self.spans_per_program

    def programs(self, n_rows: int) -> int:
        """Programs of the launch: one per (row, group of ``spans_per_program`` spans)."""
        return n_rows * self.row_programs

    def counters(self, n_rows: int) -> int:
        """int32 counters the launch needs zeroed (``count_ptr``): ``n_rows + 1``, or none
        (0) with a program per row, which takes its row by program id and waits for none."""
        return n_rows + 1 if self.row_programs > 1 else 0


@functools.lru_cache(maxsize=1024)  # pure; called once per launch (host time)
def launch_plan(vocab: int, itemsize: int, n_rows: int, write_grad: bool) -> FusedPlan:
    """How the fused kernel cuts a row: ``_FUSED_SPLITS`` spans, one program each (on a GPU).

    A row's programs each read their span (the log-sum-exp partials), meet at
    a device-side counter to combine the row's statistics, then write their
    span's gradient while it is still in L2. On the H200 (bf16, N = 8192,
    V = 151,936) 10 spans of 4096 x 4 warps were the best of the plans tried;
    one program per row and spans held in registers were slower, and without
    a gradient one program per row is best once enough rows fill the GPU
    (``heuristics.use_split_forward``): the measurements are in
    docs/performance.md ("Experiments retired from benchmarks/"). The plan is
    the same on a GPU and in Triton's interpreter.
    The spans depend only on ``V`` and the element size and every program
    combines them the same way: no launch changes a bit (batch invariance).
    """
    config = forward_config(vocab, itemsize)
    spans = split_plan(vocab, config.block_v, _FUSED_SPLITS)
    whole_rows = not (write_grad or use_split_forward(n_rows, spans))
    return FusedPlan(config, spans, spans.splits if whole_rows else 1)


#: Warps of ``scale_rows_kernel`` (a plain streaming read-modify-write).
SCALE_WARPS = 8


def scale_block(vocab: int) -> int:
    """``scale_rows_kernel``'s tile: the row rounded up to a power of two, 16 to 4096."""
    return min(4096, max(16, 1 << (vocab - 1).bit_length()))
