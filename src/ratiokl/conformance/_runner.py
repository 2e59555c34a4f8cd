"""Run one case on one target and judge the result."""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any, Dict, List

import numpy as np

from ratiokl.conformance._cases import Case
from ratiokl.conformance._compare import Check, compare_close, compare_neutral
from ratiokl.conformance._frameworks import Outcome, call_target

__all__ = ["CaseResult", "judge", "run_case"]


@dataclass
class CaseResult:
    """Outcome of one case on one target; ``worst`` is the largest error / tolerance."""

    case: str
    group: str
    target: str
    variant: str
    passed: bool
    worst: float
    failures: List[str] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        worst = self.worst if np.isfinite(self.worst) else None
        return {"case": self.case, "group": self.group, "target": self.target,
                "variant": self.variant, "passed": self.passed, "worst": worst,
                "failures": list(self.failures)}


def judge(case: Case, outcome: Outcome) -> Check:
    """Compare an outcome with the case's expectations (see ``_compare`` for the rules)."""
    op = case.spec
    check = Check()
    inactive = ~case.row_mask
    for out in op.outputs:
        actual = outcome.outputs[out]
        if outcome.output_dtypes[out] != "float32":
            check.fail(f"{out}: dtype {outcome.output_dtypes[out]}, expected float32")
        compare_close(check, out, actual, case.arrays[f"expected_{out}"], case.tolerances[out])
        neutral = op.neutral.get(out, op.per_token_neutral.get(out))
        if neutral is not None and actual.shape == inactive.shape:
            compare_neutral(check, out, actual, inactive, neutral, signed_zero_ok=False)
    if outcome.grad_dtype != case.dtype:
        check.fail(f"grad: dtype {outcome.grad_dtype}, expected {case.dtype}")
    compare_close(check, "grad", outcome.grad, case.arrays["expected_grad"], case.tolerances["grad"])
    if outcome.grad.shape[:-1] == inactive.shape or op.token_values:
        compare_neutral(check, "grad", outcome.grad, inactive, 0.0, signed_zero_ok=True)
    for key in case.also_differentiated:
        name = f"grad_{key}"
        if key not in outcome.extra_grads:
            check.fail(f"{name}: missing")
            continue
        if outcome.extra_grad_dtypes[key] != case.dtype:
            check.fail(f"{name}: dtype {outcome.extra_grad_dtypes[key]}, expected {case.dtype}")
        compare_close(check, name, outcome.extra_grads[key], case.arrays[f"expected_{name}"],
                      case.tolerances[name])
        if op.token_values:
            compare_neutral(check, name, outcome.extra_grads[key], inactive, 0.0,
                            signed_zero_ok=True)
    if outcome.stride_gap_grad is not None and np.any(outcome.stride_gap_grad != 0):
        check.fail("grad: the strided view's unused slots received a non-zero gradient")
    return check


def run_case(case: Case, target: str, *, strided: bool = False) -> CaseResult:
    """Run ``case`` on ``target`` (e.g. ``"torch-native"``) and compare; never raises for a failure."""
    check = Check()
    expected_error = getattr(builtins, case.expect_error) if case.expect_error else None
    try:
        outcome = call_target(case, target, strided=strided)
    except Exception as exc:  # noqa: BLE001 - every library error is a reported result
        if expected_error is not None and isinstance(exc, expected_error):
            if case.rejected_argument not in str(exc):
                check.fail(f"{type(exc).__name__} does not name `{case.rejected_argument}`: "
                           f"{exc}")
        else:
            check.fail(f"raised {type(exc).__name__}: {exc}")
    else:
        if expected_error is not None:
            check.fail(f"expected {case.expect_error}, but the call returned")
        else:
            check = judge(case, outcome)
    return CaseResult(case.name, case.group, target, "strided" if strided else "contiguous",
                      check.passed, check.worst, check.failures)
