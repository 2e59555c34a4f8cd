"""Shared benchmark machinery: timers, peak memory, metadata, the results file.

User timing (what a trainer sees; PERF.md), milliseconds per call:

- torch on CUDA: ``triton.testing.do_bench(fn)`` with its defaults (25 ms
  warm-up, 100 ms of runs, a 256 MB L2 flush before each run, the *mean*),
  no device head start: host time shows wherever the device waits for it;
- JAX on a GPU: the jitted call in a plain wall loop (do_bench's budget),
  ending in ``block_until_ready``;
- CPU: as device timing (below).

Device timing (what the kernels could do), the median of repeated runs:

- torch on CUDA: ``triton.testing.do_bench``'s method (CUDA events around
  each run, the L2 flushed before each by writing a buffer, the median), with
  a 1 GiB flush instead of do_bench's 256 MB, followed by a device-side wait
  (``torch.cuda._sleep``) of about 1.5x the op's host time. Both are enqueued
  before the start event, so the host's Python work for the op (validation,
  small framework ops, launches: 0.2-1.7 ms on the H200's host) is done
  before the device reaches the op and the events bracket device time only.
  Without the wait that host time leaked into small ops (N = 128: a policy
  loss forward read 1.01 ms by events alone, 0.16 ms with the wait). The
  host time is reported on its own (``host_ms``); for large ops both agree;
- JAX on a GPU: JAX work runs on its own stream, which torch's CUDA events
  cannot bracket, so batches of ``[flush, op]`` are enqueued back to back and
  timed on the host, minus a batch of flushes alone; each run gets as many
  1 GiB flushes as keep the device busy ~1.5x the op's host dispatch time,
  so the host stays ahead of the device (with a single flush, dispatch time
  leaked into N = 128 ops: a forward read 0.26 ms, more than its forward +
  backward). The median over batches is reported;
- CPU: ``time.perf_counter`` around each (synchronised) call, no flush, after
  warm-up calls (the preset's ``warmup_ms``, at least ``_CPU_WARMUP_CALLS``): the first
  calls of a new shape and dtype (oneDNN's bf16 GEMM primitives, the allocator) can run
  many times slower, and a median of three runs right after the first call could keep
  them (the cpu-smoke lm_head step's user row once read 664x its GEMMs).

Issue time (``issue_ms``): wall ms for the host to return from one call, the
mean of ``_ISSUE_CALLS`` calls in a row. torch on CUDA: a device-side wait
long enough for the host to issue them all is queued first, so the device
is busy throughout; whether it had drained before the host returned from
the last call is ``issue_blocked`` (the call waits for the GPU, e.g. ratiokl's
default ``check_ids=True`` reading its check: the time is the backlog, not
the host's cost). JAX: the time to return from dispatching the jitted call.
CPU (torch): the calls run synchronously, so it is their wall time.

CUDA graphs (:func:`cuda_graph`): the call is warmed up on a side stream,
captured once with ``torch.cuda.graph`` and timed as ``graph.replay``.

Extra peak memory is what the op allocates beyond the inputs it is given:
torch ``max_memory_allocated`` minus ``memory_allocated`` just before the
call (CUDA only), and for JAX XLA's compiled memory analysis of the jitted
op (temporaries + outputs - aliased), on any backend.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

__all__ = [
    "GraphReplay",
    "RECORD_FIELDS",
    "ResultsWriter",
    "cpu_ms",
    "cuda_graph",
    "cuda_ms",
    "host_ms",
    "jax_gpu_ms",
    "jax_issue_ms",
    "jax_peak_extra",
    "jax_wall_ms",
    "metadata",
    "torch_issue_ms",
    "torch_peak_extra",
    "user_ms",
]

#: Bytes written between runs to evict the GPU's L2 cache (50 MB on an H200)
#: and to keep the host ahead of the device (see the module doc).
_FLUSH_BYTES = 1024**3
#: Host-timed JAX batches per measurement.
_JAX_BATCHES = 5
#: Runs of one timing: at least (a median of fewer is noise), at most (time).
_MIN_RUNS, _MAX_RUNS = 5, 200
#: ``triton.testing.do_bench``'s default budget (ms), also the JAX user timing's.
_USER_WARMUP_MS, _USER_REP_MS = 25, 100
#: Calls in a row timed for the issue time.
_ISSUE_CALLS = 10
#: Warm-up calls before a CPU timing, at least (with a ``warmup_ms`` budget).
_CPU_WARMUP_CALLS = 5

_TORCH_FLUSH: Dict[str, torch.Tensor] = {}


def _runs(budget_ms: float, est_ms: float) -> int:
    return min(max(int(budget_ms / max(est_ms, 1e-3)), _MIN_RUNS), _MAX_RUNS)


#: Device clock cycles per millisecond assumed for the head-start wait (the H200 runs at
#: up to 1.98 GHz: the wait lasts at least as long as asked below that clock).
_CYCLES_PER_MS = 2_000_000


def host_ms(fn: Callable[[], Any], sync: Callable[[Any], Any], runs: int = 20) -> float:
    """Median wall-clock ms of issuing ``fn()`` (the host's share; synchronised between runs)."""
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        samples.append(time.perf_counter() - start)
        sync(out)
    return statistics.median(samples) * 1e3


def cuda_ms(fn: Callable[[], Any], warmup_ms: float, rep_ms: float, est_ms: float,
            host: float = 0.0) -> float:
    """Median device ms of ``fn`` (torch on CUDA), the L2 flushed before each run.

    ``est_ms`` (a warm call's wall time) sets the number of runs: about
    ``rep_ms`` worth, within ``[_MIN_RUNS, _MAX_RUNS]``. ``host`` (ms, from
    :func:`host_ms`) sets the device-side wait enqueued before each run.
    """
    if "buf" not in _TORCH_FLUSH:
        _TORCH_FLUSH["buf"] = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    flush = _TORCH_FLUSH["buf"]
    for _ in range(max(1, int(warmup_ms / max(est_ms, 1e-3)))):
        fn()
    runs = _runs(rep_ms, est_ms)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    wait = int(1.5 * host * _CYCLES_PER_MS)
    for start, end in zip(starts, ends):
        flush.zero_()
        if wait:
            torch.cuda._sleep(wait)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


#: do_bench's default budget of runs (ms); a call longer than a twentieth of it gets more.
_USER_REP_MS = 100.0


def user_ms(fn: Callable[[], Any], estimate_ms: float = 0.0) -> float:
    """User timing of ``fn`` (torch on CUDA): ``triton.testing.do_bench(fn)``, its defaults,
    except that a call of ``estimate_ms`` over 5 ms runs 20 times (the defaults' 100 ms
    budget gave the ~50 ms lm_head step two runs, and its figure swung by 5 ms)."""
    from triton.testing import do_bench

    if estimate_ms * 20 <= _USER_REP_MS:
        return float(do_bench(fn))
    return float(do_bench(fn, rep=20 * estimate_ms))


def _sleep_ms(ms: float) -> None:
    """Queue a device-side wait of at least ``ms`` (at up to 2 GHz) on the current stream."""
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS))


