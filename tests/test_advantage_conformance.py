"""The advantage fixtures (``conformance/advantages/``) on every (framework, backend) pair:
one test body, ``from_numpy -> advantages.<function> -> to_numpy``.

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

ROOT = Path(__file__).resolve().parents[1] / "conformance"
FIXTURES = ROOT / "advantages"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())["cases"]
#: (framework, backend): GAE's backends; the group estimators take none.
TARGETS = (("torch", "native"), ("torch", "interpret"), ("jax", "native"))
TOKEN_FUNCTIONS = ("gae", "reinforce_pp")
POSITIONAL = {"gae": ("rewards", "values", "mask"), "reinforce_pp": ("rewards", "mask")}
SCALARS = {"gae": ("gamma", "lam"), "reinforce_pp": ("gamma",)}


def _load(name: str):
    with np.load(FIXTURES / MANIFEST[name]["file"]) as data:
        return {k: data[k] for k in data.files}


def _module(framework: str):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from ratiokl.torch import advantages
        return advantages, torch.from_numpy
    jnp = pytest.importorskip("jax.numpy")
    from ratiokl.jax import advantages
    return advantages, jnp.asarray


def _call(framework: str, backend: str, name: str):
    entry, arrays = MANIFEST[name], _load(name)
    module, to_array = _module(framework)
    function, options = entry["function"], dict(entry["options"])
    inputs = {k: to_array(v) for k, v in arrays.items() if not k.startswith("expected_")}
    if function in TOKEN_FUNCTIONS:
        args = [inputs.pop(k) for k in POSITIONAL[function]]
        args += [options.pop(k) for k in SCALARS[function]]
        out = getattr(module, function)(*args, backend=backend, **options)
        outputs = dict(zip(("advantages", "returns"), out))
    else:
        args = (inputs.pop("scores"), inputs.pop("group_ids"))
        outputs = {"advantages": getattr(module, function)(*args, **inputs, **options)}
    return {k: np.asarray(v) for k, v in outputs.items()}, arrays, entry


@pytest.mark.parametrize("pair", TARGETS, ids=lambda t: f"{t[0]}-{t[1]}")
@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_fixture(pair, name):
    framework, backend = pair
    if backend != "native" and MANIFEST[name]["function"] not in TOKEN_FUNCTIONS:
        pytest.skip("the group estimators take no backend")
    outputs, arrays, entry = _call(framework, backend, name)
    assert sorted(outputs) == entry["outputs"]
    for key, actual in outputs.items():
        expected = arrays[f"expected_{key}"]
        assert actual.dtype == np.float32 and actual.shape == expected.shape, key
        np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected), err_msg=key)
        np.testing.assert_allclose(actual, expected, equal_nan=True, err_msg=key,
                                   **entry["tolerance"])


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
