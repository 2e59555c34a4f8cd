"""``ratiokl check``: every conformance fixture on every target that can run here.

Prints a table of target x case group (passed / total, worst error as a
fraction of its tolerance, cases skipped) with a progress bar per target while it
runs, lists the targets that cannot run here with the full reason, each failed case
with its messages and each skip reason with its cases, and exits 1 if any case
failed, 2 if nothing could run. ``--target package.module:object`` adds any
implementation written to the check-target protocol (``ratiokl.harness.CheckTarget``).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Sequence, TextIO, Tuple, Union

from tqdm import tqdm

import ratiokl
from ratiokl import harness
from ratiokl.harness import AdvantageCase, Case, CaseResult, CheckTarget

__all__ = ["DESCRIPTION", "SUMMARY", "add_arguments", "run"]

SUMMARY = "run the conformance fixtures on every backend that can run here"
DESCRIPTION = f"""\
Run every conformance fixture (inputs, float64 expectations, a tolerance per dtype) on
each (framework, backend) target that can run on this machine and compare.

Targets: {', '.join(harness.TARGETS)}.
PyTorch targets run every case twice: once on contiguous logits and once on a strided
view of them (every other column of a wider buffer whose gaps hold NaN, which the
backend must never read nor write a gradient to), so their counts are twice the number
of cases. JAX arrays carry no strides: JAX targets run each case once.
The built-in targets also run the advantage estimators' fixtures (case groups
advantages.<function>, once each; the group estimators on the *-native targets only).

