"""``ratiokl bench``: run the benchmark suite (``benchmarks/run.py``) and draw its plots.

The suite is not part of the package (it needs the peers it compares with,
e.g. Liger-Kernel, and writes results beside itself): it lives in a source
checkout's ``benchmarks/``. :func:`find_suite` looks for it in ``--suite``,
then ``$RATIOKL_BENCHMARKS``, then the current folder and its parents, then the
checkout this package was installed from (``pip install -e .``); from a wheel
with none of those, the command says how to get one. The suite runs in a
subprocess of this Python, so it sees the same installed packages.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

import ratiokl

__all__ = ["DEFAULT_PRESET", "DESCRIPTION", "SUMMARY", "add_arguments", "find_suite",
           "presets", "run"]

SUMMARY = "run the benchmark suite (a source checkout's benchmarks/) and plot it"
DEFAULT_PRESET = "cpu-smoke"
DESCRIPTION = f"""\
Run the benchmark suite of a ratiokl source checkout (benchmarks/run.py): every provider
(ratiokl's backends, eager PyTorch, torch.compile, XLA, Liger-Kernel where installed)
side by side, under both timings, writing a results JSON and a CSV beside it (by default
in the temporary folder, named at the end; --out keeps them elsewhere).

The default preset, {DEFAULT_PRESET}, takes seconds on a CPU; the others (e.g. headline
on a GPU) are listed under --preset. --plot draws PNG plots from the results
(benchmarks/plot.py; needs matplotlib).

The suite is not in the wheel: run from a checkout (git clone, then `ratiokl bench` in it)
or point --suite / $RATIOKL_BENCHMARKS at its benchmarks/ folder."""

_ENV = "RATIOKL_BENCHMARKS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default=DEFAULT_PRESET, metavar="NAME",
                        help=f"which cases and providers (default {DEFAULT_PRESET}; an unknown "
                             "name lists the suite's presets)")
    parser.add_argument("--out", type=Path, metavar="PATH",
                        help="results JSON, CSV written beside it "
                             "(default <temporary folder>/ratiokl-bench/<preset>.json, "
                             "never the current folder)")
    parser.add_argument("--providers", metavar="LIST", help="comma list of providers to run")
    parser.add_argument("--ops", metavar="LIST", help="comma list of operations to run")
    parser.add_argument("--plot", action="store_true",
                        help="draw the plots of the results (PNG files beside the JSON)")
    parser.add_argument("--plot-only", type=Path, metavar="RESULTS",
                        help="draw the plots of an existing results JSON and run nothing")
    parser.add_argument("--suite", type=Path, metavar="DIR",
                        help=f"the benchmarks/ folder to use (default: ${_ENV}, the current "
                             "checkout, or the one ratiokl was installed from)")


def _candidates(explicit: Optional[Path]) -> List[Path]:
    if explicit is not None:
        return [explicit]
    found = [Path(os.environ[_ENV])] if os.environ.get(_ENV) else []
    cwd = Path.cwd().resolve()
    found += [folder / "benchmarks" for folder in (cwd, *cwd.parents)]
    # An editable install / a src checkout: src/ratiokl/__init__.py -> <checkout>/benchmarks
    found.append(Path(ratiokl.__file__).resolve().parents[2] / "benchmarks")
    return found


def find_suite(explicit: Optional[Path] = None) -> Optional[Path]:
    """The first benchmarks/ folder holding ``run.py`` and ``plot.py``, or ``None``."""
    for folder in _candidates(explicit):
        if (folder / "run.py").is_file() and (folder / "plot.py").is_file():
            return folder
    return None


def presets(suite: Path) -> Dict[str, object]:
    """The suite's presets by name (``_cases.PRESETS``; that module imports no framework)."""
    spec = importlib.util.spec_from_file_location("_ratiokl_bench_cases", suite / "_cases.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return dict(module.PRESETS)


def _script(suite: Path, name: str, arguments: List[str]) -> int:
    """Run ``suite/<name>`` with this Python; its output streams through."""
    print(f"ratiokl bench: {sys.executable} {suite / name} {' '.join(arguments)}", flush=True)
    return subprocess.call([sys.executable, str(suite / name), *arguments], cwd=suite.parent)


def _default_out(preset: str) -> Path:
    """Where results go without ``--out``: the temporary folder, not the current one (a
    checkout, which would then hold untracked results)."""
    return Path(tempfile.gettempdir()) / "ratiokl-bench" / f"{preset}.json"


def run(args: argparse.Namespace) -> int:
    """Run ``ratiokl bench`` with parsed ``args``; returns the exit status."""
    suite = find_suite(args.suite)
    if suite is None:
        where = args.suite or "$RATIOKL_BENCHMARKS, the current folder and its parents"
        print(f"ratiokl bench: no benchmark suite (benchmarks/run.py) found in {where}. The "
              "suite ships with ratiokl's source, not in the wheel: clone the repository and "
              "run `ratiokl bench` inside it, or pass --suite <checkout>/benchmarks",
              file=sys.stderr)
        return 2
    if args.plot_only is not None:
        return _script(suite, "plot.py", [str(args.plot_only.resolve())])
    names = presets(suite)
    if args.preset not in names:
        print(f"ratiokl bench: unknown --preset {args.preset!r}; choose from "
              f"{', '.join(sorted(names))}", file=sys.stderr)
        return 2
    out = (args.out or _default_out(args.preset)).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    arguments = ["--preset", args.preset, "--out", str(out)]
    for flag in ("providers", "ops"):
        if getattr(args, flag):
            arguments += [f"--{flag}", getattr(args, flag)]
    status = _script(suite, "run.py", arguments)
    if status == 0 and args.plot:
        status = _script(suite, "plot.py", [str(out)])
    if status == 0:
        print(f"ratiokl bench: results in {out}", flush=True)
    return status
