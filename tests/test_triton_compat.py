"""``ratiokl._kernels.triton_compat``: every use of Triton's internals, checked against the
Triton versions it was tested on at import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from ratiokl._kernels import triton_compat  # noqa: E402

_PROBE = """
import warnings
import triton
triton.__version__ = {version!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from ratiokl._kernels import triton_compat
print(triton_compat.IN_RANGE, sum(issubclass(w.category, RuntimeWarning)
                                  and "tested with Triton" in str(w.message) for w in caught))
"""


def _import_with(version: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _PROBE.format(version=version)], env=env,
                          capture_output=True, text=True, check=True)
    return done.stdout.split()[-2] + " " + done.stdout.split()[-1]


def test_installed_triton_is_in_the_tested_range():
    assert triton_compat.IN_RANGE, (triton_compat.TESTED, triton_compat.triton.__version__)


@pytest.mark.parametrize("version, expected", [
    ("3.6.0", "True 0"), ("3.9.0+git1a2b", "True 0"), ("3.5.1", "False 1"), ("3.10.0", "False 1"),
])
def test_a_version_outside_the_range_warns_and_turns_the_cached_launch_off(version, expected):
    assert _import_with(version) == expected
