"""Command line: ``ratiokl check`` (also ``python -m ratiokl check``).

Runs every conformance fixture on every (framework, backend) target that can
run on this machine, prints a table of target x case group (passed / total,
worst error as a fraction of its tolerance), lists the targets that cannot run
here and why, and exits non-zero if any case failed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import ratiokl
from ratiokl import conformance
from ratiokl.conformance import CaseResult


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
    worst = max((r.worst for r in results), default=0.0)
    return f"{worst:.3g}"


def _print_header(out) -> None:
    print(f"\n{'target':<18}{'case group':<44}{'passed':>9}{'worst/tol':>11}", file=out)


def _print_rows(results: List[CaseResult], out) -> None:
    """One line per (target, case group): passed / total and the worst error / tolerance."""
    by_key: Dict[Tuple[str, str], List[CaseResult]] = defaultdict(list)
    for r in results:
        by_key[(r.target, r.group)].append(r)
    for (target, group), rs in by_key.items():
        passed = sum(r.passed for r in rs)
        flag = "" if passed == len(rs) else "  FAIL"
        print(f"{target:<18}{group:<44}{passed:>4}/{len(rs):<4}{_worst(rs):>11}{flag}", file=out)
    out.flush()


def _print_summary(results, unavailable, seconds, out) -> None:
    by_target: Dict[str, List[CaseResult]] = defaultdict(list)
    for r in results:
        by_target[r.target].append(r)
    print("\nsummary", file=out)
    for target, rs in by_target.items():
        passed = sum(r.passed for r in rs)
        print(f"  {target:<18}{passed:>5}/{len(rs):<5} passed   worst/tol {_worst(rs)}", file=out)
    for target, reason in unavailable.items():
        print(f"  {target:<18}unavailable: {reason}", file=out)
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"\n{len(failed)} failures:", file=out)
        for r in failed:
            print(f"  {r.target} {r.case} [{r.variant}]: {'; '.join(r.failures[:3])}", file=out)
    print(f"\n{len(results) - len(failed)}/{len(results)} passed in {seconds:.1f}s", file=out)


def check(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ratiokl check``; returns the exit status (0: every case passed)."""
    parser = argparse.ArgumentParser(
        prog="ratiokl check",
        description="Run the conformance fixtures on every (framework, backend) target that can "
        "run here; exit 1 if any case fails, 2 if nothing could run.",
    )
    parser.add_argument("--backend", action="append", metavar="GLOB",
                        help="target(s) to run, e.g. torch-native or 'jax-*' (repeatable; "
                             f"default all: {', '.join(conformance.TARGETS)})")
    parser.add_argument("--case", default="*", metavar="GLOB", help="case names to run (glob)")
    parser.add_argument("--contiguous-only", action="store_true",
                        help="skip the second pass of torch targets with strided policy logits")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every result here")
    args = parser.parse_args(argv)
    out = sys.stdout
    root = conformance.fixtures_root()
    names = conformance.list_cases(args.case, root)
    if not names:
        print(f"no case matches {args.case!r}", file=sys.stderr)
        return 2
    targets, unavailable = _targets(args.backend or ["*"])
    print(f"ratiokl {ratiokl.__version__}: {len(names)} cases from {root}", file=out)
    start = time.perf_counter()
    cases = [conformance.load_case(n, root) for n in names]
    _print_header(out)
    results: List[CaseResult] = []
    for target in targets:
        mine = [
            conformance.run_case(case, target, strided=strided)
            for strided in _variants(target, not args.contiguous_only)
            for case in cases
        ]
        _print_rows(mine, out)
        results += mine
    seconds = time.perf_counter() - start
    _print_summary(results, unavailable, seconds, out)
    if args.json is not None:
        report = {"version": ratiokl.__version__, "fixtures": str(root), "seconds": seconds,
                  "unavailable": unavailable, "results": [r.as_dict() for r in results]}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not targets:
        print("no target can run here", file=sys.stderr)
        return 2
    return 0 if all(r.passed for r in results) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ratiokl`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("check",):
        print("usage: ratiokl check [--backend GLOB] [--case GLOB] [--contiguous-only] "
              "[--json PATH]\n  run `ratiokl check --help` for details", file=sys.stderr)
        return 2
    return check(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
