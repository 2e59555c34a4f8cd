"""Conformance fixtures: locate, load, run on a (framework, backend) target, compare.

Used by the test suite and by ``ratiokl check``. Importing this module
imports neither torch nor jax; each framework adapter imports its framework
when a case runs on it.

Typical use::

    from ratiokl import harness
    for name in harness.list_cases("inactive_rows_*"):
        result = harness.run_case(harness.load_case(name), "torch-native")
        assert result.passed, result.failures

Targets are ``"torch-native"``, ``"torch-interpret"``, ``"torch-triton"``,
``"jax-native"``, ``"jax-interpret"`` and ``"jax-triton"`` (``interpret``: the Triton
kernels through Triton's CPU interpreter); :func:`target_status` says why one cannot
run here (``None`` when it can).

Any other implementation (a trainer's loss, a port to another framework) runs the same
cases through the check-target protocol: an object with ``name``, ``supports(call)`` and
``__call__(call)`` (:class:`CheckTarget`, :class:`TargetCall`, :class:`TargetResult`)::

    result = harness.run_case(harness.load_case(name), my_target)
    print(result.status, result.skipped or result.failures)

``ratiokl check --target package.module:object`` does this for every case
(``docs/check.md``); the trainers' own loss codes are in ``ratiokl.harness.targets``.

The advantage estimators' fixtures (no logits, no gradient) have their own case type and
run on the built-in targets: ``run_advantage_case(load_advantage_case(name), "jax-native")``
for each name of ``list_advantage_cases()``.
"""

from ratiokl.harness._cases import LOGIT_DTYPES, Case, build_case, round_to_dtype
from ratiokl.harness._fixtures import (
    FORMAT_VERSION,
    fixtures_root,
    list_cases,
    load_case,
    load_manifest,
    write_fixtures,
)
from ratiokl.harness._frameworks import TARGETS, Outcome, Target, call_target, target_status
from ratiokl.harness._protocol import CheckTarget, TargetCall, TargetResult, load_target
from ratiokl.harness._builtin import BuiltinTarget, builtin_target
from ratiokl.harness._ops import OPS, Op
from ratiokl.harness._compare import Check, compare_close
from ratiokl.harness._runner import CaseResult, judge, outcome_of, run_case
from ratiokl.harness._advantages import (
    AdvantageCase,
    list_advantage_cases,
    load_advantage_case,
    run_advantage_case,
)

__all__ = [
    "AdvantageCase",
    "FORMAT_VERSION",
    "LOGIT_DTYPES",
    "OPS",
    "TARGETS",
    "BuiltinTarget",
    "Case",
    "CaseResult",
    "Check",
    "CheckTarget",
    "Op",
    "Outcome",
    "Target",
    "TargetCall",
    "TargetResult",
    "build_case",
    "builtin_target",
    "call_target",
    "compare_close",
    "fixtures_root",
    "judge",
    "list_advantage_cases",
    "list_cases",
    "load_advantage_case",
    "load_case",
    "load_manifest",
    "load_target",
    "outcome_of",
    "round_to_dtype",
    "run_advantage_case",
    "run_case",
    "target_status",
    "write_fixtures",
]
