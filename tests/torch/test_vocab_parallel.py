"""Vocabulary-parallel ``ratiokl.torch.loss`` over ``gloo``: 2 and 4 CPU processes.

Each test starts WORLD ranks, each a fresh Python process running
``vocab_parallel_worker.py`` on a fresh free port (not forked: this process
may hold JAX's threads, and a fork of a multithreaded process can deadlock);
every rank must exit 0. The worker holds the comparisons: sharded vs the float64
spec and vs the unsharded call, outputs and each rank's gradient slice, on
uneven shards, inactive rows poisoned in one shard, vocabulary masking, an
active NaN, out-of-range ids, empty input and sub-groups (TP inside DP).
The ``backend="interpret"`` checks (the Triton kernels on each shard) are in
``vocab_parallel_interpret_worker.py`` and run on 2 ranks; the linear ops with the
lm_head's rows sharded in ``vocab_parallel_linear_worker.py``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
WORKER = HERE / "vocab_parallel_worker.py"
#: Seconds for all ranks together (each imports torch, then runs its checks).
TIMEOUT = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(world: int, checks: str = "") -> None:
    """Start ``world`` ranks running ``checks`` (``PATH:FUNCTION``; default the native
    suite); all must exit 0. A rank that fails reports its traceback; the rest are
    stopped rather than left waiting in a collective."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    extra = [checks] if checks else []
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(world), str(port),
                               *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, env=env)
             for rank in range(world)]
    deadline = time.monotonic() + TIMEOUT
    failures = []
    try:
        for rank, proc in enumerate(procs):
            try:
                _, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                failures.append(f"rank {rank} did not finish within {TIMEOUT} s")
                break
            if proc.returncode != 0:
                failures.append(err[-6000:] or f"rank {rank} exited {proc.returncode}")
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_matches_unsharded(world: int) -> None:
    _run_ranks(world)


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
def test_interpret_backend_sharded_matches_unsharded() -> None:
    """The Triton kernels (interpreted) on 2 gloo ranks' shards."""
    pytest.importorskip("triton")
    _run_ranks(2, f"{HERE / 'vocab_parallel_interpret_worker.py'}:run_interpret")


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("world", [2, 3])
def test_linear_ops_sharded_head_match_unsharded(world: int) -> None:
    """Both linear ops with the lm_head's rows sharded (uneven blocks), native backend."""
    _run_ranks(world, f"{HERE / 'vocab_parallel_linear_worker.py'}:run_native")


@pytest.mark.skipif(not dist.is_gloo_available(), reason="torch built without gloo")
def test_linear_ops_sharded_head_interpret_backend() -> None:
    """The linear ops' chunks on the Triton kernels (interpreted), 2 ranks."""
    pytest.importorskip("triton")
    _run_ranks(2, f"{HERE / 'vocab_parallel_linear_worker.py'}:run_interpret")
