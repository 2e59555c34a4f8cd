"""The advantage fixtures (``conformance/advantages/``) on every (framework, backend) pair:
one test body, ``ratiokl.harness.run_advantage_case`` (as ``ratiokl check`` runs them).

A case passes when each output is float32 of the expected shape, NaN exactly where
expected, and elsewhere within the manifest's tolerance of the float64 expectation. The
fixtures are also regenerated in-process (``generate.write_advantage_fixtures``): inputs
bit-identical, expectations to float64 rounding."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ratiokl import harness

ROOT = Path(__file__).resolve().parents[1] / "conformance"
FIXTURES = ROOT / "advantages"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["cases"]
#: GAE's backends; the group estimators take none (the harness skips them elsewhere).
TARGETS = ("torch-native", "torch-interpret", "jax-native")


def _load(name: str):
    with np.load(FIXTURES / MANIFEST[name]["file"]) as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("pair", TARGETS)
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture(pair, name):
    pytest.importorskip(pair.split("-")[0])
    result = harness.run_advantage_case(harness.load_advantage_case(name, ROOT), pair)
    if result.skipped is not None:
        pytest.skip(result.skipped)
    assert result.passed, "\n".join(result.failures)


def test_fixtures_reproduce(tmp_path):
    spec_ = importlib.util.spec_from_file_location("generate", ROOT / "generate.py")
    sys.path.insert(0, str(ROOT))
    try:
        generate = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(generate)
        generate.write_advantage_fixtures(tmp_path)
    finally:
        sys.path.remove(str(ROOT))
    fresh = json.loads((tmp_path / "manifest.json").read_text())["cases"]
    assert sorted(fresh) == sorted(MANIFEST)
    for name, entry in MANIFEST.items():
        assert {k: v for k, v in fresh[name].items() if k != "sha256"} == \
            {k: v for k, v in entry.items() if k != "sha256"}, name
        with np.load(tmp_path / entry["file"]) as new:
            old = _load(name)
            assert sorted(new.files) == sorted(old)
            for key in old:
                if key.startswith("expected_"):
                    np.testing.assert_allclose(new[key], old[key], rtol=1e-12, atol=1e-12,
                                               equal_nan=True, err_msg=f"{name}: {key}")
                else:
                    np.testing.assert_array_equal(new[key], old[key], err_msg=f"{name}: {key}")
