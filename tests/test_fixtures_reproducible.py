"""The committed fixtures are exactly what ``conformance/generate.py`` writes.

Inputs and cotangents must be bit-identical. Expected values come from NumPy's
float64 ``exp``/``log`` and sums, whose last bits may differ between CPUs (SIMD
paths, summation order), so they are judged to rounding of each array's scale
(``regenerated_tol``); wherever every array is identical, the
``.npz`` bytes and the manifest must be identical too (the writer has no
timestamps or ordering freedom).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ratiokl
from assertions import assert_close
from ratiokl import harness
from ratiokl.harness._cases import read_npz, write_npz
from ratiokl.spec import Tolerance

REPO = Path(__file__).resolve().parents[1]
GENERATE = REPO / "conformance" / "generate.py"
#: Float64 expectations may move across CPUs' libm and BLAS paths (SIMD width, summation
#: order): by up to 102 ulps of the value seen on one machine (a k3 KL near 0, where
#: exp(d) - d - 1 cancels), and on an AVX2-only one by 3e-17 of the array's largest entry
#: at a gradient entry 1e-6 of that size (a sum that cancels). Each array is judged to
#: 1e-12 of its value plus 1e-12 of its largest finite entry: far below any fixture
#: tolerance (>= 1e-6 relative), far above rounding.
REGENERATED_RTOL = 1e-12


def regenerated_tol(expected: np.ndarray) -> Tolerance:
    """The tolerance between a regenerated float64 array and the committed ``expected``."""
    finite = np.abs(expected[np.isfinite(expected)])
    scale = float(finite.max()) if finite.size else 0.0
    return Tolerance(rtol=REGENERATED_RTOL, atol=REGENERATED_RTOL * scale)

pytestmark = pytest.mark.skipif(not GENERATE.is_file(), reason="needs a source checkout")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """Fixtures freshly written by the generator script, run as documented in the README."""
    out = tmp_path_factory.mktemp("fixtures")
    env = dict(os.environ, PYTHONPATH=str(Path(ratiokl.__file__).resolve().parents[1]))
    subprocess.run([sys.executable, str(GENERATE), "--out", str(out)], check=True, env=env)
    return out


def _identical(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_same_case_files(regenerated: Path) -> None:
    committed = sorted(p.name for p in (REPO / "conformance" / "cases").glob("*.npz"))
    assert sorted(p.name for p in (regenerated / "cases").glob("*.npz")) == committed


@pytest.mark.parametrize("name", harness.list_cases())
def test_case_reproduces(regenerated: Path, name: str) -> None:
    new_bytes = (regenerated / "cases" / f"{name}.npz").read_bytes()
    old_bytes = (REPO / "conformance" / "cases" / f"{name}.npz").read_bytes()
    new, old = read_npz(new_bytes), read_npz(old_bytes)
    assert sorted(new) == sorted(old)
    for key in old:
        if key.startswith("expected_") and old[key].dtype == np.float64:
            assert new[key].shape == old[key].shape, key
            assert_close(new[key], old[key], regenerated_tol(old[key]), f"{name}: {key}")
        else:
            assert _identical(new[key], old[key]), f"{name}: input {key!r} changed"
    if all(_identical(new[k], old[k]) for k in old):
        assert new_bytes == old_bytes, f"{name}: same arrays but different file bytes"


def test_manifest_reproduces(regenerated: Path) -> None:
    new_text = (regenerated / "manifest.json").read_text()
    old_text = (REPO / "conformance" / "manifest.json").read_text()
    new, old = json.loads(new_text), json.loads(old_text)
    assert new["format_version"] == old["format_version"] == harness.FORMAT_VERSION
    assert sorted(new["cases"]) == sorted(old["cases"])
    for name, entry in old["cases"].items():
        fresh = dict(new["cases"][name])
        for which, tol in entry.pop("tolerances").items():
            for key, value in tol.items():
                # A tolerance scales with its case's float64 values: it moves as they do.
                assert_close(fresh["tolerances"][which][key], value,
                             Tolerance(rtol=REGENERATED_RTOL, atol=0.0), f"{name} {which} {key}")
        fresh.pop("tolerances"), fresh.pop("sha256"), entry.pop("sha256")
        assert fresh == entry, name
    same_files = all(
        (regenerated / e["file"]).read_bytes() == (REPO / "conformance" / e["file"]).read_bytes()
        for e in old["cases"].values()
    )
    if same_files:
        assert new_text == old_text


def test_writer_is_deterministic() -> None:
    arrays = {"b": np.arange(5, dtype=np.float32), "a": np.ones((2, 3), dtype=bool)}
    first = write_npz(arrays)
    assert write_npz(dict(reversed(list(arrays.items())))) == first
    assert all(_identical(read_npz(first)[k], v) for k, v in arrays.items())
