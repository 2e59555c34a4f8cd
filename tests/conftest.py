"""Shared pytest setup: which (framework, backend) targets the suite runs.

A test that takes a ``target`` argument runs once per target
(``torch-native``, ``torch-interpret``, ``torch-triton``, ``jax-native``,
``jax-interpret``, ``jax-triton``); ``native_target`` once per ``*-native`` target,
``torch_target`` once per ``torch-*`` target and ``jax_target`` once per ``jax-*`` target.
``--backends`` narrows the list (comma-separated globs, e.g.
``--backends=torch-*``). GPU targets carry ``pytest.mark.gpu``; a target that
cannot run here is skipped with the reason; the Triton interpreter's strided
second pass carries ``pytest.mark.slow``.

By default the conformance fixtures (a test's ``case_name``) run on ``jax-interpret``,
and in the strided pass on ``torch-interpret``, only for ``representative_cases``, one
per group (the rule and why: ``tests/helpers/conformance_subset.py``). A ``--backends`` that names it (any value but
the default ``*``, e.g. ``--backends=jax-interpret`` or ``jax-*``) runs all of them, as
``ratiokl check --backend jax-interpret`` does. ``--fixture-subset`` runs that subset on
every target (a second stack's run, where the first has run them all).
"""

from __future__ import annotations

import fnmatch
import functools
import os
from typing import List

# XLA's CPU backend compiles every JAX program of the suite without LLVM's optimisation
# passes: the tests' arrays are tiny, so compiling is most of a JAX test's time (a
# policy-loss fixture's value and gradient: 1.4 of 1.8 s), and -O0 takes about a third
# off it. XLA's CPU fast math is off at every level; the suite passes at both. Set before
# anything initialises JAX; the subprocess tests inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import pytest  # noqa: E402
from conformance_subset import SUBSET_PAIRS, SUBSET_TARGETS, representative_cases  # noqa: E402
from parts import in_part, parse_part  # noqa: E402

from ratiokl import conformance  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default="*",
        help="comma-separated globs of conformance targets to run "
        f"(default: all of {', '.join(conformance.TARGETS)}; unavailable ones are skipped; "
        f"{', '.join(SUBSET_TARGETS)} on one fixture per group unless named here)",
    )
    parser.addoption(
        "--fixture-subset", action="store_true",
        help="every target runs the conformance fixtures one per group, as the subset "
        "targets do by default (a second stack's run: .ci/run's block (b))",
    )
    parser.addoption(
        "--part", default=None, metavar="I/N",
        help="run the I-th of N interleaved parts of the selected tests (1-based): a run "
        "longer than one device call, the GPU sweep, in several (tests/helpers/parts.py)",
    )


def _subsets(config: pytest.Config) -> bool:
    """Whether the :data:`SUBSET_TARGETS` run their subset: ``--backends`` left at ``*``."""
    return config.getoption("--backends") == "*"


def pytest_report_header(config: pytest.Config) -> List[str]:
    if not _subsets(config):
        return []
    names = conformance.list_cases()
    return [f"conformance on {', '.join(SUBSET_TARGETS)} and the strided pass on "
            f"torch-interpret: {len(representative_cases(names))} of {len(names)} fixtures "
            "(one per group); a --backends naming them runs all"]


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Deselect the fixtures a :data:`SUBSET_TARGETS` target skips by default, then keep
    the ``--part`` asked for."""
    _keep_subsets(config, items)
    part = config.getoption("--part")
    if part:
        index, count = parse_part(part)
        chosen = in_part([item.nodeid for item in items], index, count)
        config.hook.pytest_deselected(items=[i for i, c in zip(items, chosen) if not c])
        items[:] = [i for i, c in zip(items, chosen) if c]


def _keep_subsets(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Deselect the fixtures a :data:`SUBSET_TARGETS` target skips (``--backends`` left at
    ``*``), on every target with ``--fixture-subset``."""
    everywhere = config.getoption("--fixture-subset")
    if not (everywhere or _subsets(config)):
        return
    keep = set(representative_cases(conformance.list_cases()))
    selected, deselected = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        pairs = {(k, v) for k, v in params.items() if k in _TARGET_FIXTURES}
        subset = everywhere or any(v in SUBSET_TARGETS or (k, v) in SUBSET_PAIRS
                                   for k, v in pairs)
        skipped = subset and "case_name" in params and params["case_name"] not in keep
        (deselected if skipped else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


@functools.lru_cache(maxsize=None)
def _status(target: str):
    return conformance.target_status(target)


#: (fixture, target) pairs marked slow: the strided second pass through the
#: Triton interpreter doubles its time and `ratiokl check` already covers it.
_SLOW = {("torch_target", "torch-interpret")}


def _params(config: pytest.Config, fixture: str, names):
    patterns = [p.strip() for p in config.getoption("--backends").split(",") if p.strip()]
    params = []
    for name in names:
        if not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        marks = [pytest.mark.gpu] if conformance.TARGETS[name].gpu else []
        if (fixture, name) in _SLOW:
            marks.append(pytest.mark.slow)
        reason = _status(name)
        if reason is not None:
            marks.append(pytest.mark.skip(reason=f"{name} unavailable: {reason}"))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


#: Fixture name -> which targets it is parametrised over.
_TARGET_FIXTURES = {
    "target": lambda t: True,
    "native_target": lambda t: t.backend == "native",
    "torch_target": lambda t: t.framework == "torch",
    "jax_target": lambda t: t.framework == "jax",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, keep in _TARGET_FIXTURES.items():
        if fixture in metafunc.fixturenames:
            names = [n for n, t in conformance.TARGETS.items() if keep(t)]
            metafunc.parametrize(fixture, _params(metafunc.config, fixture, names))
