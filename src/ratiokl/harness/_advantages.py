"""The advantage estimators' fixtures: load one, run it on a built-in target, judge it.

They sit beside the loss fixtures (``<root>/advantages/manifest.json`` and ``cases/``,
``conformance/README.md`` says how they are written) and take no logits and have no
gradient, so they have a case type of their own. A case runs through
``ratiokl.<framework>.advantages.<function>``: GAE and REINFORCE++ with the target's
backend, the group estimators (which take no backend) on the ``*-native`` targets only.
A case is judged as a loss case's outputs are (``_compare``): float32, NaN exactly where
expected, elsewhere within the manifest's tolerance of the float64 expectation.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

from ratiokl.harness._cases import read_npz
from ratiokl.harness._compare import Check, compare_close
from ratiokl.harness._fixtures import fixtures_root, read_case_file
from ratiokl.harness._frameworks import TARGETS
from ratiokl.harness._runner import CaseResult
from ratiokl.spec.tolerances import Tolerance

__all__ = ["AdvantageCase", "list_advantage_cases", "load_advantage_case",
           "run_advantage_case"]

#: The functions that take ``backend=`` and their positional arguments (arrays, then
#: scalars from the options); the others are called ``f(scores, group_ids, **rest)``.
_TOKEN_FUNCTIONS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "gae": (("rewards", "values", "mask"), ("gamma", "lam")),
    "reinforce_pp": (("rewards", "mask"), ("gamma",)),
    "optimal_token_baseline": (("rewards", "mask", "old_logps", "sum_pi_squared"), ()),
}
#: Why a group estimator's case is skipped on a target other than ``*-native``.
NO_BACKEND = "the group estimators take no backend (the *-native targets run them)"


@dataclass(frozen=True)
class AdvantageCase:
    """One call of ``advantages.<function>``: array ``inputs``, keyword ``options``, float64
    ``expected`` outputs (``advantages``; GAE and REINFORCE++ also ``returns``)."""

    name: str
    function: str
    inputs: Mapping[str, np.ndarray]
    options: Mapping[str, Any]
    expected: Mapping[str, np.ndarray]
    tolerance: Tolerance
    description: str = ""

    @property
    def group(self) -> str:
        """The case group ``ratiokl check`` prints: ``advantages.<function>``."""
        return f"advantages.{self.function}"


def _root(root: Optional[Path]) -> Path:
    return (Path(root) if root is not None else fixtures_root()) / "advantages"


def _manifest(root: Optional[Path]) -> Dict[str, Any]:
    path = _root(root) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: regenerate the fixtures with "
                                "`python conformance/generate.py`")
    return json.loads(path.read_text())["cases"]


def list_advantage_cases(pattern: str = "*", root: Optional[Path] = None) -> List[str]:
    """Case names, sorted, whose name or group (``advantages.gae``) matches ``pattern``."""
    return sorted(name for name, entry in _manifest(root).items()
                  if fnmatch.fnmatch(name, pattern)
                  or fnmatch.fnmatch(f"advantages.{entry['function']}", pattern))


def load_advantage_case(name: str, root: Optional[Path] = None) -> AdvantageCase:
    """Read one case; ``ValueError`` if its file does not match the manifest's hash."""
    entry = _manifest(root)[name]
    arrays = read_npz(read_case_file(_root(root), entry))
    expected = {k[len("expected_"):]: v for k, v in arrays.items() if k.startswith("expected_")}
    inputs = {k: v for k, v in arrays.items() if not k.startswith("expected_")}
    return AdvantageCase(name, entry["function"], inputs, entry["options"], expected,
                         Tolerance(**entry["tolerance"]), entry["description"])


def _call(case: AdvantageCase, framework: str, backend: str) -> Dict[str, Any]:
    """The case's outputs from ``ratiokl.<framework>.advantages``, by name."""
    module = importlib.import_module(f"ratiokl.{framework}.advantages")
    if framework == "torch":
        import torch

        to_array = torch.from_numpy
    else:
        import jax.numpy as jnp

        to_array = jnp.asarray
    inputs = {k: to_array(np.ascontiguousarray(v)) for k, v in case.inputs.items()}
    options = dict(case.options)
    function = getattr(module, case.function)
    if case.function in _TOKEN_FUNCTIONS:
        arrays, scalars = _TOKEN_FUNCTIONS[case.function]
        args = [inputs.pop(k) for k in arrays] + [options.pop(k) for k in scalars]
        out = function(*args, backend=backend, **inputs, **options)
        return dict(zip(("advantages", "returns"), out))
    args = (inputs.pop("scores"), inputs.pop("group_ids", None))
    return {"advantages": function(*args, **inputs, **options)}


def run_advantage_case(case: AdvantageCase, target: str) -> CaseResult:
    """Run ``case`` on the built-in ``target`` (``"torch-native"``, ...) and judge it."""
    spec = TARGETS[target]
    result = CaseResult(case.name, case.group, target, "contiguous", passed=False,
                        worst=float("nan"))
    if case.function not in _TOKEN_FUNCTIONS and spec.backend != "native":
        result.skipped = NO_BACKEND
        return result
    check = Check()
    try:
        outputs = _call(case, spec.framework, spec.backend)
    except Exception as error:  # a failure of this case, not of the run
        check.fail(f"raised {type(error).__name__}: {error}")
        outputs = {}
    else:
        for key in sorted(set(case.expected) - set(outputs)):
            check.fail(f"{key}: missing from the outputs")
    for key, value in outputs.items():
        if key not in case.expected:
            check.fail(f"{key}: not an output of the case")
            continue
        actual = np.asarray(value)
        if actual.dtype != np.float32:
            check.fail(f"{key}: dtype {actual.dtype}, expected float32")
        compare_close(check, key, actual, case.expected[key], case.tolerance)
    result.passed, result.worst, result.failures = check.passed, check.worst, check.failures
    return result
