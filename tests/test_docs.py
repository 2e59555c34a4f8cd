"""The docs' relative links resolve inside the repository, every page is in the
documentation site's navigation (``conf.py``), the README's tested version matrix
names the dependency bounds of ``ratiokl._requirements``, and the README's Python blocks
run as printed (the trainer adapters' blocks in their trainers' tests)."""

from __future__ import annotations

import ast
import inspect
import re
import runpy
from pathlib import Path

import pytest

from readme_blocks import python_blocks

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


BLOCKS = python_blocks()
#: The module each README block's imports need -> what provides it (skipped without).
_NEEDS = {"ratiokl.torch": "torch", "ratiokl.jax": "jax", "torch": "torch", "jax": "jax"}


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: f"README.md:{b.line}")
def test_readme_python_block_runs_as_printed(block):
    """Each block is valid Python; those that need no trainer run, each on its own (a
    trainer adapter's block runs in its trainer's test: tests/adapters/)."""
    tree = ast.parse(block.code)
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    adapters = sorted(m for m in imported if m.startswith("ratiokl.adapters"))
    assert len(adapters) <= 1, f"one block imports two trainers' adapters: {adapters}"
    if adapters:
        pytest.skip(f"runs in {adapters[0]}'s own test (tests/adapters/)")
    for module in imported:
        if module in _NEEDS:
            pytest.importorskip(_NEEDS[module])
    exec(compile(tree, f"README.md:{block.line}", "exec"), {"__name__": "readme"})


def test_readme_api_at_a_glance_shows_the_defaults():
    """In "The API at a glance", each function's first call passes every keyword at its
    default (the PyTorch signature; JAX's takes the same)."""
    torch_loss = pytest.importorskip("ratiokl.torch.loss")
    (block,) = [b for b in BLOCKS if b.heading == "The API at a glance"]
    seen = set()
    for node in ast.walk(ast.parse(block.code)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "loss"):
            continue
        name = node.func.attr
        if name in seen:
            continue
        seen.add(name)
        params = inspect.signature(getattr(torch_loss, name)).parameters
        for keyword in node.keywords:
            assert ast.literal_eval(keyword.value) == params[keyword.arg].default, \
                (name, keyword.arg)
    assert seen == {"ratio_kl", "policy_loss", "selected_logprobs", "linear_policy_loss"}
