"""The suite's ``vocab-parallel`` preset (``benchmarks/_vocab_parallel.py``): its CPU dry run (gloo ranks, JAX host devices) through
the real entry point, and the helpers that turn measurements into the recorded verdicts.

The dry run (``--cpu --tp 2``, N = 16, V = 48: about 30 s on 2 cores) must pass every
check of every case the installed ratiokl supports and both fault checks; its timings
mean nothing, so only their presence is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "run.py"
sys.path.insert(0, str(RUNNER.parent))

import _vocab_parallel as vp  # noqa: E402


def test_cpu_dry_run_passes_its_checks(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    command = [sys.executable, str(RUNNER), "--preset", "vocab-parallel", "--cpu", "--tp", "2",
               "--out", str(tmp_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "cpux2_vocab_parallel.json").read_text())
    assert doc["tp"] == 2 and doc["parts"] == ["torch", "jax"]
    assert doc["environment"]["env"]["NCCL_NVLS_ENABLE"] == "0"
    names = {c.name for c in vp.cases()}
    for framework in ("torch", "jax"):
        part = doc[framework]
        assert set(part["cases"]) == names
        assert part["fault_check"]["passed"], part["fault_check"]
        ran = [r for r in part["cases"].values() if r["status"] == "ok"]
        assert len(ran) >= 10, part["cases"]
        for rec in ran:
            assert rec["passed"] and {"grad"} < set(rec["checks"]), rec
            assert set(rec["ms"]) >= {"sharded", "unsharded", "allreduce_alone"}
            assert rec["collectives"] and isinstance(rec["target"]["met"], bool)
        for rec in part["cases"].values():
            assert rec["status"] in ("ok", "unsupported"), rec
        for name in ("linear_selected_logprobs_entropy", "linear_policy_loss"):
            # The linear ops with the lm_head's rows sharded: d hidden and the weight's rows.
            rec = part["cases"][name]
            assert rec["status"] == "ok" and {"grad", "grad_weight"} < set(rec["checks"]), rec
    torch_fault = doc["torch"]["fault_check"]["ranks"]
    assert all(r["raised"] == "ValueError" and "rank(s) 1 " in r["message"]
               for r in torch_fault), torch_fault
    verdict = doc["verdict"]
    assert verdict["checks_passed"] and verdict["fault_checks_passed"] and not verdict["failed"]
    assert "all targets met" in proc.stdout


def test_hlo_all_reduces_reads_plain_async_and_tuple_collectives():
    hlo = "\n".join([
        "  %all-reduce = f32[2,16]{1,0} all-reduce(f32[2,16]{1,0} %x), to_apply=%max",
        "  %all-reduce-start = (f32[16]{0}, s64[4,10]{1,0}) all-reduce-start(%a, %b)",
        "  %all-reduce-done = (f32[16]{0}, s64[4,10]{1,0}) all-reduce-done(%all-reduce-start)",
        "  %fusion = f32[16]{0} fusion(%all-reduce), kind=kLoop",
    ])
    found = [(np.dtype(d).name, s) for d, s in vp.hlo_all_reduces(hlo)]
    assert found == [("float32", (2, 16)), ("float32", (16,)), ("int64", (4, 10))]


def test_target_and_judge():
    met = vp.target(0.59, 4.0, 0.02, 8)
    assert met["met"] and met["limit_ms"] == pytest.approx(0.595)
    assert not vp.target(0.6, 4.0, 0.0, 8)["met"]
    tol = vp.tolerances(10.0, 1.0)[0]
    expected = np.array([1.0, -2.0, np.nan])
    ok = vp.judge(vp.error_stats(np, expected + 1e-7, expected, tol.rtol, tol.atol), tol, tol.rtol)
    assert ok["passed"] and ok["nan_mismatches"] == 0
    off = vp.judge(vp.error_stats(np, expected + 1e-3, expected, tol.rtol, tol.atol), tol, 1.0)
    assert not off["passed"] and off["worst_over_tolerance"] > 1
    nan = vp.judge(vp.error_stats(np, np.array([1.0, np.nan, np.nan]), expected, tol.rtol,
                                  tol.atol), tol, 1.0)
    assert not nan["passed"] and nan["nan_mismatches"] == 1


def test_config_shards_and_names():
    cfg = vp.Config(tp=4, vocab=10)
    assert [cfg.bounds(r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert vp.default_name(8, False) == "h200x8_vocab_parallel.json"
    assert vp.finite({"a": [float("nan"), 1.0], "b": float("inf")}) == {"a": ["nan", 1.0],
                                                                         "b": "inf"}
