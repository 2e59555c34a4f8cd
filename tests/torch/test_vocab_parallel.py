"""Vocabulary-parallel ``ratiokl.torch.loss`` over ``gloo``: 2 and 4 CPU processes.

Each test forks WORLD ranks (fork, so no rank re-imports torch) that run
``vocab_parallel_worker.run_rank`` on a fresh free port; every rank must
report success. The worker holds the comparisons: sharded vs the float64
spec and vs the unsharded call, outputs and each rank's gradient slice, on
uneven shards, inactive rows poisoned in one shard, vocabulary masking, an
active NaN, out-of-range ids, empty input and sub-groups (TP inside DP).
The ``backend="interpret"`` checks (the Triton kernels on each shard) are in
``vocab_parallel_interpret_worker.py`` and run on 2 ranks.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import queue
import socket
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402


def _load_worker(stem: str = "vocab_parallel_worker"):
    """A worker script beside this file, loaded by path (tests are not a package)."""
    path = Path(__file__).with_name(f"{stem}.py")
    module_spec = importlib.util.spec_from_file_location(f"_ratiokl_{stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(world: int, checks=None) -> None:
    """Fork ``world`` ranks running ``checks(world)`` (default: the native suite); all must pass."""
    worker = _load_worker()
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    extra = () if checks is None else (checks,)
    procs = [ctx.Process(target=worker.run_rank, args=(rank, world, port, results) + extra)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    reports = {}
    try:
        for _ in range(world):
            rank, report = results.get(timeout=120)
            reports[rank] = report
    except queue.Empty:
        reports["timeout"] = f"only ranks {sorted(reports)} reported within 120 s"
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    failures = [f"rank {rank}:\n{report}" for rank, report in reports.items() if report]
    assert not failures, "\n".join(failures)
    assert sorted(reports) == list(range(world))


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matches_unsharded(world: int) -> None:
    _run_ranks(world)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
def test_interpret_backend_sharded_matches_unsharded() -> None:
    """The Triton kernels (interpreted) on 2 gloo ranks' shards."""
    pytest.importorskip("triton")
    _run_ranks(2, _load_worker("vocab_parallel_interpret_worker").run_interpret)
