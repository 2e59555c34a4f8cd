"""The closeness rule every comparison uses (``ratiokl.harness.compare_close``: the
fixtures' judge and the tests' ``assert_close``): an entry outside its bound fails the
check wherever it is, zeros and a zero ``atol`` included."""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl.harness import Check, compare_close
from ratiokl.spec import Tolerance

EXACT_RELATIVE = Tolerance(rtol=1e-6, atol=0.0)


def _passes(actual, expected, tol: Tolerance) -> bool:
    check = Check()
    compare_close(check, "x", np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                  tol)
    return check.passed


@pytest.mark.parametrize("zero_first", [True, False])
def test_a_far_entry_fails_beside_an_exact_zero(zero_first):
    """An exact ``0 == 0`` under ``atol = 0`` (a zero bound) hides no other entry."""
    actual, expected = [0.0, 1.5], [0.0, 1.0]
    if not zero_first:
        actual, expected = actual[::-1], expected[::-1]
    assert not _passes(actual, expected, EXACT_RELATIVE)


def test_exact_zeros_pass_and_a_nonzero_against_zero_fails_under_a_zero_atol():
    assert _passes([0.0, 1.0], [0.0, 1.0 + 1e-7], EXACT_RELATIVE)
    assert not _passes([1e-30, 1.0], [0.0, 1.0], EXACT_RELATIVE)
    assert _passes([1e-30, 1.0], [0.0, 1.0], Tolerance(rtol=1e-6, atol=1e-20))


def test_nan_and_infinity_must_match():
    assert _passes([np.nan, np.inf], [np.nan, np.inf], EXACT_RELATIVE)
    assert not _passes([0.0, np.inf], [np.nan, np.inf], EXACT_RELATIVE)
    assert not _passes([np.nan, -np.inf], [np.nan, np.inf], EXACT_RELATIVE)


def test_an_unmeasured_error_is_a_failure():
    """A NaN error fraction (nothing to compare it by) fails the check, never passes it."""
    check = Check()
    check.fraction("x", float("nan"))
    assert not check.passed and check.worst == np.inf
    check = Check()
    check.fraction("x", 1.0)
    assert check.passed
