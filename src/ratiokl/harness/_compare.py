"""Comparison semantics of the conformance suite.

* NaN exactly where NaN is expected; infinities equal;
  elsewhere ``|actual - expected| <= atol + rtol * |expected|``.
* Inactive rows hold the exact neutral value: bitwise ``1.0``/``+0.0`` for
  outputs; a gradient of ``+0.0`` or ``-0.0``.

Each check returns the worst error as a fraction of its tolerance (``<= 1``
passes; ``inf`` for a NaN/inf/neutral-value mismatch) and messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Tuple

import numpy as np

from ratiokl.spec.tolerances import Tolerance

__all__ = ["Check", "compare_close", "compare_neutral"]


@dataclass
class Check:
    """Accumulated outcome of a case's comparisons."""

    worst: float = 0.0
    failures: List[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def fail(self, message: str) -> None:
        self.worst = float("inf")
        self.failures.append(message)

    def fraction(self, what: str, value: float, detail: str = "") -> None:
        """Record an error of ``value`` times its tolerance (a failure above 1); ``detail``
        (where, the values, the tolerance) is appended to the failure's message. A NaN
        ``value`` fails as a mismatch does: an error not measured is not within tolerance."""
        if value != value:
            self.fail(f"{what}: error is NaN{detail}")
            return
        self.worst = max(self.worst, value)
        if value > 1.0:
            self.failures.append(f"{what}: error is {value:.3g}x its tolerance{detail}")


def _first(index: np.ndarray) -> Tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(index)[0])


def compare_close(check: Check, what: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance) -> None:
    """Compare ``actual`` with float64 ``expected`` under ``tol``; record into ``check``."""
    if actual.shape != expected.shape:
        check.fail(f"{what}: shape {actual.shape}, expected {expected.shape}")
        return
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    nan_mismatch = np.isnan(a) != np.isnan(e)
    if nan_mismatch.any():
        pos = _first(nan_mismatch)
        check.fail(f"{what}: {int(nan_mismatch.sum())} NaN mismatches, first at {list(pos)}: "
                   f"got {a[pos]!r}, expected {e[pos]!r}")
        return
    inf_e = np.isinf(e)
    inf_mismatch = (inf_e | np.isinf(a)) & ~np.isnan(e) & (a != e)
    if inf_mismatch.any():
        pos = _first(inf_mismatch)
        check.fail(f"{what}: infinity mismatch at {list(pos)}: got {a[pos]!r}, expected {e[pos]!r}")
        return
    finite = np.isfinite(e)
    if finite.any():
        # Equal entries are within any bound, a zero bound included (0 / 0 would be a NaN
        # that argmax picks and the check reads as passing); another one over a zero bound
        # is infinitely far.
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            diff = np.abs(a - e)
            err = np.where(finite & (diff != 0), diff / (tol.atol + tol.rtol * np.abs(e)), 0.0)
        pos = np.unravel_index(int(np.argmax(err)), err.shape)
        at = f" at {[int(i) for i in pos]}" if err.ndim else ""
        check.fraction(what, float(err[pos]),
                       f"{at}: got {a[pos]:.9g}, expected {e[pos]:.9g} "
                       f"(atol {tol.atol:.3g}, rtol {tol.rtol:.3g})")


def compare_neutral(
    check: Check, what: str, actual: np.ndarray, inactive: np.ndarray, value: float, *, signed_zero_ok: bool
) -> None:
    """Inactive entries of ``actual`` must equal ``value`` bitwise (or ``== 0`` if ``signed_zero_ok``)."""
    got = np.asarray(actual)[inactive]
    if got.size == 0:
        return
    if signed_zero_ok:
        bad = got != value
    else:
        want = np.full(got.shape, value, dtype=got.dtype)
        bad = got.view(np.uint8).reshape(got.size, -1) != want.view(np.uint8).reshape(got.size, -1)
        bad = bad.any(axis=-1)
    if np.any(bad):
        first = got.reshape(-1)[int(np.argmax(np.reshape(bad, -1)))]
        check.fail(f"{what}: {int(np.sum(bad))} inactive entries are not exactly {value!r} "
                   f"(e.g. {first!r})")
