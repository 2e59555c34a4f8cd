"""``ratiokl check --target``: a user's own implementation through the check-target protocol.

The targets are defined in ``tests/helpers/check_user_targets.py`` and in
``examples/check_target_port.py`` (a user's ratio and KL in PyTorch and its JAX port): the
correct one passes every case it supports, a deliberately wrong one fails on the cases its
mistake touches and passes the others, an option a target does not support is skipped with
its reason, and bad ``--target`` strings are refused naming ``--target`` and the fix.
"""

from __future__ import annotations

import json
import sys

import pytest

from ratiokl import harness
from ratiokl._cli import main
from ratiokl.harness import TargetResult

torch = pytest.importorskip("torch")
from check_user_targets import NoPerRowTemperature, SignFlippedK3, port  # noqa: E402

THIS = "check_user_targets"  # tests/helpers/check_user_targets.py, on the tests' path


def _run(name: str, target) -> harness.CaseResult:
    return harness.run_case(harness.load_case(name), target)


@pytest.mark.parametrize("user_target", [port.TorchRatioKL(), port.JaxRatioKL()],
                         ids=["torch", "jax"])
def test_a_correct_port_passes(user_target):
    if user_target.name == "port-jax":
        pytest.importorskip("jax")
    for name in harness.list_cases("kl_k*") + harness.list_cases("inactive_rows_*"):
        result = _run(name, user_target)
        assert result.status == "passed", (name, result.failures)


def test_a_wrong_k3_fails_on_k3_cases_only():
    wrong = SignFlippedK3()
    k3 = [_run(n, wrong) for n in harness.list_cases("kl_k3")]
    k1 = [_run(n, wrong) for n in harness.list_cases("kl_k1")]
    assert k3 and all(r.status == "failed" for r in k3)
    assert k1 and all(r.status == "passed" for r in k1)
    message = k3[0].failures[0]
    assert message.startswith("kl: ") and "tolerance" in message and "expected" in message


def test_an_unsupported_option_is_skipped_with_its_reason():
    target = NoPerRowTemperature()
    per_row = [_run(n, target) for n in harness.list_cases("temperature_per_row")]
    scalar = [_run(n, target) for n in harness.list_cases("temperature_scalar")]
    assert per_row and all(r.status == "skipped" for r in per_row)
    assert per_row[0].skipped.startswith("per-row temperature")
    assert scalar and all(r.status == "passed" for r in scalar)


def test_a_missing_gradient_and_an_exception_are_failures():
    class NoGrad(port.TorchRatioKL):
        name = "no-grad"

        def __call__(self, call):
            return TargetResult(outputs=super().__call__(call).outputs, grads={})

    class Raises(port.TorchRatioKL):
        name = "raises"

        def __call__(self, call):
            raise RuntimeError("boom")

    assert "policy_logits" in " ".join(_run("kl_k1_fp32", NoGrad()).failures)
    assert _run("kl_k1_fp32", Raises()).failures == ["raised RuntimeError: boom"]


def test_the_builtin_targets_are_check_targets():
    """``torch-native`` through the protocol object gives the result its name gives."""
    target = harness.builtin_target("torch-native")
    assert isinstance(target, harness.CheckTarget)
    for name in harness.list_cases("policy_kl_k3"):
        by_name, by_object = _run(name, "torch-native"), _run(name, target)
        assert by_object.passed and by_object.failures == by_name.failures


