"""The kernel package ``ratiokl._kernels`` imports only Triton, NumPy (its interpreter twins),
the standard library and the option codes (``ratiokl._codes``, which imports nothing else):
both frameworks launch its kernels, so it knows neither of them nor the host-side spec."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import ratiokl._kernels

ALLOWED = {"triton", "numpy", "ratiokl"}
#: The one module outside the package it may import: the option codes' definition.
CODES = "ratiokl._codes"


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module


def test_the_kernel_package_imports_only_triton():
    package = Path(ratiokl._kernels.__file__).parent
    found = {}
    for path in sorted(package.glob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            inside = name in ("ratiokl._kernels", CODES) or name.startswith("ratiokl._kernels.")
            if top == "ratiokl" and not inside or (
                    top not in ALLOWED and top not in sys.stdlib_module_names):
                found.setdefault(path.name, []).append(name)
    assert found == {}
