"""The benchmark suite's CPU smoke run, through the real script entry, and its target checks.

The smoke run times ratiokl's native providers and the eager reference on a
tiny case, and a tiny lm_head step (ratiokl's native loss and the bare
GEMMs), under both timings; this checks that every record carries the
fields the results format promises (timing, issue time), with values
consistent with each other (bytes, bandwidth, ceilings), not the timings
themselves.
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

from _cases import HIDDEN_OPS, LINEAR_LOGP, LMHEAD, PRESETS, TIMINGS, min_bytes, timed_modes  # noqa: E402,E501
from _summary import check_targets  # noqa: E402
from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402

REQUIRED = ("op", "provider", "mode", "timing", "N", "V", "density", "dtype", "ms", "gbps",
            "pct_read_ceiling", "pct_copy_ceiling", "peak_extra_bytes", "min_bytes",
            "issue_ms", "issue_blocked")
SMOKE_OPS = ("ratio_kl", "policy_loss_ref_logps", LMHEAD, LINEAR_LOGP)
NATIVE = ("ratiokl-torch-native", "ratiokl-jax-native", "torch-eager")
STEP = ("ratiokl-torch-native", "ratiokl-torch-native-linear", "gemm-only")


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
    logits_group, step_group = PRESETS["cpu-smoke"].groups
    (case,), (step_case,) = logits_group.cases, step_group.cases
    assert set(logits_group.providers) == set(NATIVE)
    assert set(step_group.providers) == set(STEP) and step_group.ops == HIDDEN_OPS
    _check_coverage(data, logits_group.providers, step_group.providers)
    _check_consistency(data, {c.hidden: c for c in (case, step_case)})
    _check_memory(data, case)
    _check_files_and_summary(data, out, stdout)


def _modes(op):
    """Timed modes, and the derived bwd where both are timed."""
    modes = timed_modes(op)
    return modes + ("bwd",) if len(modes) == 2 else modes


def _check_coverage(data, providers, step_providers):
    """Each (provider, op, mode) exactly once per timing, the hidden-state ops included (the
    lm_head step, the log-prob seam with its derived bwd)."""
    keys = [(r["provider"], r["op"], r["mode"], r["timing"]) for r in data["records"]]
    ops = [op for op in SMOKE_OPS if op not in HIDDEN_OPS]
    expected = [(p, op, m, t) for p in providers for op in ops for m in _modes(op)
                for t in TIMINGS]
    expected += [(p, op, m, t) for p in step_providers for op in HIDDEN_OPS
                 for m in _modes(op) for t in TIMINGS]
    assert set(TIMINGS) == {"user", "device"}
    assert sorted(keys) == sorted(expected)
    assert any(r["op"] == LMHEAD for r in data["records"])


def _check_consistency(data, cases):
    ceil = data["ceilings"]
    assert ceil["copy_gbps"] > 0 and ceil["read_gbps"] > 0
    floor = ceil["autograd_floor_issue_ms"]  # the host floor beside the issue times
    assert 0 < floor["fwd"] < floor["fwd+bwd"], floor
    for r in data["records"]:
        assert all(k in r for k in REQUIRED), r
        assert r["status"] == "ok", r
        assert r["timing"] in ("user", "device"), r
        case = cases[r["H"] or 0]
        assert (r["N"], r["V"], r["density"], r["dtype"]) == (case.n, case.v, case.density,
                                                              case.dtype)
        assert r["min_bytes"] == min_bytes(r["op"], r["mode"], case)
        assert math.isfinite(r["ms"]) and r["ms"] >= 0
        if r["mode"] != "bwd":  # bwd is derived (fwd+bwd - fwd) and may round to 0
            assert r["ms"] > 0
            # measured for every timed record (CPU: the calls' own wall time)
            assert isinstance(r["issue_ms"], float) and r["issue_ms"] > 0, r
            assert r["issue_blocked"] is None  # no GPU to wait for
        else:
            assert r["issue_ms"] is None  # a backward is not issued alone
        if r["min_bytes"] is None:  # the hidden-state ops: no bandwidth fields
            assert r["op"] in HIDDEN_OPS and r["gbps"] is None and r["pct_read_ceiling"] is None
        elif r["ms"] > 0:
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
    for row in speedups:  # against the peer of the same timing
        eager = [r for r in data["records"] if r["provider"] == "torch-eager"
                 and all(r[k] == row[k] for k in ("op", "mode", "timing"))]
        if not eager:  # the hidden-state ops have no eager peer
            assert row["op"] in HIDDEN_OPS and row["x_torch-eager"] is None
        elif row["ms"] > 0 and eager[0]["ms"] > 0:
            assert row["x_torch-eager"] == pytest.approx(eager[0]["ms"] / row["ms"])
    for title in ("ms by provider, user timing", "ms by provider, device timing",
                  "issue ms by provider", "an autograd.Function doing nothing", "lmhead-step",
                  "lmhead-logprobs"):
        assert title in stdout


def _record(provider, op, mode, ms, density=1.0, n=8192, peak=0, pct=95.0, timing="user",
            issue=None, gbps=1.0):
    return {"op": op, "provider": provider, "mode": mode, "timing": timing, "N": n,
            "V": 151936, "density": density, "dtype": "bfloat16", "status": "ok", "ms": ms,
            "gbps": gbps, "pct_read_ceiling": pct, "peak_extra_bytes": peak, "issue_ms": issue}


def test_cpu_timing_samples_after_its_warm_up(monkeypatch):
    """On a CPU the first calls of a shape run many times slower (oneDNN's bf16 GEMM
    primitives, the allocator): the cpu-smoke preset's timing warms up first, so its
    samples never hold them. A fake clock: each call moves it 100 ms for the first three
    calls, 1 ms after."""
    import _harness

    clock, calls = [0.0], []

    def call():
        calls.append(None)
        clock[0] += 0.1 if len(calls) <= 3 else 0.001

    monkeypatch.setattr(_harness.time, "perf_counter", lambda: clock[0])
    timing = PRESETS["cpu-smoke"].timing
    assert _harness.cpu_ms(call, lambda _: None, timing.cpu_reps,
                           timing.warmup_ms) == pytest.approx(1.0)


def test_targets_pass_fail_and_missing():
    tt, tg = "ratiokl-torch-triton", "ratiokl-torch-triton-graph"
    recs = [
        _record(tt, "ratio_kl", "fwd", 1.10),
        _record(tt, "ratio_kl", "fwd", 0.90, timing="device", issue=0.10),  # not the headline
        _record(tt, "ratio_kl", "fwd+bwd", 2.60),
        _record(tt, "ratio_kl", "fwd+bwd", 2.30, timing="device", issue=0.40),
        _record("ratiokl-torch-triton-unchecked", "ratio_kl", "fwd", 1.05),
        _record("ratiokl-torch-triton-compiled", "ratio_kl", "fwd", 1.06),
        _record(tt, "ratio_kl", "fwd", 0.50, density=0.5),
        _record("ratiokl-jax-triton", "ratio_kl", "fwd", 1.20),
        _record(tg, "ratio_kl", "fwd", 1.00),
        _record(tt, "selected_logprobs", "fwd", 0.50, n=128),
        _record(tg, "selected_logprobs", "fwd", 0.30, n=128),
        _record(tt, "selected_logprobs", "fwd", 0.10, n=128, timing="device", gbps=3900.0),
    ]
    ceilings = {"few_rows_read": [{"rows": 128, "V": 151936, "tensors": 1, "gbps": 4000.0}]}
    status = {c["target"]: c["status"] for c in check_targets(recs, ceilings)}
    assert status["ratio_kl fwd ms"] == "pass"  # user timing, not the device record's 0.90
    assert status["ratio_kl fwd+bwd ms"] == "fail"
    assert status["ratio_kl fwd check_ids=True / check_ids=False time"] == "fail"  # 1.048
    assert status["ratio_kl fwd torch.compile(fullgraph=True) / eager time "
                  "(check_ids=False)"] == "pass"  # 1.06 / 1.05 = 1.01
    assert status["ratio_kl fwd+bwd check_ids=True / check_ids=False time"] == "missing"
    assert status[f"ratio_kl fwd {tt} time(d=0.5) / time(d=1.0)"] == "pass"
    assert status["ratio_kl fwd d=1 jax-triton / torch-triton CUDA graph time"] == "fail"
    assert status["ratio_kl fwd+bwd d=1 jax-triton / torch-triton CUDA graph time"] == "missing"
    assert status[f"ratio_kl fwd {tt} issue ms (device record, check_ids=False)"] == "pass"
    assert status[f"ratio_kl fwd+bwd {tt} issue ms (device record, check_ids=False)"] == "fail"
    assert status[f"selected_logprobs fwd {tt} N=128 user time / CUDA graph user time"] == "fail"
    assert status[f"selected_logprobs fwd+bwd {tt} N=128 user time / CUDA graph user time"] == (
        "missing")
    assert status[f"selected_logprobs fwd {tt} N=128 device GB/s / pure read of the same bytes "
                  "(4000 GB/s)"] == "pass"  # 3900 / 4000 >= 0.85
    assert not any(t.startswith("policy_loss") for t in status)


def test_policy_loss_targets_against_liger_and_in_situ():
    tt, op = "ratiokl-torch-triton", "policy_loss_ref_logps"
    recs = [
        _record(tt, op, "fwd+bwd", 1.50),
        _record(tt, op, "fwd+bwd", 1.40, timing="device"),
        _record("liger", op, "fwd+bwd", 1.90),
        _record(tt, op, "fwd", 0.60),
        _record("liger", op, "fwd", 0.70),
        _record(tt, "lmhead-step", "fwd+bwd", 44.2),
        _record("gemm-only", "lmhead-step", "fwd+bwd", 42.5),
    ]
    status = {c["target"]: (c["status"], c["value"]) for c in check_targets(recs)}
    assert status[f"{op} fwd+bwd time / liger time"] == ("pass", 1.50 / 1.90)
    assert status[f"{op} fwd time / liger time"] == ("fail", 0.60 / 0.70)
    in_situ = status["lmhead-step (ratiokl - gemm-only) user time / policy_loss_ref_logps "
                     "fwd+bwd device time"]
    assert in_situ[0] == "fail" and abs(in_situ[1] - 1.7 / 1.4) < 1e-9  # 1.21 > 1.15


def test_rollout_correction_target_against_the_default_call():
    """PERF.md: ``policy_loss`` with any ``rollout_correction`` <= 1.02x the call without it
    (user timing, the headline shape); a correction that did not run is not listed."""
    tt, base = "ratiokl-torch-triton", "policy_loss_ref_logps"
    recs = [
        _record(tt, base, "fwd+bwd", 2.00),
        _record(tt, "policy_loss_rollout_token", "fwd+bwd", 2.03),
        _record(tt, "policy_loss_rollout_token", "fwd+bwd", 1.00, timing="device"),
        _record(tt, "policy_loss_rollout_sequence", "fwd+bwd", 2.05),
    ]
    status = {c["target"]: (c["status"], c["value"]) for c in check_targets(recs)}
    token = status[f"policy_loss_rollout_token fwd+bwd {tt} time / {base} fwd+bwd time "
                   "(rollout_correction='token-truncate')"]
    sequence = status[f"policy_loss_rollout_sequence fwd+bwd {tt} time / {base} fwd+bwd time "
                      "(rollout_correction='sequence-truncate')"]
    assert token == ("pass", 2.03 / 2.00) and sequence == ("fail", 2.05 / 2.00)
    headline = PRESETS["headline"]
    rollout = [g for g in headline.groups if g.ops and set(g.ops) & {
        "policy_loss_rollout_token", "policy_loss_rollout_sequence"}]
    assert [(g.providers, [(c.n, c.v) for c in g.cases]) for g in rollout] == [
        ((tt,), [(8192, 151936)])]


def test_rollout_ops_call_the_correction():
    """The providers' call of the rollout ops passes the engine's log-probs and the mode."""
    torch = pytest.importorskip("torch")
    from _cases import ROLLOUT_OPS, Case
    from _inputs import make_inputs
    from providers import ratiokl_op

    from ratiokl.torch import loss

    x = vars(make_inputs(Case(64, 256, 0.5, "float32"), torch.device("cpu")))
    _, plain = ratiokl_op(loss, "policy_loss_ref_logps", x, "native", True)
    for op in ROLLOUT_OPS:
        value, metrics = ratiokl_op(loss, op, x, "native", True)
        assert torch.isfinite(value) and 0.5 < float(metrics["rollout_weight_mean"]) < 2.0
        assert set(metrics) == set(plain) | {"rollout_weight_mean", "rollout_masked_fraction",
                                             "rollout_k3", "rollout_logp_off_1pct_fraction",
                                             "rollout_logp_off_5pct_fraction"}


def test_entropy_bonus_target_against_the_same_call_without():
    tt, op = "ratiokl-torch-triton", "policy_loss_ref_logps"
    recs = [
        _record(tt, op, "fwd+bwd", 1.60),
        _record(tt, f"{op}_entropy", "fwd+bwd", 1.66),  # 1.0375: within 1.05
        _record(tt, op, "fwd+bwd", 1.40, timing="device"),
        _record(tt, f"{op}_entropy", "fwd+bwd", 1.50, timing="device"),  # 1.071
    ]
    status = {c["target"]: (c["status"], c["value"]) for c in check_targets(recs)}
    user, device = (status[f"{op}_entropy fwd+bwd {tt} time / {op} fwd+bwd time "
                           f"(entropy_coef=0.01, {t} timing)"] for t in ("user", "device"))
    assert user[0] == "pass" and abs(user[1] - 1.66 / 1.60) < 1e-12
    assert device[0] == "fail" and abs(device[1] - 1.50 / 1.40) < 1e-12
    without = {c["target"] for c in check_targets(recs[:1] + recs[2:3])}
    assert not any("entropy" in t for t in without)  # no entropy records: no entropy target
    assert "policy_loss_ref_logps_entropy" in PRESETS["headline"].groups[1].ops


def test_cispo_and_logp_entropy_targets_against_the_same_calls_without():
    """PERF.md: ``objective="cispo"`` <= 1.02x PPO; ``selected_logprobs(return_entropy=True)``
    fwd <= 1.05x and fwd+bwd <= 1.08x the log-probs alone (user timing)."""
    tt = "ratiokl-torch-triton"
    recs = [
        _record(tt, "policy_loss_ref_logps", "fwd+bwd", 2.00),
        _record(tt, "policy_loss_ref_logps_cispo", "fwd+bwd", 2.06),
        _record(tt, "selected_logprobs", "fwd", 1.00),
        _record(tt, "selected_logprobs", "fwd+bwd", 2.00),
        _record(tt, "selected_logprobs_entropy", "fwd", 1.04),
        _record(tt, "selected_logprobs_entropy", "fwd+bwd", 2.20),
    ]
    status = {c["target"]: (c["status"], c["value"]) for c in check_targets(recs)}
    assert status[f"policy_loss_ref_logps_cispo fwd+bwd {tt} time / policy_loss_ref_logps "
                  "fwd+bwd time (objective='cispo')"] == ("fail", 2.06 / 2.00)
    for mode, verdict, value in (("fwd", "pass", 1.04), ("fwd+bwd", "fail", 1.10)):
        target = (f"selected_logprobs_entropy {mode} {tt} time / selected_logprobs {mode} time "
                  "(return_entropy=True)")
        assert status[target][0] == verdict and abs(status[target][1] - value) < 1e-12
    headline = [g for g in PRESETS["headline"].groups if g.ops and
                "policy_loss_ref_logps_cispo" in g.ops]
    assert [(g.providers, "selected_logprobs_entropy" in g.ops) for g in headline] == [
        ((tt,), True)]


def test_the_bare_gemms_run_on_the_losss_own_gradient():
    """``gemm-only``'s upstream gradient is the policy loss's gradient of the step's logits
    (not random data: a GEMM's clock follows its data): zero on inactive rows, each active
    row summing to ~0 (``d logp / d z`` does), the logits' shape and dtype."""
    import torch
    from _cases import Case
    from _inputs import make_inputs

    case = Case(n=64, v=96, density=0.5, dtype="float32", hidden=16)
    x = make_inputs(case, torch.device("cpu"))
    grad = x.grad_logits
    assert grad.shape == (case.n, case.v) and grad.dtype == torch.float32
    active = x.mask.reshape(-1)
    assert not active.all() and active.any()
    assert torch.count_nonzero(grad[~active]) == 0
    assert torch.count_nonzero(grad[active]) > 0
    # sum_v (p_v - onehot_v) = 0 for each row: float32 sums of V terms of magnitude <= 1
    assert_close(grad[active].sum(-1), torch.zeros(int(active.sum())),
                 spec.reduction_tolerance(case.v), "row sums of the gradient")
