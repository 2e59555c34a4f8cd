"""Shared pytest setup: which (framework, backend) targets the suite runs.

A test that takes a ``target`` argument runs once per target
(``torch-native``, ``torch-interpret``, ``torch-triton``, ``jax-native``,
``jax-interpret``, ``jax-triton``); ``native_target`` once per ``*-native`` target,
``torch_target`` once per ``torch-*`` target, ``jax_target`` once per ``jax-*`` target and
``interpret_target`` once per ``*-interpret`` target and ``cpu_target`` once per target
that runs without a GPU.
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
import importlib.util
import os
import subprocess
import sys
from typing import List

# XLA's CPU backend compiles every JAX program of the suite without LLVM's optimisation
# passes: the tests' arrays are tiny, so compiling is most of a JAX test's time (a
# policy-loss fixture's value and gradient: 1.4 of 1.8 s), and -O0 takes about a third
# off it. XLA's CPU fast math is off at every level; the suite passes at both. Set before
# anything initialises JAX; the subprocess tests inherit it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` in ``XLA_FLAGS`` (an unknown flag aborts
    every JAX process; XLA adds and retires flags between releases). Asked in a
    subprocess, 0.4 s: building ``CompileOptions`` parses ``XLA_FLAGS``; a jaxlib without
    that private module answers no."""
    if importlib.util.find_spec("jaxlib") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", "from jaxlib import _jax; _jax.CompileOptions()"],
        env=dict(os.environ, XLA_FLAGS=flag), capture_output=True, timeout=120)
    return probe.returncode == 0


# And with XLA's CPU loop emitters instead of the MLIR fusion emitters it uses by default,
# which took half of what is left of a compile (8 policy-loss fixtures: 2.4 s of compiling
# instead of 4.8; block (a)'s jax-native conformance 66 -> 39 s on 2 workers). Code
# generation only: fast math stays off, and the suite passes with either. `ratiokl check`
# outside pytest (CI's block (c), the H200) keeps XLA's defaults. Decided once, in the
# process pytest starts (its xdist workers and the subprocess tests inherit XLA_FLAGS).
_EMITTERS = "--xla_cpu_use_fusion_emitters"
if (_EMITTERS not in os.environ.get("XLA_FLAGS", "")
        and "PYTEST_XDIST_WORKER" not in os.environ and _xla_knows(f"{_EMITTERS}=false")):
    os.environ["XLA_FLAGS"] += f" {_EMITTERS}=false"

import pytest  # noqa: E402
from conformance_subset import SUBSET_PAIRS, SUBSET_TARGETS, representative_cases  # noqa: E402
from parts import in_part, parse_part  # noqa: E402

from ratiokl import harness  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backends",
        default="*",
        help="comma-separated globs of conformance targets to run "
        f"(default: all of {', '.join(harness.TARGETS)}; unavailable ones are skipped; "
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
    names = harness.list_cases()
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
    items.sort(key=_start_rank)


#: The suite's longest tests (nodeid prefixes; 10-60 s each on CI's 2 cores: subprocesses
#: with their own JAX or torch start-up and compiles, and torch.compile, whose C++ builds
#: took 50 s with an empty Inductor cache), slowest first. They start before every other
#: test, in this order, so that none is left to start on one xdist worker while the other
#: has run out of tests: `.ci/run` runs with `--dist worksteal`, where an idle worker takes
#: the end of the other's queue. Only the order changes; a name missing here runs in its
#: place.
_SLOWEST = (
    "tests/test_vocab_parallel_bench.py::test_cpu_dry_run_passes_its_checks",
    "tests/jax/test_vocab_parallel.py::test_triton_path_through_the_interpreter",
    "tests/torch/test_compile.py::test_compiled_matches_eager",
    "tests/torch/test_vocab_parallel.py::test_sharded_matches_unsharded[4]",
    "tests/jax/test_vocab_parallel.py::test_transforms_policy_loss_and_sharding_modes",
    "tests/torch/test_vocab_parallel.py::test_interpret_backend_sharded_matches_unsharded",
    "tests/test_bench_smoke.py::test_cpu_smoke_run_writes_complete_consistent_records",
    "tests/jax/test_vocab_parallel.py::test_conformance_fixtures_sharded_over_four_devices",
    "tests/torch/test_vocab_parallel.py::test_sharded_matches_unsharded[2]",
    "tests/torch/test_policy_loss.py::test_torch_compile_fullgraph_matches_eager",
)


def _start_rank(item: pytest.Item) -> int:
    """Where ``item`` starts: its place in :data:`_SLOWEST`, else after all of them
    (``list.sort`` is stable: the rest keep pytest's order)."""
    return next((rank for rank, prefix in enumerate(_SLOWEST) if item.nodeid.startswith(prefix)),
                len(_SLOWEST))


def _keep_subsets(config: pytest.Config, items: List[pytest.Item]) -> None:
    """Deselect the fixtures a :data:`SUBSET_TARGETS` target skips (``--backends`` left at
    ``*``), on every target with ``--fixture-subset``."""
    everywhere = config.getoption("--fixture-subset")
    if not (everywhere or _subsets(config)):
        return
    keep = set(representative_cases(harness.list_cases()))
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
    return harness.target_status(target)


#: (fixture, target) pairs marked slow: the strided second pass through the
#: Triton interpreter doubles its time and `ratiokl check` already covers it.
_SLOW = {("torch_target", "torch-interpret")}


def _params(config: pytest.Config, fixture: str, names):
    patterns = [p.strip() for p in config.getoption("--backends").split(",") if p.strip()]
    params = []
    for name in names:
        if not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        marks = [pytest.mark.gpu] if harness.TARGETS[name].gpu else []
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
    "interpret_target": lambda t: t.backend == "interpret",
    "cpu_target": lambda t: not t.gpu,
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, keep in _TARGET_FIXTURES.items():
        if fixture in metafunc.fixturenames:
            names = [n for n, t in harness.TARGETS.items() if keep(t)]
            metafunc.parametrize(fixture, _params(metafunc.config, fixture, names))
