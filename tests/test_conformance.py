"""The one conformance test body, run for every (framework, backend) target.

Each fixture case (``conformance/cases``) goes through the public API of the
target's framework and is compared with the float64 spec under the case's
tolerances (see ``ratiokl.harness``). Torch targets also run every case
with the policy logits as a non-contiguous view whose gaps hold NaN.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ratiokl
from conformance_subset import representative_cases
from ratiokl import harness
from ratiokl.__main__ import main

CASES = harness.list_cases()


@functools.lru_cache(maxsize=None)
def _case(name: str) -> harness.Case:
    return harness.load_case(name)


def _check(case_name: str, target: str, strided: bool) -> None:
    result = harness.run_case(_case(case_name), target, strided=strided)
    assert result.passed, f"{target} {case_name} [{result.variant}]:\n" + "\n".join(result.failures)


@pytest.mark.parametrize("case_name", CASES)
def test_fixture(target: str, case_name: str) -> None:
    _check(case_name, target, strided=False)


@pytest.mark.parametrize("case_name", CASES)
def test_fixture_strided_logits(torch_target: str, case_name: str) -> None:
    _check(case_name, torch_target, strided=True)


def test_every_group_covers_the_promised_dtypes() -> None:
    """Each ratio_kl / selected_logprobs group exists in every dtype (one large case: fp32 only)."""
    manifest = harness.load_manifest()["cases"]
    groups = {}
    for entry in manifest.values():
        if entry["op"] in ("ratio_kl", "selected_logprobs"):
            groups.setdefault(entry["group"], set()).add(entry["dtype"])
    assert len(groups) >= 29
    for group, dtypes in groups.items():
        assert "float32" in dtypes, group
        if group != "vocab_20011":
            assert dtypes == set(harness.LOGIT_DTYPES), group


def test_the_default_subset_has_one_case_of_every_group_in_every_dtype() -> None:
    """What ``jax-interpret`` runs without ``--backends`` (``conftest.py``)."""
    manifest = harness.load_manifest()["cases"]
    chosen = representative_cases(CASES)
    groups = [manifest[name]["group"] for name in chosen]
    assert sorted(groups) == sorted({entry["group"] for entry in manifest.values()})
    assert {manifest[name]["dtype"] for name in chosen} == set(harness.LOGIT_DTYPES)
    assert representative_cases(reversed(CASES)) == chosen  # the order given is irrelevant


def test_importing_conformance_imports_no_framework() -> None:
    code = "import sys, ratiokl.harness; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    env = dict(os.environ, PYTHONPATH=str(Path(ratiokl.__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_check_writes_a_report(tmp_path: Path, capsys) -> None:
    runnable = [t for t in harness.TARGETS if harness.target_status(t) is None]
    if not runnable:
        pytest.skip("no target can run here")
    report = tmp_path / "report.json"
    status = main(["check", "--backend", runnable[0], "--case", "vocab_2_*", "--json", str(report)])
    results = json.loads(report.read_text())["results"]
    assert status == (0 if all(r["passed"] for r in results) else 1)
    assert {r["case"] for r in results} == {"vocab_2_fp32", "vocab_2_fp16", "vocab_2_bf16"}
    assert "vocab_2" in capsys.readouterr().out


def test_fixtures_found_in_wheel_layout(tmp_path: Path) -> None:
    """A wheel carries the fixtures, the advantage ones too, as ratiokl/_fixtures: laid out
    here by pyproject's force-include table, as hatchling lays out the wheel."""
    import tomllib

    checkout = Path(__file__).resolve().parents[1]
    pyproject = tomllib.loads((checkout / "pyproject.toml").read_text())
    included = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["force-include"]
    package = Path(ratiokl.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "ratiokl", ignore=shutil.ignore_patterns("__pycache__"))
    for source, destination in included.items():
        if (checkout / source).is_dir():
            shutil.copytree(checkout / source, tmp_path / destination)
        else:
            (tmp_path / destination).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(checkout / source, tmp_path / destination)
    code = ("from ratiokl import harness as c; print(c.fixtures_root()); "
            "print(len(c.list_cases())); print(len(c.list_advantage_cases()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=tmp_path)
    root, count, advantage_count = out.stdout.split()
    assert Path(root) == tmp_path / "ratiokl" / "_fixtures" and int(count) == len(CASES)
    assert int(advantage_count) == len(harness.list_advantage_cases())


def _perfect_outcome(case: harness.Case) -> harness.Outcome:
    """What an exact backend would return: the expectations rounded to the API dtypes."""
    outputs = {o: case.arrays[f"expected_{o}"].astype(np.float32) for o in case.spec.outputs}
    grad = harness.round_to_dtype(case.arrays["expected_grad"], case.dtype)
    return harness.Outcome(outputs, {o: "float32" for o in outputs}, grad, case.dtype)


def _mutate(outcome: harness.Outcome, how: str, case: harness.Case) -> None:
    inactive, active = ~case.row_mask, np.argwhere(case.row_mask)[0]
    if how == "inactive_ratio_off_by_one_ulp":
        outcome.outputs["ratio"][inactive] = np.nextafter(np.float32(1), np.float32(2))
    elif how == "inactive_kl_negative_zero":
        outcome.outputs["kl"][inactive] = -0.0
    elif how == "inactive_grad_nan":
        outcome.grad[inactive] = np.nan
    elif how == "active_ratio_outside_tolerance":
        outcome.outputs["ratio"][tuple(active)] *= 1.0 + 1e-3
    elif how == "active_grad_spurious_nan":
        outcome.grad[tuple(active)][0] = np.nan
    elif how == "grad_dtype":
        outcome.grad_dtype = "float32" if case.dtype != "float32" else "float16"


@pytest.mark.parametrize("how", ["inactive_ratio_off_by_one_ulp", "inactive_kl_negative_zero",
                                 "inactive_grad_nan", "active_ratio_outside_tolerance",
                                 "active_grad_spurious_nan", "grad_dtype"])
def test_judge_rejects(how: str) -> None:
    case = _case("inactive_rows_nan_logits_bf16")
    assert harness.judge(case, _perfect_outcome(case)).passed
    outcome = _perfect_outcome(case)
    _mutate(outcome, how, case)
    assert not harness.judge(case, outcome).passed
