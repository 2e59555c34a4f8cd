"""The README's Python code blocks, each with the heading it stands under.

``tests/test_docs.py`` compiles every block and runs those the main test environment can
run; each trainer adapter's test runs its own block, in its trainer's environment.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List, NamedTuple

README = Path(__file__).resolve().parents[2] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)


class Block(NamedTuple):
    heading: str  # the last "## " heading above the block
    line: int  # the README line of the block's first line of code
    code: str


def python_blocks(path: Path = README) -> List[Block]:
    """Every fenced ``python`` block of ``path``, in order."""
    text = path.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        before = text[:match.start()]
        headings = re.findall(r"^## (.+)$", before, re.MULTILINE)
        blocks.append(Block(headings[-1] if headings else "", before.count("\n") + 2,
                            match.group(1)))
    return blocks


def block_importing(module: str, path: Path = README) -> Block:
    """The one block of ``path`` that imports ``module`` (``from module import`` or
    ``import module``)."""
    found = [b for b in python_blocks(path)
             if re.search(rf"^\s*(from|import) {re.escape(module)}\b", b.code, re.MULTILINE)]
    assert len(found) == 1, f"{len(found)} README blocks import {module}"
    return found[0]
