"""The docs' relative links resolve inside the repository, every page is in the
documentation site's navigation (``conf.py``), and the README's tested version matrix
names the dependency bounds of ``ratiokl._requirements``."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from ratiokl._requirements import REQUIREMENTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "PERF.md", *sorted((ROOT / "docs").rglob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "fixtures" / "README.md"]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [target for target in LINK.findall(page.read_text())
               if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()]
    assert missing == []


def test_every_page_is_in_the_site_navigation():
    """The site (``conf.py``: the README as home page, then ``NAV``) has every page above,
    so none is built without a way to reach it, and nothing else."""
    conf = runpy.run_path(str(ROOT / "conf.py"))
    nav = [page for _, pages in conf["NAV"] for page in pages]
    assert len(nav) == len(set(nav)), nav
    site = {conf["root_doc"], *nav}
    pages = {str(page.relative_to(ROOT).with_suffix("")) for page in PAGES}
    assert sorted(pages - site) == [], "pages missing from conf.py's NAV"
    assert sorted(site - pages) == [], "NAV entries that are no page"


def test_markdown_files_the_readme_names_exist():
    named = set(re.findall(r"\b([\w/.-]+\.md)\b", (ROOT / "README.md").read_text()))
    assert [n for n in sorted(named) if not (ROOT / n).exists()] == []


def test_readme_states_each_lower_bound():
    text = (ROOT / "README.md").read_text()
    for requirement in REQUIREMENTS.values():
        assert f"`{requirement.specifier}`" in text, requirement.specifier
