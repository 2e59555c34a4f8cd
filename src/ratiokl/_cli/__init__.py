"""The ``ratiokl`` command line (also ``python -m ratiokl``).

    ratiokl --version              ratiokl's version and the installed dependencies
    ratiokl check [...]            the conformance fixtures on every target that runs here
    ratiokl bench [...] [--plot]   the benchmark suite of a source checkout, and its plots

Each subcommand lives in its own module (``_check``, ``_bench``) and adds its
own arguments; ``ratiokl <command> --help`` lists them.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Optional, Sequence

import ratiokl
from ratiokl._cli import _bench, _check
from ratiokl._requirements import REQUIREMENTS, installed_version

__all__ = ["main", "parser", "version_text"]

_COMMANDS = {"check": _check, "bench": _bench}


def version_text() -> str:
    """``ratiokl X.Y.Z`` and, one per line, Python and each dependency's installed version."""
    lines = [f"ratiokl {ratiokl.__version__}", f"  Python {platform.python_version()}"]
    for name in ("numpy", "tqdm", *REQUIREMENTS):
        lines.append(f"  {name} {installed_version(name) or '(not installed)'}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The ``ratiokl`` parser, with one subparser per command."""
    top = argparse.ArgumentParser(
        prog="ratiokl",
        description="Fused PPO/GRPO ratio, KL and policy loss for PyTorch and JAX: "
                    "conformance checks and benchmarks.",
        epilog="Run `ratiokl <command> --help` for a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps --version's lines
    )
    top.add_argument("--version", action="version", version=version_text())
    commands = top.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, module in _COMMANDS.items():
        sub = commands.add_parser(name, help=module.SUMMARY, description=module.DESCRIPTION,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ratiokl`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # a bare `ratiokl`: the full help, not only the missing-command error
        parser().print_help(sys.stderr)
        return 2
    try:
        args = parser().parse_args(argv)
    except SystemExit as stop:  # --help, --version (0) and usage errors (2)
        return int(stop.code or 0)
    return args.run(args)
