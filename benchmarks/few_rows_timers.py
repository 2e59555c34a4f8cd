"""Where the time of a few-row forward goes: one JSON line per op (CUDA GPU).

    PYTHONPATH=src python benchmarks/few_rows_timers.py

N = 128 rows, V = 151,936, bf16, no gradient. Each op is timed by CUDA
events around one call (median of 200, host kept ahead by a device sleep)

- after the suite's L2 flush (``zero_`` of 1 GiB: the cache is left full of
  dirty lines, written back while the op runs) and after a flush that then
  reads 256 MiB (clean lines);
- as the eager call and as a CUDA-graph replay of it (no launch from the host);
- and an empty event pair, the timer's own floor;

beside the kernels' own durations (``torch.profiler``, microseconds).
"""

from __future__ import annotations

import json
import statistics
from typing import Callable

import torch

from ratiokl.torch import loss

N, V = 128, 151_936
RUNS = 200
_FLUSH = {}


def _timed(fn: Callable[[], object], clean: bool) -> float:
    """Median ms of ``fn`` between two events, the L2 flushed before each run."""
    flush, reread = _FLUSH["write"], _FLUSH["read"]
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(RUNS)]
    for start, end in zip(starts, ends):
        flush.zero_()
        if clean:
            reread.view(torch.int32).sum()
        torch.cuda._sleep(2_000_000)  # ~1 ms: the host enqueues the op meanwhile
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _kernels_us(fn: Callable[[], object]) -> list:
    """``[name, device us]`` of each kernel one call launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [[e.name, round(e.device_time, 1)] for e in prof.events()
            if e.device_type.name == "CUDA"]


def _graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn()  # warm on the capture stream
        with torch.cuda.graph(graph):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return graph


def main() -> None:
    _FLUSH["write"] = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    _FLUSH["read"] = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    policy = torch.randn(N, V, device="cuda", generator=g).to(torch.bfloat16)
    ref = torch.randn(N, V, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(0, V, (N,), device="cuda", generator=g)
    mask = torch.ones(N, dtype=torch.bool, device="cuda")
    old = torch.full((N,), -12.0, device="cuda")
    kw = dict(backend="triton", check_ids=False)
    ops = {
        "selected_logprobs": (lambda: loss.selected_logprobs(policy, ids, mask, **kw), 1),
        "ratio_kl": (lambda: loss.ratio_kl(policy, ref, ids, mask, old, **kw), 2),
    }
    for name, (fn, tensors) in ops.items():
        with torch.no_grad():
            graph = _graph(fn)
            record = {
                "op": name, "N": N, "V": V, "read_bytes": tensors * N * V * 2,
                "events_ms": _timed(fn, clean=False),
                "events_clean_l2_ms": _timed(fn, clean=True),
                "graph_ms": _timed(graph.replay, clean=False),
                "graph_clean_l2_ms": _timed(graph.replay, clean=True),
                "empty_event_pair_ms": _timed(lambda: None, clean=False),
                "kernels_us": _kernels_us(fn),
            }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
