"""Bandwidth ceilings measured in the benchmark's own process.

- copy: ``dst.copy_(src)`` of a 2 GiB buffer; read + write bytes counted;
- read: the Triton row reduction of ``_read_kernel`` over an ``[8192, 151936]``
  bf16 tensor (the headline shape), best of a small grid of block sizes and
  warp counts;
- few-rows read (GPU only): the best pure read (``chunk_sum_kernel``, a small
  grid of programs, blocks and warps) of exactly the bytes of the few-rows
  forwards (N = 128 and N = 1024, V = 151,936, bf16: one tensor, or two with
  reference logits), with the device timer: what any kernel could reach there.

- host floor (``autograd_floor_issue_ms``): the issue time (``_harness.torch_issue_ms``)
  of a one-input ``torch.autograd.Function`` that launches nothing, forward alone and
  forward + ``torch.autograd.grad``: what any eager autograd op pays before its own work
  (on the H200's host about 0.01 and 0.09 ms: the backward crosses to autograd's CUDA
  thread and back).

On the CPU the same quantities are measured with torch ops (``copy_`` and
``sum``) so the smoke run exercises this code; they are not a GPU ceiling.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Tuple

import torch

from _cases import Timing
from _harness import cpu_ms, cuda_ms, torch_issue_ms

__all__ = ["measure_ceilings"]

_COPY_BYTES_GPU = 2 * 1024**3
_COPY_BYTES_CPU = 32 * 1024**2
_READ_SHAPE_GPU = (8192, 151936)
_READ_SHAPE_CPU = (256, 32768)
#: (BLOCK, num_warps) grid for the read kernel.
_READ_CONFIGS = tuple((b, w) for b in (2048, 4096, 8192) for w in (8, 16))
#: The few-rows forwards' row counts N and V (bf16 [N, V] tensors), and (programs, BLOCK,
#: num_warps) to try.
_FEW_ROWS, _FEW_V = (128, 1024), 151936
_FEW_CONFIGS = tuple((p, b, w) for p in (1056, 2112, 4224) for b in (2048, 8192)
                     for w in (8, 16))


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _timer(timing: Timing, on_gpu: bool) -> Callable[[Callable[[], Any]], float]:
    if on_gpu:
        return lambda fn: cuda_ms(fn, timing.warmup_ms, timing.rep_ms, est_ms=1.0)
    return lambda fn: cpu_ms(fn, lambda _: None, max(timing.cpu_reps, 3))


def _fastest(nbytes: int, runs: Iterable[Tuple[str, Callable[[], None]]],
             timing: Timing) -> Tuple[float, str]:
    """GB/s and label of the fastest ``(label, run)`` reading ``nbytes`` (each run once to
    compile, then timed)."""
    best = (0.0, "")
    for label, run in runs:
        run()
        best = max(best, (_gbps(nbytes, _timer(timing, True)(run)), label))
    return best


def _read_gpu(x: torch.Tensor, timing: Timing) -> Dict[str, Any]:
    from _read_kernel import row_sum_kernel

    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)

    def runs():
        for block, warps in _READ_CONFIGS:
            yield f"BLOCK={block} num_warps={warps}", functools.partial(
                row_sum_kernel[(x.shape[0],)], x, out, x.stride(0), V=x.shape[1], BLOCK=block,
                num_warps=warps)

    gbps, label = _fastest(x.numel() * x.element_size(), runs(), timing)
    return {"read_gbps": gbps,
            "read_method": f"triton row sum {label} on {list(x.shape)} {x.dtype}"}


def _few_rows_read(timing: Timing, read_gbps: float) -> List[Dict[str, Any]]:
    """Best pure read of the few-rows forwards' bytes (each N; one and two tensors), as % of
    read."""
    from _read_kernel import chunk_sum_kernel

    out = torch.empty(max(p for p, _, _ in _FEW_CONFIGS), dtype=torch.float32, device="cuda")
    found = []
    for rows in _FEW_ROWS:
        for tensors in (1, 2):
            x = torch.ones(tensors * rows * _FEW_V, dtype=torch.bfloat16, device="cuda")

            def runs(x: torch.Tensor = x):
                for programs, block, warps in _FEW_CONFIGS:
                    chunk = -(-x.numel() // programs // block) * block
                    yield (f"{programs} programs BLOCK={block} num_warps={warps}",
                           functools.partial(chunk_sum_kernel[(-(-x.numel() // chunk),)], x, out,
                                             TOTAL=x.numel(), CHUNK=chunk, BLOCK=block,
                                             num_warps=warps))

            nbytes = x.numel() * x.element_size()
            gbps, label = _fastest(nbytes, runs(), timing)
            found.append({"rows": rows, "V": _FEW_V, "tensors": tensors, "bytes": nbytes,
                          "gbps": gbps, "pct_read_ceiling": 100.0 * gbps / read_gbps,
                          "method": f"triton chunk sum, {label}"})
            del x
    return found


class _Nothing(torch.autograd.Function):
    """A 0-d output from one input, a stored gradient back: the autograd op with no work."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.grad = torch.empty_like(x)
        return x.new_empty(())

    @staticmethod
    def backward(ctx, _g: torch.Tensor) -> torch.Tensor:
        return ctx.grad


def _autograd_floor(device: torch.device) -> Dict[str, float]:
    """Issue ms of :class:`_Nothing`: ``{"fwd": forward, "fwd+bwd": forward + grad}``."""
    x = torch.zeros(4, device=device, requires_grad=True)
    calls = {"fwd": lambda: _Nothing.apply(x),
             "fwd+bwd": lambda: torch.autograd.grad(_Nothing.apply(x), x)}
    floor = {}
    for mode, call in calls.items():
        for _ in range(20):  # warm: autograd's device thread, the allocator
            call()
        floor[mode] = min(torch_issue_ms(call, 0.2)[0] for _ in range(5))
    return floor


def measure_ceilings(on_gpu: bool, timing: Timing) -> Dict[str, Any]:
    """``{"copy_gbps", "read_gbps", "copy_method", "read_method", "autograd_floor_issue_ms"}``
    for this device, and on a GPU ``"few_rows_read"``: a list of ``{"rows", "V", "tensors",
    "bytes", "gbps", "pct_read_ceiling", ...}``, the best pure read of the few-rows
    forwards' bytes."""
    device = torch.device("cuda" if on_gpu else "cpu")
    time_it = _timer(timing, on_gpu)
    nbytes = _COPY_BYTES_GPU if on_gpu else _COPY_BYTES_CPU
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = _gbps(2 * nbytes, time_it(lambda: dst.copy_(src)))
    del src, dst
    result: Dict[str, Any] = {"copy_gbps": copy,
                              "copy_method": f"torch copy_ of {nbytes} bytes (read + write)"}
    if on_gpu:
        result.update(_read_gpu(torch.ones(_READ_SHAPE_GPU, dtype=torch.bfloat16,
                                           device=device), timing))
        result["few_rows_read"] = _few_rows_read(timing, result["read_gbps"])
        torch.cuda.empty_cache()
    else:
        x = torch.ones(_READ_SHAPE_CPU, dtype=torch.float32)
        ms = time_it(lambda: x.sum())
        result.update(read_gbps=_gbps(x.numel() * x.element_size(), ms),
                      read_method=f"torch sum on {list(x.shape)} float32 (CPU stand-in)")
    result["autograd_floor_issue_ms"] = _autograd_floor(device)
    return result
