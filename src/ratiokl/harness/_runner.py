"""Run one case on one target and judge the result.

A target is a built-in name (``"torch-native"``) or any :class:`CheckTarget`; a case it
does not support is a skipped result carrying its reason, an exception it raises a failed
one (unless the case expects that error), and outputs it does not return (metrics it has
no equivalent of) are listed as unchecked.
"""

from __future__ import annotations

import builtins
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ratiokl.harness._builtin import builtin_target
from ratiokl.harness._cases import Case
from ratiokl.harness._compare import Check, compare_close, compare_neutral
from ratiokl.harness._frameworks import Outcome
from ratiokl.harness._protocol import CheckTarget, TargetCall, TargetResult

__all__ = ["CaseResult", "judge", "outcome_of", "run_case"]


@dataclass
class CaseResult:
    """Outcome of one case on one target; ``worst`` is the largest error / tolerance.

    ``skipped``: the target's reason for not running the case (then ``passed`` is False
    and nothing was compared); ``unchecked``: the outputs the target did not return.
    """

    case: str
    group: str
    target: str
    variant: str
    passed: bool
    worst: float
    failures: List[str] = field(default_factory=list)
    skipped: Optional[str] = None
    unchecked: List[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``"passed"``, ``"failed"`` or ``"skipped"``."""
        return "skipped" if self.skipped is not None else "passed" if self.passed else "failed"

    def as_dict(self) -> Dict[str, Any]:
        worst = self.worst if np.isfinite(self.worst) else None
        return {"case": self.case, "group": self.group, "target": self.target,
                "variant": self.variant, "status": self.status, "passed": self.passed,
                "worst": worst, "failures": list(self.failures), "skipped": self.skipped,
                "unchecked": list(self.unchecked)}


def judge(case: Case, outcome: Outcome) -> Check:
    """Compare an outcome with the case's expectations (see ``_compare`` for the rules)."""
    op = case.spec
    check = Check()
    inactive = ~case.row_mask
    for out in op.outputs:
        if out not in outcome.outputs:
            if out in op.cotangents:
                check.fail(f"{out}: missing from the target's outputs")
            continue
        actual = outcome.outputs[out]
        if outcome.output_dtypes.get(out, "float32") != "float32":
            check.fail(f"{out}: dtype {outcome.output_dtypes[out]}, expected float32")
        compare_close(check, out, actual, case.arrays[f"expected_{out}"], case.tolerances[out])
        neutral = op.neutral.get(out, op.per_token_neutral.get(out))
        if neutral is not None and actual.shape == inactive.shape:
            compare_neutral(check, out, actual, inactive, neutral, signed_zero_ok=False)
    if outcome.grad is None:
        check.fail(f"grad: the gradient w.r.t. `{op.differentiate}` is missing")
        return check
    main_dtype = case.dtype_of(op.differentiate)
    if outcome.grad_dtype not in (None, main_dtype):
        check.fail(f"grad: dtype {outcome.grad_dtype}, expected {main_dtype}")
    compare_close(check, "grad", outcome.grad, case.arrays["expected_grad"], case.tolerances["grad"])
    if outcome.grad.shape[:-1] == inactive.shape or op.token_values:
        compare_neutral(check, "grad", outcome.grad, inactive, 0.0, signed_zero_ok=True)
    for key in case.also_differentiated:
        name = f"grad_{key}"
        if key not in outcome.extra_grads:
            check.fail(f"{name}: missing")
            continue
        want = case.dtype_of(key)
        if outcome.extra_grad_dtypes.get(key, want) != want:
            check.fail(f"{name}: dtype {outcome.extra_grad_dtypes[key]}, expected {want}")
        compare_close(check, name, outcome.extra_grads[key], case.arrays[f"expected_{name}"],
                      case.tolerances[name])
        if op.token_values:
            compare_neutral(check, name, outcome.extra_grads[key], inactive, 0.0,
                            signed_zero_ok=True)
    if outcome.stride_gap_grad is not None and np.any(outcome.stride_gap_grad != 0):
        check.fail("grad: the strided view's unused slots received a non-zero gradient")
    return check


def outcome_of(call: TargetCall, result: TargetResult) -> Outcome:
    """A target's result as the :class:`Outcome` :func:`judge` reads (float arrays kept;
    dtypes only where the target gave them)."""
    main, *extra = call.grads
    grads = {k: np.asarray(g) for k, g in result.grads.items()}
    return Outcome(
        outputs={o: np.asarray(v) for o, v in result.outputs.items()},
        output_dtypes=dict(result.output_dtypes),
        grad=grads.get(main),
        grad_dtype=result.grad_dtypes.get(main),
        stride_gap_grad=result.stride_gap_grad,
        extra_grads={k: grads[k] for k in extra if k in grads},
        extra_grad_dtypes={k: d for k, d in result.grad_dtypes.items() if k in extra},
    )


def run_case(case: Case, target: Union[str, CheckTarget], *, strided: bool = False) -> CaseResult:
    """Run ``case`` on ``target`` and compare; never raises for a failure.

    ``target``: a built-in name (``"torch-native"``; with ``strided`` PyTorch's run on a
    strided view of the logits) or any :class:`CheckTarget`.
    """
    if isinstance(target, str):
        target = builtin_target(target, strided=strided)
    elif strided:
        raise ValueError("`strided` applies to ratiokl's PyTorch targets only; pass a target "
                         "name such as 'torch-native', or strided=False")
    variant = "strided" if strided else "contiguous"
    call = TargetCall.of(case)
    check = Check()
    unchecked: List[str] = []
    try:
        reason = target.supports(call)
    except Exception as exc:  # noqa: BLE001 - a broken target is a reported result
        reason = None
        check.fail(f"supports() raised {type(exc).__name__}: {exc}")
    if reason is not None:
        return CaseResult(case.name, case.group, target.name, variant, False, 0.0,
                          skipped=str(reason))
    if check.passed:
        check, unchecked = _run(case, call, target)
    return CaseResult(case.name, case.group, target.name, variant, check.passed, check.worst,
                      check.failures, unchecked=unchecked)


def _run(case: Case, call: TargetCall, target: CheckTarget) -> Tuple[Check, List[str]]:
    """``(check, unchecked outputs)`` of one supported case."""
    check = Check()
    expected_error = getattr(builtins, case.expect_error) if case.expect_error else None
    try:
        result = target(call)
    except Exception as exc:  # noqa: BLE001 - every error is a reported result
        if expected_error is not None and isinstance(exc, expected_error):
            if case.rejected_argument not in str(exc):
                check.fail(f"{type(exc).__name__} does not name `{case.rejected_argument}`: "
                           f"{exc}")
        else:
            check.fail(f"raised {type(exc).__name__}: {exc}")
        return check, []
    if expected_error is not None:
        check.fail(f"expected {case.expect_error}, but the call returned")
        return check, []
    if not isinstance(result, TargetResult):
        check.fail(f"returned a {type(result).__name__}, not a TargetResult")
        return check, []
    unchecked = [o for o in case.spec.outputs if o not in result.outputs]
    return judge(case, outcome_of(call, result)), unchecked
