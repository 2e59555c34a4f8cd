"""The ``ratiokl`` command line: help, version, ``check``'s selection errors, progress and
summary, and ``bench``'s suite lookup and preset names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ratiokl
from ratiokl import harness
from ratiokl._cli import _bench, main

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _python_m(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SRC),
                                                                    os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "ratiokl", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert "usage: ratiokl" in out
    for command, summary in (("check", "conformance fixtures"), ("bench", "benchmark suite")):
        assert command in out and summary in out


@pytest.mark.parametrize("command, words", [
    ("check", ["--backend", "--case", "--contiguous-only", "strided", "twice", "torch-interpret",
               "jax-interpret"]),
    ("bench", ["--preset", "--out", "--plot", "cpu-smoke", "not in the wheel"]),
])
def test_each_command_has_its_help(command, words, capsys):
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ratiokl {command}")
    for word in words:
        assert word in out, word


def test_version_names_ratiokl_and_dependencies(capsys):
    assert main(["--version"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"ratiokl {ratiokl.__version__}"
    names = {line.split()[0] for line in lines[1:]}
    assert {"Python", "numpy", "torch", "jax", "triton", "jax-triton"} <= names


def test_python_m_version():
    proc = _python_m("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"ratiokl {ratiokl.__version__}"


def test_bare_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "check" in capsys.readouterr().err


def test_unknown_command_lists_the_commands(capsys):
    assert main(["version"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'version'" in err and "'check'" in err and "'bench'" in err


def test_unknown_backend_lists_the_targets(capsys):
    assert main(["check", "--backend", "torch-native", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert "'nope' matches no target" in err
    for target in harness.TARGETS:
        assert target in err


def test_check_empty_case_selection(capsys):
    assert main(["check", "--case", "no_such_case_*"]) == 2
    assert "no case matches" in capsys.readouterr().err


def test_check_progress_and_strided_summary(tmp_path, capsys):
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    report = tmp_path / "report.json"
    assert main(["check", "--backend", "torch-native", "--case", "vocab_2_*",
                 "--json", str(report)]) == 0
    captured = capsys.readouterr()
    assert "PyTorch targets run each case twice" in captured.out
    assert "(3 cases x 2: contiguous + strided)" in captured.out
    assert "0/6 cases" in captured.err  # the progress bar (stderr)
    variants = [r["variant"] for r in json.loads(report.read_text())["results"]]
    assert variants == ["contiguous"] * 3 + ["strided"] * 3


def test_check_contiguous_only_runs_one_pass(capsys):
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    assert main(["check", "--backend", "torch-native", "--case", "vocab_2_*",
                 "--contiguous-only", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "(3 cases x 1)" in captured.out and "twice" not in captured.out
    assert captured.err == ""


def test_check_case_takes_the_group_names_the_table_prints(capsys):
    """``--case vocab_2`` (a group as the table prints it) selects that group's cases (the
    case names add the dtype: vocab_2_fp32, ...)."""
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    group = [n for n, e in harness.load_manifest()["cases"].items() if e["group"] == "vocab_2"]
    assert group and harness.list_cases("vocab_2") == sorted(group)
    assert main(["check", "--backend", "torch-native", "--case", "vocab_2",
                 "--contiguous-only", "--no-progress"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["torch-native", "vocab_2", f"{len(group)}/{len(group)}"] in [r[:3] for r in rows]


def test_check_case_repeated_runs_the_union(capsys):
    """``--case A --case B`` runs the cases of both globs (it once kept the last alone)."""
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    both = sorted(set(harness.list_cases("vocab_2")) | set(harness.list_cases("vocab_1")))
    assert main(["check", "--backend", "torch-native", "--case", "vocab_2", "--case", "vocab_1",
                 "--contiguous-only", "--no-progress"]) == 0
    assert f"({len(both)} cases x 1)" in capsys.readouterr().out


def test_check_prints_unavailable_reasons_in_full(monkeypatch, capsys):
    reason = "line one of a long reason.\nline two: https://example.invalid/install"
    real = harness.target_status
    monkeypatch.setattr(harness, "target_status",
                        lambda t: reason if t == "jax-triton" else real(t))
    main(["check", "--backend", "jax-triton", "--backend", "torch-native", "--case",
          "vocab_2_fp32", "--no-progress"])
    assert f"jax-triton        unavailable: {reason}" in capsys.readouterr().out


def test_check_with_nothing_runnable_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(harness, "target_status", lambda t: "not here")
    assert main(["check", "--case", "vocab_2_fp32", "--no-progress"]) == 2
    assert "none of the selected targets can run here" in capsys.readouterr().err


def test_bench_finds_the_checkouts_suite():
    assert _bench.find_suite() == ROOT / "benchmarks"
    assert {"cpu-smoke", "headline"} <= set(_bench.presets(ROOT / "benchmarks"))
    assert _bench.DEFAULT_PRESET in _bench.presets(ROOT / "benchmarks")


def test_bench_unknown_preset_lists_the_presets(capsys):
    assert main(["bench", "--preset", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown --preset 'nope'" in err and "cpu-smoke" in err and "headline" in err


def test_bench_without_a_suite_says_it_needs_a_checkout(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RATIOKL_BENCHMARKS", raising=False)
    assert main(["bench", "--suite", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not in the wheel" in err and "--suite" in err


def test_bench_writes_outside_the_current_folder_by_default(tmp_path, monkeypatch, capsys):
    """Without ``--out`` the results go to the temporary folder (named at the end), not into
    the folder it runs in (a checkout): nothing is created there."""
    calls = []
    monkeypatch.setattr(_bench, "_script", lambda suite, name, arguments: calls.append(
        arguments) or 0)
    here = tmp_path / "checkout"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["bench"]) == 0
    out = Path(calls[0][calls[0].index("--out") + 1])
    assert list(here.iterdir()) == []
    assert out.parent.is_dir() and out.name == f"{_bench.DEFAULT_PRESET}.json"
    assert not out.is_relative_to(here) and str(out) in capsys.readouterr().out


def test_bench_plot_only_draws_or_explains(tmp_path):
    """``--plot-only`` hands an existing results file to benchmarks/plot.py."""
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"records": []}))
    proc = _python_m("bench", "--plot-only", str(results))
    assert proc.returncode == 0, proc.stderr
    assert "plot.py" in proc.stdout


def test_openrlhf_launcher_without_openrlhf_prints_one_line(tmp_path):
    """``python -m ratiokl.adapters.openrlhf`` where OpenRLHF cannot be imported (a stand-in
    package that raises, so the test runs in OpenRLHF's venv too): one line saying what is
    missing and what to install, exit 2, no traceback."""
    (tmp_path / "openrlhf").mkdir()
    (tmp_path / "openrlhf" / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(SRC)]))
    proc = subprocess.run([sys.executable, "-m", "ratiokl.adapters.openrlhf", "--help"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "needs openrlhf" in lines[0] and "pip install 'ratiokl[openrlhf]'" in lines[0]


def test_check_runs_the_advantage_fixtures(tmp_path, capsys):
    """``ratiokl check`` runs the advantage estimators' fixtures on a built-in target, as
    case groups ``advantages.<function>``."""
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    names = harness.list_advantage_cases()
    report = tmp_path / "report.json"
    assert main(["check", "--backend", "torch-native", "--case", "advantages.*",
                 "--no-progress", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert f"0 cases and {len(names)} advantage cases from" in out
    assert f"({len(names)} advantage cases)" in out
    results = json.loads(report.read_text())["results"]
    assert sorted(r["case"] for r in results) == names
    assert all(r["status"] == "passed" for r in results)


def test_check_fails_a_wrong_advantage(monkeypatch, capsys):
    """An estimator that disagrees with the spec is a failed case, with the output named."""
    if harness.target_status("torch-native") is not None:
        pytest.skip(harness.target_status("torch-native"))
    from ratiokl.torch import advantages

    monkeypatch.setattr(advantages, "rloo", lambda scores, *_, **__: scores * 0.0)
    assert main(["check", "--backend", "torch-native", "--case", "advantages.rloo",
                 "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "rloo_singleton_score [contiguous]: advantages:" in out
