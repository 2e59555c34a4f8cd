"""The benchmark suite's CPU smoke run, through the real script entry, and its target checks.

The smoke run times ratiokl's native providers and the eager reference on a
tiny case; this checks that every record carries the fields the results
format promises, with values consistent with each other (bytes, bandwidth,
ceilings), not the timings themselves.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from _cases import PRESETS, min_bytes  # noqa: E402
from _summary import check_targets  # noqa: E402

REQUIRED = ("op", "provider", "mode", "N", "V", "density", "dtype", "ms", "gbps",
            "pct_read_ceiling", "pct_copy_ceiling", "peak_extra_bytes", "min_bytes")
SMOKE_OPS = ("ratio_kl", "policy_loss_ref_logps")
NATIVE = ("ratiokl-torch-native", "ratiokl-jax-native", "torch-eager")


def _run_smoke(out: Path) -> str:
    """Run the real entry point on the CPU smoke preset; returns its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--preset", "cpu-smoke",
         "--ops", ",".join(SMOKE_OPS), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cpu_smoke_run_writes_complete_consistent_records(tmp_path):
    # One test (not several sharing a fixture) so that pytest-xdist runs the
    # smoke benchmark once, not once per worker.
    out = tmp_path / "smoke.json"
    stdout = _run_smoke(out)
    data = json.loads(out.read_text())
    (case,), providers = PRESETS["cpu-smoke"].groups[0]
    _check_coverage(data, providers)
    _check_consistency(data, case)
    _check_memory(data, case)
    _check_files_and_summary(data, out, stdout)


def _check_coverage(data, providers):
    keys = [(r["provider"], r["op"], r["mode"]) for r in data["records"]]
    expected = {(p, op, m) for p in providers for op in SMOKE_OPS
                for m in ("fwd", "fwd+bwd", "bwd")}
    assert set(providers) == set(NATIVE)
    assert sorted(keys) == sorted(expected)  # each exactly once


def _check_consistency(data, case):
    ceil = data["ceilings"]
    assert ceil["copy_gbps"] > 0 and ceil["read_gbps"] > 0
    for r in data["records"]:
        assert all(k in r for k in REQUIRED), r
        assert r["status"] == "ok", r
        assert (r["N"], r["V"], r["density"], r["dtype"]) == (case.n, case.v, case.density,
                                                              case.dtype)
        assert r["min_bytes"] == min_bytes(r["op"], r["mode"], case)
        assert math.isfinite(r["ms"]) and r["ms"] >= 0
        if r["mode"] != "bwd":  # bwd is derived (fwd+bwd - fwd) and may round to 0
            assert r["ms"] > 0
        if r["ms"] > 0:
            gbps = r["min_bytes"] / (r["ms"] * 1e-3) / 1e9
            assert r["gbps"] == pytest.approx(gbps)
            assert r["pct_read_ceiling"] == pytest.approx(100 * gbps / ceil["read_gbps"])
            assert r["pct_copy_ceiling"] == pytest.approx(100 * gbps / ceil["copy_gbps"])


def _check_memory(data, case):
    grad_bytes = case.n * case.v * case.itemsize
    for r in data["records"]:
        if r["framework"] == "jax":  # XLA's memory analysis works on any backend
            assert isinstance(r["peak_extra_bytes"], int) and r["peak_extra_bytes"] > 0
            if r["mode"] != "fwd":  # the gradient is one of the outputs
                assert r["peak_extra_bytes"] >= grad_bytes
        else:  # torch reports allocator peaks on CUDA only
            assert r["peak_extra_bytes"] is None


def _check_files_and_summary(data, out, stdout):
    rows = list(csv.DictReader(out.with_suffix(".csv").open()))
    assert len(rows) == len(data["records"])
    assert data["metadata"]["versions"]["torch"] and data["metadata"]["date_utc"]
    speedups = data["summary"]["speedups"]
    assert len(speedups) == len(data["records"])
    for row in speedups:
        eager = next(r for r in data["records"] if r["provider"] == "torch-eager"
                     and all(r[k] == row[k] for k in ("op", "mode")))
        if row["ms"] > 0 and eager["ms"] > 0:
            assert row["x_torch-eager"] == pytest.approx(eager["ms"] / row["ms"])
    assert "median ms by provider" in stdout


def _record(provider, op, mode, ms, density=1.0, n=8192, peak=0, pct=95.0):
    return {"op": op, "provider": provider, "mode": mode, "N": n, "V": 151936,
            "density": density, "dtype": "bfloat16", "status": "ok", "ms": ms,
            "gbps": 1.0, "pct_read_ceiling": pct, "peak_extra_bytes": peak}


def test_targets_pass_fail_and_missing():
    recs = [
        _record("ratiokl-torch-triton", "ratio_kl", "fwd", 1.10),
        _record("ratiokl-torch-triton", "ratio_kl", "fwd+bwd", 2.60),
        _record("torch-eager", "ratio_kl", "fwd+bwd", 24.6),
        _record("ratiokl-torch-triton", "ratio_kl", "fwd", 0.50, density=0.5),
        _record("ratiokl-jax-triton", "ratio_kl", "fwd", 1.20),
    ]
    status = {c["target"]: c["status"] for c in check_targets(recs)}
    assert status["ratio_kl fwd ms"] == "pass"
    assert status["ratio_kl fwd+bwd ms"] == "fail"
    assert status["ratio_kl fwd+bwd speedup vs torch-eager"] == "fail"  # 24.6 / 2.6 < 10
    assert status["ratio_kl fwd ratiokl-torch-triton time(d=0.5) / time(d=1.0)"] == "pass"
    assert status["ratio_kl fwd d=1 jax-triton / torch-triton time"] == "fail"
    assert status["ratio_kl fwd+bwd d=1 jax-triton / torch-triton time"] == "missing"
    assert not any(t.startswith("policy_loss") for t in status)
