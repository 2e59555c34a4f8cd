"""The tests' one closeness assertion: the conformance harness's own rule.

``assert_close(actual, expected, tol, what)``: NaN exactly where the float64
``expected`` has NaN, the same infinities, and ``|a - e| <= atol + rtol |e|``
elsewhere (``ratiokl.harness.compare_close``, the rule the fixtures are
judged by). ``actual`` may be a NumPy, PyTorch or JAX array of any float dtype.
Returns the worst error as a fraction of its tolerance.

``two_paths(tol)``: the tolerance between two evaluations that are each within ``tol`` of
the exact value (a kernel and the native path, compiled and eager). ``assert_identical``:
the same bits, NaN where NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ratiokl.harness import Check, compare_close
from ratiokl.spec import Tolerance


def as_float64(x: Any) -> np.ndarray:
    """A float64 NumPy copy of a NumPy / PyTorch / JAX array."""
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_close(actual: Any, expected: Any, tol: Tolerance, what: str = "value") -> float:
    check = Check()
    compare_close(check, what, as_float64(actual), as_float64(expected), tol)
    assert check.passed, "; ".join(check.failures)
    return check.worst


def two_paths(tol: Tolerance) -> Tolerance:
    """Each side within ``tol`` of the exact value, so the two within twice ``tol``."""
    return Tolerance(rtol=2.0 * tol.rtol, atol=2.0 * tol.atol)


def assert_identical(actual: Any, expected: Any, what: str = "value") -> None:
    """The same values (bit for bit in float64), NaN exactly where ``expected`` has NaN."""
    np.testing.assert_array_equal(as_float64(actual), as_float64(expected), err_msg=what)
