"""The docs' relative links resolve inside the repository, and the README's tested
version matrix names the dependency bounds of ``ratiokl._requirements``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ratiokl._requirements import REQUIREMENTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "PERF.md", *sorted((ROOT / "docs").glob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "conformance" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [target for target in LINK.findall(page.read_text())
               if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()]
    assert missing == []


def test_markdown_files_the_readme_names_exist():
    named = set(re.findall(r"\b([\w/.-]+\.md)\b", (ROOT / "README.md").read_text()))
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []


def test_readme_states_each_lower_bound():
    text = (ROOT / "README.md").read_text()
    for requirement in REQUIREMENTS.values():
        assert f"`{requirement.specifier}`" in text, requirement.specifier