--target package.module:object runs the same fixtures on any other implementation (a
port of a loss to another framework, a trainer's own loss code) instead of the built-in
targets (add --backend to run both). The object (or the class / function returning it
when called with no arguments) follows ratiokl.harness.CheckTarget:
  name                 the label printed in the table
  supports(call)       None to run the case, else the reason it cannot (printed as skipped)
  __call__(call)       a TargetResult: outputs by name ("loss", "ratio", "logp", ...) and
                       gradients by argument name ("policy_logits", "logps", ...), NumPy
`call` is a TargetCall: op ("policy_loss", "ratio_kl", ...), dtype, arguments (NumPy
inputs and scalar options by name), cotangents, the outputs and gradients the case
compares. Shipped targets for the trainers' own loss code (each needs its trainer):
  ratiokl.harness.targets.verl:TARGET       verl 0.9.1 core_algos as ppo_loss runs them
  ratiokl.harness.targets.openrlhf:TARGET   OpenRLHF 0.11.2 PolicyLoss, compute_approx_kl
  ratiokl.harness.targets.trl:TARGET        TRL 1.16 GRPOTrainer._compute_loss
(and NAN_PADDED beside each TARGET: the fixtures' NaN padding passed as it is).
A disagreement is reported case by case: the output, where, the values, the tolerance;
--verbose lists every case.
See docs/check.md.

Exit status: 0 every case run passed, 1 some case failed, 2 nothing could run (or a bad
--backend, --case or --target)."""

#: Why a PyTorch target's count is twice the number of cases (printed with the counts).
STRIDED_NOTE = ("PyTorch targets run each case twice (contiguous logits, then a strided "
                "view); --contiguous-only skips the second pass")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", metavar="GLOB",
                        help="target(s) to run, e.g. torch-native or 'jax-*' (repeatable; "
                             f"default all: {', '.join(harness.TARGETS)})")
    parser.add_argument("--case", action="append", metavar="GLOB",
                        help="cases to run: a glob on case names (vocab_2_fp32) or on the "
                             "case groups the table prints (vocab_2); repeatable (the union); "
                             "default all")
    parser.add_argument("--target", action="append", metavar="MODULE:OBJECT",
                        help="also run any implementation of the check-target protocol, "
                             "e.g. ratiokl.harness.targets.verl:TARGET (repeatable); "
                             "without --backend only these run")
    parser.add_argument("--contiguous-only", action="store_true",
                        help="skip the second pass of PyTorch targets on strided logits")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every result here")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="one line per case instead of per case group: passed, failed "
                             "(worst error / tolerance) or skipped (the target's reason)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (they go to stderr)")


def unknown_patterns(patterns: Sequence[str]) -> List[str]:
    """The ``--backend`` globs that match no target name."""
    return [p for p in patterns if not any(fnmatch.fnmatch(t, p) for t in harness.TARGETS)]


def _targets(patterns: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """Selected targets that can run here, and the selected ones that cannot (with reasons)."""
    selected = [t for t in harness.TARGETS if any(fnmatch.fnmatch(t, p) for p in patterns)]
    runnable, unavailable = [], {}
    for target in selected:
        reason = harness.target_status(target)
        if reason is None:
            runnable.append(target)
        else:
            unavailable[target] = reason
    return runnable, unavailable


def _variants(target: Union[str, CheckTarget], strided: bool) -> Tuple[bool, ...]:
    torch_target = isinstance(target, str) and harness.TARGETS[target].framework == "torch"
    return (False, True) if strided and torch_target else (False,)


def _worst(results: Sequence[CaseResult]) -> str:
    ran = [r.worst for r in results if r.skipped is None]
    return f"{max(ran, default=0.0):.3g}" if ran else "-"


def _label(target: Union[str, CheckTarget]) -> str:
    return target if isinstance(target, str) else target.name


def _run_target(target: Union[str, CheckTarget], cases: Sequence[Case],
                variants: Tuple[bool, ...], advantage_cases: Sequence[AdvantageCase],
                progress: bool) -> List[CaseResult]:
    """Every case on ``target`` (each variant in turn), then the advantage cases (on a
    built-in target only), with a progress bar on stderr."""
    results = []
    label = _label(target)
    advantage_cases = advantage_cases if isinstance(target, str) else ()
    with tqdm(total=len(cases) * len(variants) + len(advantage_cases), desc=f"{label:<16}",
              unit="case",
              file=sys.stderr, disable=not progress, leave=False, mininterval=0.5,
              bar_format="{desc} {bar:24} {n_fmt}/{total_fmt} cases "
                         "[{elapsed}<{remaining}]") as bar:
        for strided in variants:
            bar.set_description(f"{label:<16}" + (" (strided pass)" if strided else ""))
            for case in cases:
                results.append(harness.run_case(case, target, strided=strided))
                bar.update()
        bar.set_description(f"{label:<16}")
        for advantage_case in advantage_cases:
            results.append(harness.run_advantage_case(advantage_case, target))
            bar.update()
    return results


def _print_cases(results: List[CaseResult], out: TextIO) -> None:
    """One line per case: its status, the worst error / tolerance, or the skip reason."""
    for r in results:
        detail = r.skipped if r.skipped is not None else f"{r.worst:.3g}"
        variant = " [strided]" if r.variant == "strided" else ""
        print(f"{r.target:<17} {r.case + variant:<44}{r.status:>9}  {detail}", file=out)
    out.flush()


def _print_rows(results: List[CaseResult], out: TextIO) -> None:
    """One line per (target, case group) with a case run: passed / run, the worst error /
    tolerance, and how many were skipped (groups skipped whole are listed in the summary)."""
    by_key: Dict[Tuple[str, str], List[CaseResult]] = defaultdict(list)
    for r in results:
        by_key[(r.target, r.group)].append(r)
    for (target, group), rs in by_key.items():
        ran = [r for r in rs if r.skipped is None]
        if not ran:
            continue
        passed = sum(r.passed for r in ran)
        flag = "" if passed == len(ran) else "  FAIL"
        skipped = f"  {len(rs) - len(ran)} skipped" if len(ran) < len(rs) else ""
        print(f"{target:<17} {group:<44}{passed:>4}/{len(ran):<4}{_worst(ran):>11}{flag}"
              f"{skipped}", file=out)
    out.flush()


def _counts(rs: List[CaseResult], n_cases: int, advantage_names: Sequence[str]) -> str:
    """``251 cases x 2: contiguous + strided, 17 advantage cases, 14 skipped``."""
    advantage = sum(r.case in set(advantage_names) for r in rs)
    parts = []
    if n_cases:
        passes = (len(rs) - advantage) // n_cases
        how = ": contiguous + strided" if passes == 2 else ""
        parts.append(f"{n_cases} cases x {passes}{how}")
    if advantage:
        parts.append(f"{advantage} advantage cases")
    skipped = sum(r.skipped is not None for r in rs)
    if skipped:
        parts.append(f"{skipped} skipped")
    return ", ".join(parts)


def _print_summary(results: List[CaseResult], unavailable: Dict[str, str], n_cases: int,
                   advantage_names: Sequence[str], seconds: float, out: TextIO) -> None:
    by_target: Dict[str, List[CaseResult]] = defaultdict(list)
    for r in results:
        by_target[r.target].append(r)
    print("\nsummary", file=out)
    for target, rs in by_target.items():
        ran = [r for r in rs if r.skipped is None]
        passed = sum(r.passed for r in ran)
        print(f"  {target:<17} {passed:>5}/{len(ran):<5} passed   worst/tol {_worst(ran):<8} "
              f"({_counts(rs, n_cases, advantage_names)})", file=out)
    for target, reason in unavailable.items():
        print(f"  {target:<18}unavailable: {reason}", file=out)
    _print_skips(results, out)
    failed = [r for r in results if r.status == "failed"]
    if failed:
        print(f"\n{len(failed)} failures:", file=out)
        for r in failed:
            print(f"  {r.target} {r.case} [{r.variant}]: {'; '.join(r.failures[:3])}", file=out)
    ran = [r for r in results if r.skipped is None]
    print(f"\n{len(ran) - len(failed)}/{len(ran)} passed"
          f"{f', {len(results) - len(ran)} skipped' if len(ran) < len(results) else ''}"
          f" in {seconds:.1f}s", file=out)


def _print_skips(results: List[CaseResult], out: TextIO) -> None:
    """Each (target, skip reason) once, with the case groups it covers."""
    by_reason: Dict[Tuple[str, str], List[str]] = defaultdict(list)
    for r in results:
        if r.skipped is not None and r.group not in by_reason[(r.target, r.skipped)]:
            by_reason[(r.target, r.skipped)].append(r.group)
    if by_reason:
        print("\nskipped (the target's reason: the case groups)", file=out)
    for (target, reason), groups in by_reason.items():
        more = f" and {len(groups) - 8} more" if len(groups) > 8 else ""
        print(f"  {target}: {reason}: {', '.join(groups[:8])}{more}", file=out)


def _load_targets(specs: Sequence[str]) -> List[CheckTarget]:
    """``--target`` objects, imported from the working directory too (as ``python -m``,
    uvicorn and gunicorn do; a console script's path holds its own folder, not the working
    directory); ``ValueError`` naming ``--target`` and the fix."""
    if specs and not {"", os.getcwd()} & set(sys.path):
        sys.path.insert(0, os.getcwd())
    return [harness.load_target(spec, argument="--target") for spec in specs]


def run(args: argparse.Namespace) -> int:
    """Run ``ratiokl check`` with parsed ``args``; returns the exit status."""
    out = sys.stdout
    patterns = args.backend or ([] if args.target else ["*"])
    unknown = unknown_patterns(patterns)
    if unknown:
        print(f"ratiokl check: --backend {', '.join(map(repr, unknown))} matches no target; "
              f"choose from {', '.join(harness.TARGETS)} (globs allowed, e.g. 'torch-*')",
              file=sys.stderr)
        return 2
    try:
        external = _load_targets(args.target or [])
    except ValueError as error:
        print(f"ratiokl check: {error}", file=sys.stderr)
        return 2
    root = harness.fixtures_root()
    globs = args.case or ["*"]
    names = sorted({name for glob in globs for name in harness.list_cases(glob, root)})
    advantage_names = sorted({name for glob in globs
                              for name in harness.list_advantage_cases(glob, root)})
    if not names and not advantage_names:
        print(f"ratiokl check: no case matches --case {', '.join(map(repr, globs))} (neither "
              "a case name nor a case group)", file=sys.stderr)
        return 2
    builtins, unavailable = _targets(patterns)
    targets: List[Union[str, CheckTarget]] = [*builtins, *external]
    print(f"ratiokl {ratiokl.__version__}: {len(names)} cases and {len(advantage_names)} "
          f"advantage cases from {root}", file=out)
    if not args.contiguous_only and any(harness.TARGETS[t].framework == "torch"
                                        for t in builtins):
        print(STRIDED_NOTE, file=out)
    start = time.perf_counter()
    cases = [harness.load_case(n, root) for n in names]
    advantage_cases = [harness.load_advantage_case(n, root) for n in advantage_names]
    what = ("case", "status", "worst/tol or reason") if args.verbose else (
        "case group", "passed", "worst/tol")
    print(f"\n{'target':<18}{what[0]:<44}{what[1]:>9}{what[2]:>11}", file=out)
    results: List[CaseResult] = []
    for target in targets:
        mine = _run_target(target, cases, _variants(target, not args.contiguous_only),
                           advantage_cases, progress=not args.no_progress)
        (_print_cases if args.verbose else _print_rows)(mine, out)
        results += mine
    seconds = time.perf_counter() - start
    _print_summary(results, unavailable, len(names), advantage_names, seconds, out)
    if args.json is not None:
        report = {"version": ratiokl.__version__, "fixtures": str(root), "seconds": seconds,
                  "unavailable": unavailable, "results": [r.as_dict() for r in results]}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if not any(r.skipped is None for r in results):
        print("ratiokl check: nothing ran: none of the selected targets can run here, or "
              "they skip every selected case (reasons above)", file=sys.stderr)
        return 2
    return 0 if all(r.status != "failed" for r in results) else 1