def torch_issue_ms(fn: Callable[[], Any], host: Optional[float],
                   calls: int = _ISSUE_CALLS) -> Tuple[float, Optional[bool]]:
    """``(issue ms, blocked)`` of ``fn`` (torch): the mean wall time of ``calls`` calls in a row.

    CUDA: first a device-side wait of ``2 * calls * host + 1`` ms (``host`` from
    :func:`host_ms`), so the device is busy while the host issues them;
    ``blocked``: the wait had finished when the host returned from the last
    call, i.e. the call waits for the GPU and the time is the backlog.
    CPU: the calls run synchronously; ``blocked`` is None.
    """
    drained = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        _sleep_ms(2 * calls * (host or 0.0) + 1.0)
        drained = torch.cuda.Event()
        drained.record()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    blocked = None if drained is None else bool(drained.query())
    if drained is not None:
        torch.cuda.synchronize()
    return elapsed / calls * 1e3, blocked


class GraphReplay:
    """A captured CUDA graph as a zero-argument call (``graph.replay()``); it keeps the
    captured outputs, which live in the graph's memory pool, alive with it."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: Any) -> None:
        self.graph, self.outputs = graph, outputs

    def __call__(self) -> None:
        self.graph.replay()


def cuda_graph(fn: Callable[[], Any], warmups: int = 3) -> GraphReplay:
    """``fn`` as a CUDA graph: warmed up on a side stream (compilation, autotuning and the
    allocator settle there), then captured once (``torch.cuda.graph``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return GraphReplay(graph, outputs)


def _block(value: Any) -> Any:
    import jax

    return jax.block_until_ready(value)


def jax_wall_ms(call: Callable[[], Any], est_ms: float) -> float:
    """User timing of a jitted JAX call: do_bench's budget of calls in a plain wall loop
    ending in ``block_until_ready`` (the device runs them in order: the last one ends it)."""
    out = None
    for _ in range(max(1, int(_USER_WARMUP_MS / max(est_ms, 1e-3)))):
        out = call()
    _block(out)
    runs = _runs(_USER_REP_MS, est_ms)
    start = time.perf_counter()
    for _ in range(runs):
        out = call()
    _block(out)
    return (time.perf_counter() - start) / runs * 1e3


def jax_issue_ms(call: Callable[[], Any], calls: int = _ISSUE_CALLS) -> float:
    """Issue time of a jitted JAX call: the mean wall time to return from ``calls``
    dispatches in a row (then blocked on)."""
    _block(call())
    out = None
    start = time.perf_counter()
    for _ in range(calls):
        out = call()
    elapsed = time.perf_counter() - start
    _block(out)
    return elapsed / calls * 1e3


class _JaxFlush:
    """A 1 GiB device buffer rewritten (donated, write-only) to evict L2."""

    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        self._zero = jax.jit(jnp.zeros_like, donate_argnums=0)
        self._buf = _block(jnp.ones(_FLUSH_BYTES // 4, jnp.int32))

    def __call__(self) -> Any:
        self._buf = self._zero(self._buf)
        return self._buf


_JAX_FLUSH: List[_JaxFlush] = []


def jax_gpu_ms(call: Callable[[], Any], warmup_ms: float, rep_ms: float, est_ms: float,
               host: float = 0.0) -> float:
    """Median per-call device ms of ``call`` (a jitted JAX op) on a GPU; see the module doc.

    ``host`` (ms, :func:`host_ms`): each run is preceded by as many flushes as
    it takes for the device to be busy ~1.5x that long, so the host's
    dispatch is done before the device reaches the op (the flushes-only batch
    subtracted has the same flushes).
    """
    if not _JAX_FLUSH:
        _JAX_FLUSH.append(_JaxFlush())
    flush = _JAX_FLUSH[0]

    def batch(k: int, with_op: bool, flushes: int) -> float:
        _block(flush())
        start = time.perf_counter()
        last = None
        for _ in range(k):
            for _ in range(flushes):
                last = flush()
            if with_op:
                last = (last, call())
        _block(last)
        return time.perf_counter() - start

    flush_ms = batch(8, False, 1) / 8 * 1e3
    flushes = max(1, math.ceil(1.5 * host / max(flush_ms, 1e-3)))
    batch(max(1, int(warmup_ms / max(est_ms, 1e-3))), True, flushes)
    k = _runs(rep_ms / _JAX_BATCHES, est_ms)
    samples = [(batch(k, True, flushes) - batch(k, False, flushes)) / k
               for _ in range(_JAX_BATCHES)]
    return max(statistics.median(samples), 0.0) * 1e3


def cpu_ms(call: Callable[[], Any], sync: Callable[[Any], Any], reps: int,
           warmup_ms: float = 0.0) -> float:
    """Median wall-clock ms of ``sync(call())`` over ``reps`` runs (no cache flush), after
    warm-up calls for ``warmup_ms`` and at least ``_CPU_WARMUP_CALLS`` (none if 0)."""
    calls = _CPU_WARMUP_CALLS if warmup_ms > 0 else 0
    deadline = time.perf_counter() + warmup_ms / 1e3
    while calls > 0 or time.perf_counter() < deadline:
        sync(call())
        calls -= 1
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        sync(call())
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def torch_peak_extra(fn: Callable[[], Any]) -> Optional[int]:
    """Bytes allocated at the peak of one ``fn()`` beyond what was held before; None off CUDA."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return int(peak)


def jax_peak_extra(compiled: Any) -> Optional[int]:
    """Temporaries + outputs - aliased bytes of a compiled JAX op (None if XLA won't say)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def source_digest(root: Path) -> str:
    """sha256 over the measured code: every ``src/ratiokl`` and ``benchmarks`` ``.py`` file
    (path and bytes, in sorted order). Recompute it on a checkout to match a result file."""
    digest = hashlib.sha256()
    files = sorted([*root.glob("src/ratiokl/**/*.py"), *root.glob("benchmarks/*.py")])
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git(root: Path, *args: str) -> Optional[str]:
    try:
        proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _ratiokl_source() -> Dict[str, Any]:
    """ratiokl's version, the checkout's commit, whether the tree differs from it (a copied
    tree may carry an older ``.git``), and :func:`source_digest` of what actually ran."""
    import ratiokl

    root = Path(__file__).resolve().parents[1]
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {
        "version": getattr(ratiokl, "__version__", None),
        "git_commit": _git(root, "rev-parse", "--verify", "-q", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "source_sha256": source_digest(root),
    }


def metadata() -> Dict[str, Any]:
    """The machine and software the results come from."""
    meta: Dict[str, Any] = {
        "ratiokl": _ratiokl_source(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            d: _version(d)
            for d in ("torch", "triton", "jax", "jaxlib", "jax-triton",
                      "liger-kernel", "numpy")
        },
        "gpu": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = {
            "name": props.name,
            "sm_count": props.multi_processor_count,
            "memory_bytes": props.total_memory,
            "cuda": torch.version.cuda,
        }
    return meta


#: Columns of every record, in CSV order.
RECORD_FIELDS = (
    "op", "provider", "framework", "mode", "timing", "N", "V", "H", "density", "dtype",
    "status", "ms", "gbps", "pct_read_ceiling", "pct_copy_ceiling", "peak_extra_bytes",
    "min_bytes", "host_ms", "issue_ms", "issue_blocked", "timer", "mem_method",
    "first_call_s", "reason",
)


class ResultsWriter:
    """Holds the run's metadata, ceilings, records and summary; rewrites the files on change.

    The JSON (``path``) holds everything; a CSV beside it (same stem) holds
    the records. Both are replaced atomically after every record, so an
    interrupted run keeps what it measured.
    """

    def __init__(self, path: Path, meta: Dict[str, Any]) -> None:
        self.path = path
        self.data: Dict[str, Any] = {
            "metadata": meta, "ceilings": {}, "records": [], "summary": {},
        }
        path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def records(self) -> List[Dict[str, Any]]:
        return self.data["records"]

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self._write()

    def add(self, record: Dict[str, Any]) -> None:
        self.records.append({k: record.get(k) for k in RECORD_FIELDS})
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, allow_nan=False) + "\n")
        os.replace(tmp, self.path)
        csv_path = self.path.with_suffix(".csv")
        tmp = csv_path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=RECORD_FIELDS)
            writer.writeheader()
            writer.writerows(self.records)
        os.replace(tmp, csv_path)
