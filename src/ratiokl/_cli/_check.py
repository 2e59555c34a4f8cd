"""``ratiokl check``: every conformance fixture on every target that can run here.

Prints a table of target x case group (passed / total, worst error as a
fraction of its tolerance) with a progress bar per target while it runs, lists
the targets that cannot run here with the full reason, and exits 1 if any case
failed, 2 if nothing could run.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, TextIO, Tuple

from tqdm import tqdm

import ratiokl
from ratiokl import conformance
from ratiokl.conformance import Case, CaseResult

__all__ = ["DESCRIPTION", "SUMMARY", "add_arguments", "run"]

SUMMARY = "run the conformance fixtures on every backend that can run here"
DESCRIPTION = f"""\
Run every conformance fixture (inputs, float64 expectations, a tolerance per dtype) on
each (framework, backend) target that can run on this machine and compare.

Targets: {', '.join(conformance.TARGETS)}.
PyTorch targets run every case twice: once on contiguous logits and once on a strided
view of them (every other column of a wider buffer whose gaps hold NaN, which the
backend must never read nor write a gradient to), so their counts are twice the number
of cases. JAX arrays carry no strides: JAX targets run each case once.

Exit status: 0 every case passed, 1 some case failed, 2 nothing could run."""

#: Why a PyTorch target's count is twice the number of cases (printed with the counts).
STRIDED_NOTE = ("PyTorch targets run each case twice (contiguous logits, then a strided "
                "view); --contiguous-only skips the second pass")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", metavar="GLOB",
                        help="target(s) to run, e.g. torch-native or 'jax-*' (repeatable; "
                             f"default all: {', '.join(conformance.TARGETS)})")
    parser.add_argument("--case", action="append", metavar="GLOB",
                        help="cases to run: a glob on case names (vocab_2_fp32) or on the "
                             "case groups the table prints (vocab_2); repeatable (the union); "
                             "default all")
    parser.add_argument("--contiguous-only", action="store_true",
                        help="skip the second pass of PyTorch targets on strided logits")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every result here")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they go to stderr)")


def unknown_patterns(patterns: Sequence[str]) -> List[str]:
    """The ``--backend`` globs that match no target name."""
    return [p for p in patterns if not any(fnmatch.fnmatch(t, p) for t in conformance.TARGETS)]


def _targets(patterns: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """Selected targets that can run here, and the selected ones that cannot (with reasons)."""
    selected = [t for t in conformance.TARGETS if any(fnmatch.fnmatch(t, p) for p in patterns)]
    runnable, unavailable = [], {}
    for target in selected:
        reason = conformance.target_status(target)
        if reason is None:
            runnable.append(target)
        else:
            unavailable[target] = reason
    return runnable, unavailable


def _variants(target: str, strided: bool) -> Tuple[bool, ...]:
    return (False, True) if strided and conformance.TARGETS[target].framework == "torch" else (False,)


def _worst(results: Sequence[CaseResult]) -> str:
    return f"{max((r.worst for r in results), default=0.0):.3g}"


def _run_target(target: str, cases: Sequence[Case], variants: Tuple[bool, ...],
                progress: bool) -> List[CaseResult]:
    """Every case on ``target`` (each variant in turn), with a progress bar on stderr."""
    results = []
    with tqdm(total=len(cases) * len(variants), desc=f"{target:<16}", unit="case",
              file=sys.stderr, disable=not progress, leave=False, mininterval=0.5,
              bar_format="{desc} {bar:24} {n_fmt}/{total_fmt} cases "
                         "[{elapsed}<{remaining}]") as bar:
        for strided in variants:
            bar.set_description(f"{target:<16}" + (" (strided pass)" if strided else ""))
            for case in cases:
                results.append(conformance.run_case(case, target, strided=strided))
                bar.update()
    return results


def _print_rows(results: List[CaseResult], out: TextIO) -> None:
    """One line per (target, case group): passed / total and the worst error / tolerance."""
    by_key: Dict[Tuple[str, str], List[CaseResult]] = defaultdict(list)
    for r in results:
        by_key[(r.target, r.group)].append(r)
    for (target, group), rs in by_key.items():
        passed = sum(r.passed for r in rs)
        flag = "" if passed == len(rs) else "  FAIL"
        print(f"{target:<18}{group:<44}{passed:>4}/{len(rs):<4}{_worst(rs):>11}{flag}", file=out)
    out.flush()


def _print_summary(results: List[CaseResult], unavailable: Dict[str, str], n_cases: int,
                   seconds: float, out: TextIO) -> None:
    by_target: Dict[str, List[CaseResult]] = defaultdict(list)
    for r in results:
        by_target[r.target].append(r)
    print("\nsummary", file=out)
    for target, rs in by_target.items():
        passed = sum(r.passed for r in rs)
        passes = len(rs) // max(n_cases, 1)
        how = {2: ": contiguous + strided"}.get(passes, "")
        print(f"  {target:<18}{passed:>5}/{len(rs):<5} passed   worst/tol {_worst(rs):<8} "
              f"({n_cases} cases x {passes}{how})", file=out)
    for target, reason in unavailable.items():
        print(f"  {target:<18}unavailable: {reason}", file=out)
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"\n{len(failed)} failures:", file=out)
        for r in failed:
            print(f"  {r.target} {r.case} [{r.variant}]: {'; '.join(r.failures[:3])}", file=out)
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {seconds:.1f}s", file=out)


def run(args: argparse.Namespace) -> int:
    """Run ``ratiokl check`` with parsed ``args``; returns the exit status."""
    out = sys.stdout
    patterns = args.backend or ["*"]
    unknown = unknown_patterns(patterns)
    if unknown:
        print(f"ratiokl check: --backend {', '.join(map(repr, unknown))} matches no target; "
              f"choose from {', '.join(conformance.TARGETS)} (globs allowed, e.g. 'torch-*')",
              file=sys.stderr)
        return 2
    root = conformance.fixtures_root()
    globs = args.case or ["*"]
    names = sorted({name for glob in globs for name in conformance.list_cases(glob, root)})
    if not names:
        print(f"ratiokl check: no case matches --case {', '.join(map(repr, globs))} (neither "
              "a case name nor a case group)", file=sys.stderr)
        return 2
    targets, unavailable = _targets(patterns)
    print(f"ratiokl {ratiokl.__version__}: {len(names)} cases from {root}", file=out)
    if not args.contiguous_only and any(conformance.TARGETS[t].framework == "torch"
                                        for t in targets):
        print(STRIDED_NOTE, file=out)
    start = time.perf_counter()
    cases = [conformance.load_case(n, root) for n in names]
    print(f"\n{'target':<18}{'case group':<44}{'passed':>9}{'worst/tol':>11}", file=out)
    results: List[CaseResult] = []
    for target in targets:
        mine = _run_target(target, cases, _variants(target, not args.contiguous_only),
                           progress=not args.no_progress)
        _print_rows(mine, out)
        results += mine
    seconds = time.perf_counter() - start
    _print_summary(results, unavailable, len(names), seconds, out)
    if args.json is not None:
        report = {"version": ratiokl.__version__, "fixtures": str(root), "seconds": seconds,
                  "unavailable": unavailable, "results": [r.as_dict() for r in results]}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not targets:
        print("ratiokl check: none of the selected targets can run here (reasons above)",
              file=sys.stderr)
        return 2
    return 0 if all(r.passed for r in results) else 1
