"""Vocabulary-parallel ``ratiokl.jax.loss`` (``vocab_axis=`` in ``shard_map``) on 4 CPU devices.

The checks live in ``vocab_parallel_worker.py`` and run in a subprocess:
``--xla_force_host_platform_device_count=4`` must be set before JAX
initialises, which would otherwise leak into the other tests of this
pytest worker. Each test runs a few named checks and requires a clean exit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import pytest

pytest.importorskip("jax")

WORKER = Path(__file__).with_name("vocab_parallel_worker.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def _run(*checks: str, worker: Path = WORKER, backend: Tuple[str, ...] = ()) -> None:
    """Run ``checks`` in ``worker`` (``backend``: the linear worker's first argument)."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(worker), *backend, *checks], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.split() == [w for c in checks for w in ("ok", c)], proc.stdout


def test_conformance_fixtures_sharded_over_four_devices() -> None:
    """The CI subset of ratio_kl / selected_logprobs fixtures, V padded with -inf."""
    _run("fixtures")


def test_transforms_policy_loss_and_sharding_modes() -> None:
    """grad inside the body, check_vma=False, policy_loss, the rollout fixtures, plain jit,
    dp x tp, bad ids, HLO."""
    _run("grad_inside_body", "vma_off", "policy_loss", "rollout_fixtures",
         "plain_jit_named_sharding",
         "data_and_tensor_parallel", "bad_ids_and_errors", "collectives")


def test_triton_path_through_the_interpreter() -> None:
    """``backend="triton"`` blocks (kernels interpreted behind pure_callback): fixtures,
    ``check_vma=False`` (auto falls back, triton refuses), grad inside the body, policy_loss."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    _run("fixtures", "vma_off", "grad_inside_body", "policy_loss",
         worker=WORKER.with_name("vocab_parallel_triton_worker.py"))


LINEAR = WORKER.with_name("vocab_parallel_linear_worker.py")


def test_linear_ops_sharded_head_native() -> None:
    """Both linear ops with the lm_head's rows on ``tp`` (native): values and gradients vs
    the spec and the unsharded call, grad inside the body, a dp x tp mesh (and the
    replicated head with rows on dp), rows on dp alone (the loss's psum), the refusals, bad
    ids, the compiled collectives; linear fixtures over 2 devices (a mixed-dtype head too),
    judged against their expectations and tolerances."""
    _run("logprobs", "grad_inside_body", "data_and_tensor_parallel", "policy_loss",
         "data_parallel", "refusals", "bad_ids", "collectives", "fixtures", worker=LINEAR,
         backend=("native",))


def test_linear_ops_sharded_head_interpret() -> None:
    """The linear ops' chunks on the Triton kernels (interpreted behind pure_callback)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    _run("logprobs", "policy_loss", "data_parallel", "bad_ids", worker=LINEAR,
         backend=("interpret",))