def test_cli_runs_a_users_target(tmp_path, capsys):
    report = tmp_path / "report.json"
    assert main(["check", "--target", f"{THIS}:NoPerRowTemperature", "--case", "temperature_*",
                 "--no-progress", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "scalar-temperature" in out and "per-row temperature [...] is not supported" in out
    statuses = {(r["group"], r["status"]) for r in json.loads(report.read_text())["results"]}
    assert statuses == {("temperature_per_row", "skipped"), ("temperature_scalar", "passed")}


def test_cli_reports_a_wrong_target_case_by_case(capsys):
    assert main(["check", "--target", f"{THIS}:SignFlippedK3", "--case", "kl_k1",
                 "--case", "kl_k3", "--no-progress"]) == 1
    out = capsys.readouterr().out
    failed = harness.list_cases("kl_k3")
    for name in failed:
        assert f"sign-flipped-k3 {name} [contiguous]: kl: error is" in out
    assert "FAIL" in out and f"{len(failed)} failures" in out


def test_cli_verbose_lists_every_case(capsys):
    assert main(["check", "--target", f"{THIS}:NoPerRowTemperature", "--case", "temperature_*",
                 "--no-progress", "--verbose"]) == 0
    rows = {line.split()[1]: line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("scalar-temperature ")}
    assert rows == {**{n: "skipped" for n in harness.list_cases("temperature_per_row")},
                    **{n: "passed" for n in harness.list_cases("temperature_scalar")}}


def test_cli_with_a_target_skipping_everything_exits_2(capsys):
    assert main(["check", "--target", f"{THIS}:NoPerRowTemperature", "--case",
                 "temperature_per_row", "--no-progress"]) == 2
    assert "nothing ran" in capsys.readouterr().err


@pytest.mark.parametrize("spec, words", [
    ("examples.check_target_port", ["is not of the form", "package.module:object"]),
    ("no_such_module_ratiokl:TARGET", ["cannot import 'no_such_module_ratiokl'",
                                       "PYTHONPATH"]),
    (f"{THIS}:Nope", ["has no attribute 'Nope'", "name an object defined"]),
    (f"{THIS}:NOT_A_TARGET", ["is a dict, not a check target", "supports(call)",
                              "docs/check.md"]),
])
def test_cli_bad_target_names_the_argument_and_the_fix(spec, words, capsys):
    assert main(["check", "--target", spec, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--target {spec!r}" in err
    for word in words:
        assert word in err, (word, err)


@pytest.mark.parametrize("name", ["TARGET", "make_target", "NoPerRowTemperature",
                                  "port.JaxRatioKL"])
def test_load_target_takes_an_instance_a_factory_or_a_class(name):
    target = harness.load_target(f"{THIS}:{name}")
    assert isinstance(target, harness.CheckTarget) and not isinstance(target, type)


def test_load_target_refuses_a_function_that_needs_arguments():
    with pytest.raises(ValueError, match="is a function, not a check target"):
        harness.load_target(f"{THIS}:needs_arguments")


def test_check_help_documents_the_protocol(capsys):
    assert main(["check", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("--target", "supports(call)", "TargetResult", "TargetCall",
                 "ratiokl.harness.targets.verl:TARGET", "docs/check.md"):
        assert word in out, word


def test_cli_runs_a_target_beside_a_backend(capsys):
    """``--target`` alone runs only the target; with ``--backend`` both run."""
    args = ["check", "--target", f"{THIS}:port.TorchRatioKL", "--case", "vocab_2",
            "--contiguous-only", "--no-progress"]
    assert main(args) == 0
    alone = [line.split()[0] for line in capsys.readouterr().out.splitlines()
             if line.startswith(("port-torch", "torch-native"))]
    assert set(alone) == {"port-torch"}
    assert main(args + ["--backend", "torch-native"]) == 0
    both = [line.split()[0] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("port-torch ", "torch-native "))]
    assert set(both) == {"port-torch", "torch-native"}


def test_target_imports_from_the_working_directory(tmp_path, monkeypatch, capsys):
    """A user's module beside them, run with a console script's path: its own folder, not
    the working directory (``python -m`` adds that one; the ``ratiokl`` script does not)."""
    name = "my_project_losses_for_ratiokl"
    (tmp_path / f"{name}.py").write_text(
        "from ratiokl import harness\nTARGET = harness.builtin_target('torch-native')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert main(["check", "--target", f"{name}:TARGET", "--case", "vocab_2",
                     "--contiguous-only", "--no-progress"]) == 0, capsys.readouterr().err
    finally:
        sys.modules.pop(name, None)
    assert any(line.startswith("torch-native ") for line in capsys.readouterr().out.splitlines())
