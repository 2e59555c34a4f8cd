"""Dependency versions: one table (``ratiokl._requirements``), the errors built from it,
pyproject's extras kept in step with it, and the jax-triton helper's 0.3 / 0.4 handling."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from ratiokl import _requirements
from ratiokl._requirements import (REQUIREMENTS, MissingDependency, parse_version,
                                   version_problem)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _extras() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


@pytest.mark.parametrize("text, expected", [
    ("3.7.1", (3, 7, 1)), ("2.13.0+cpu", (2, 13, 0)), ("0.4.1", (0, 4, 1)),
    ("2.11.0a0+git123", (2, 11, 0)), ("3.6", (3, 6)),
])
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_parse_version_rejects_text_without_numbers():
    with pytest.raises(ValueError, match="'dev'"):
        parse_version("dev")


def test_too_old_names_installed_and_needed_versions_and_the_extra():
    reason = version_problem("triton", "3.5.1")
    assert "triton 3.5.1 is installed" in reason
    assert "triton>=3.6" in reason
    assert "pip install -U 'ratiokl[torch-triton]'" in reason


def test_missing_names_the_extra():
    reason = version_problem("jax-triton", None)
    assert "not installed" in reason and "jax-triton>=0.3.1" in reason
    assert "'ratiokl[jax-triton]'" in reason


@pytest.mark.parametrize("distribution, version", [
    ("triton", "3.6.0"), ("triton", "3.9.0"), ("jax-triton", "0.3.1"), ("jax-triton", "0.4.1"),
    ("torch", "2.13.0+cpu"), ("jax", "0.10.2"),
])
def test_supported_versions_pass(distribution, version):
    assert version_problem(distribution, version) is None


def test_extra_override_is_suggested():
    assert "'ratiokl[jax-triton]'" in version_problem("triton", "3.5.0", extra="jax-triton")


@pytest.mark.parametrize("requirement", list(REQUIREMENTS.values()), ids=lambda r: r.distribution)
def test_pyproject_extra_declares_the_tables_minimum(requirement):
    """Every extra that installs a distribution names the table's lower bound."""
    extras = _extras()
    declared = [spec for specs in extras.values() for spec in specs
                if spec.split(">=")[0].split(";")[0].strip() == requirement.distribution]
    assert declared, f"no extra installs {requirement.distribution}"
    for spec in declared:
        assert spec.startswith(requirement.specifier), (spec, requirement.specifier)
    assert requirement.extra in extras


def test_torch_triton_extra_installs_no_jax():
    extras = _extras()
    assert extras["torch-triton"] == ["ratiokl[torch]", "ratiokl[triton]"]
    assert not any("jax" in spec for spec in extras["triton"] + extras["torch"])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_framework_module_without_its_framework_names_the_extra(framework):
    """``import ratiokl.<framework>`` with the framework unimportable (blocked in
    ``sys.modules``) raises an ImportError saying which extra to install."""
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import ratiokl.{framework}\n"
            "except ImportError as err:\n    print(type(err).__name__, err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": ""}, check=True, timeout=120)
    assert proc.stdout.startswith("MissingDependency ratiokl."), proc.stdout + proc.stderr
    assert f"pip install 'ratiokl[{framework}]'" in proc.stdout


_NATIVE_WITHOUT_TRITON = {
    "torch": """
import torch
from ratiokl.torch import loss
ids = torch.zeros(2, 3, dtype=torch.long)
print(loss.selected_logprobs(torch.ones(2, 3, 5), ids, backend="auto").shape)
print(loss.linear_selected_logprobs(torch.ones(2, 3, 4), torch.ones(5, 4), ids,
                                    return_entropy=True, backend="auto")[0].shape)
print(loss.linear_policy_loss(torch.ones(2, 3, 4), torch.ones(5, 4), ids, None,
                              torch.zeros(2, 3), torch.ones(2), backend="auto")[0].shape)
""",
    "jax": """
import jax.numpy as jnp
from ratiokl.jax import loss
ids = jnp.zeros((2, 3), jnp.int32)
print(loss.selected_logprobs(jnp.ones((2, 3, 5)), ids, backend="auto").shape)
print(loss.linear_selected_logprobs(jnp.ones((2, 3, 4)), jnp.ones((5, 4)), ids,
                                    return_entropy=True, backend="auto")[0].shape)
print(loss.linear_policy_loss(jnp.ones((2, 3, 4)), jnp.ones((5, 4)), ids, None,
                              jnp.zeros((2, 3)), jnp.ones(2), backend="auto")[0].shape)
""",
}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_native_ops_run_without_triton(framework):
    """Without Triton (the ``torch`` / ``jax`` extras alone), ``backend="auto"`` runs every
    op natively: no module on the native route imports Triton (the JAX linear ops' did)."""
    pytest.importorskip(framework)
    code = "import sys; sys.modules['triton'] = None\n" + _NATIVE_WITHOUT_TRITON[framework]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": "", "JAX_PLATFORMS": "cpu"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["torch.Size([2,", "3])"] * 2 + ["torch.Size([])"] \
        if framework == "torch" else proc.stdout.split() == ["(2,", "3)"] * 2 + ["()"]


@pytest.mark.parametrize("adapter, blocked", [
    ("trl", "torch"), ("trl", "trl"), ("tunix", "jax"), ("tunix", "tunix"),
    ("verl", "torch"), ("verl", "verl"),
    ("openrlhf", "torch"), ("openrlhf", "openrlhf"),
])
def test_adapter_without_its_framework_or_trainer_names_the_extra(adapter, blocked):
    """``import ratiokl.adapters.<trainer>`` with its framework or its trainer unimportable
    (blocked in ``sys.modules``, whatever is installed) says to install the adapter's extra,
    as ``ratiokl.torch`` / ``ratiokl.jax`` do."""
    code = (f"import sys; sys.modules[{blocked!r}] = None\n"
            f"try:\n    import ratiokl.adapters.{adapter}\n"
            "except ImportError as err:\n    print(type(err).__name__, err)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": str(SRC), "PATH": ""}, check=True, timeout=120)
    assert proc.stdout.startswith(f"MissingDependency ratiokl.adapters.{adapter} needs "), \
        proc.stdout + proc.stderr
    assert f"pip install 'ratiokl[{adapter}]'" in proc.stdout


def test_framework_too_old_names_the_versions(monkeypatch):
    fake = types.ModuleType("fakejax")
    fake.__version__ = "0.4.30"
    monkeypatch.setattr(_requirements.importlib, "import_module", lambda name: fake)
    with pytest.raises(MissingDependency, match=r"jax 0\.4\.30 is installed; ratiokl needs "
                                                r"jax>=0\.8\.2"):
        _requirements.import_framework("jax", needed_by="ratiokl.jax")


def test_triton_found_under_pytorch_triton(monkeypatch):
    """PyTorch's nightly / container builds install the module as ``pytorch-triton``."""
    versions = {"pytorch-triton": "3.7.0+git1234"}

    def version(name):
        if name not in versions:
            raise _requirements.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(_requirements.importlib.metadata, "version", version)
    assert _requirements.installed_version("triton") == "3.7.0+git1234"
    assert _requirements.unmet("triton") is None
    assert _requirements.installed_version("jax-triton") is None
