"""The docs' relative links resolve inside the repository, every page is in the
documentation site's navigation (``conf.py``), the README's tested version matrix
names the dependency bounds of ``ratiokl._requirements``, and the Python blocks of the
README and of the API reference pages run as printed (the trainer adapters' blocks in
their trainers' tests), the README's install lines use the venv's tools, the counts the
docs print are those the code gives (the signatures: ``test_doc_signatures.py``), and
docs/policy_loss.md's TRL column names what the TRL adapter maps."""

from __future__ import annotations

import ast
import inspect
import re
import runpy
from pathlib import Path
from typing import List

import pytest

from readme_blocks import python_blocks

from ratiokl._requirements import REQUIREMENTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "PERF.md", *sorted((ROOT / "docs").rglob("*.md")),
         ROOT / "benchmarks" / "README.md", ROOT / "conformance" / "README.md"]
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


#: The pages whose Python blocks run as printed: the README and the API reference's.
RUNNABLE = [ROOT / "README.md", *sorted((ROOT / "docs" / "reference").glob("*.md"))]
#: The module a block's imports need -> what provides it (skipped without).
_NEEDS = {"ratiokl.torch": "torch", "ratiokl.jax": "jax", "torch": "torch", "jax": "jax"}


@pytest.mark.parametrize("page, block", [(page, b) for page in RUNNABLE
                                         for b in python_blocks(page)],
                         ids=lambda x: str(x.relative_to(ROOT)) if isinstance(x, Path)
                         else str(x.line))
def test_python_block_runs_as_printed(page, block):
    """Each block is valid Python; those that need no trainer run, each on its own (a
    trainer adapter's block runs in its trainer's test: tests/adapters/)."""
    if page.parent.name == "reference":
        assert block.heading == "Example", "a reference page's code is its example"
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
    exec(compile(tree, f"{page.name}:{block.line}", "exec"), {"__name__": "docs"})


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "reference").glob("*.md")),
                         ids=lambda p: p.name)
def test_each_reference_page_has_an_example(page):
    assert [b.heading for b in python_blocks(page)] == ["Example"]


@pytest.mark.parametrize("module", ["ratiokl.torch.loss", "ratiokl.jax.loss",
                                    "ratiokl.spec.reference", "ratiokl.spec.policy_loss",
                                    "ratiokl.spec.rollout", "ratiokl._core.objective"])
def test_reference_formulas_are_math(module):
    """The formulas of the API reference's docstrings are ``.. math::`` blocks (rendered
    on the site), not ``::`` literal blocks of plain text."""
    loaded = pytest.importorskip(module)
    docs = [loaded.__doc__] + [getattr(loaded, name).__doc__ or "" for name in loaded.__all__
                               if inspect.isfunction(getattr(loaded, name))]
    literal = [line.strip() for doc in docs for line in doc.splitlines()
               if line.rstrip().endswith("::") and ".. math::" not in line]
    assert literal == []
    assert any(".. math::" in doc for doc in docs)


def test_site_keeps_a_grouped_arguments_text_once():
    """Napoleon copies a grouped entry's text ("a, b: text") to each name; the site's hook
    (conf.py) keeps it under the first name and points the others at it, and leaves
    entries with texts of their own alone."""
    conf = runpy.run_path(str(ROOT / "conf.py"))
    lines = [":param a: as in",
             "          f; shared text.",
             ":param b: as in",
             "          f; shared text.",
             ":param c: as in",
             "          f; shared text.",
             ":param d: its own text.",
             ":param e: another text.",
             "",
             ":returns: x"]
    conf["_shared_param_text_once"](None, "function", "f", None, {}, lines)
    assert lines == [":param a: as in", "          f; shared text.",
                     ":param b: see ``a``", ":param c: see ``a``",
                     ":param d: its own text.", ":param e: another text.", "",
                     ":returns: x"]


def test_sources_compile_without_syntax_warnings():
    """Docstrings with TeX (``\\log``, ``\\tanh``) are raw strings: a plain one is a
    SyntaxWarning at import (a DeprecationWarning on 3.11; an error in a future Python) and
    garbles the formula."""
    import warnings

    for path in sorted((ROOT / "src" / "ratiokl").rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)  # Python >= 3.12
            warnings.simplefilter("error", DeprecationWarning)  # 3.11
            compile(path.read_text(), str(path), "exec")


def _table_rows(page: Path, heading: str) -> List[List[str]]:
    """The cells of each body row of the first table under ``## heading`` in ``page``."""
    section = page.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_policy_loss_trl_column_names_what_the_trl_adapter_maps():
    """Each option ``ratiokl.adapters.trl`` sets from a ``GRPOConfig`` field has, in
    docs/policy_loss.md's "verl and TRL equivalents", a row whose TRL column names a field
    (not "—", which says TRL has no such thing)."""
    from types import SimpleNamespace

    from ratiokl.adapters._trl_options import loss_options

    config = SimpleNamespace(loss_type="grpo", importance_sampling_level="sequence", beta=0.04,
                             epsilon=0.2, epsilon_high=0.28, delta=4.0, entropy_coef=0.01,
                             use_adaptive_entropy=False, top_entropy_quantile=1.0,
                             use_bias_correction_kl=False)
    mapped = loss_options(config)
    rows = _table_rows(ROOT / "docs" / "policy_loss.md", "verl and TRL equivalents")
    missing = []
    for option in sorted(mapped):
        trl = [cells[2] for cells in rows if re.match(rf"`{option}\b", cells[0])]
        if trl and all(cell.startswith("—") for cell in trl):
            missing.append(option)
    assert missing == [], f"the TRL column says TRL has no {missing}, which the adapter maps"


def _flat(page: Path) -> str:
    return " ".join(page.read_text().split())


@pytest.fixture(scope="module")
def fixture_calls():
    """Every conformance case as the :class:`~ratiokl.harness.TargetCall` a target sees."""
    from ratiokl import harness

    return {name: harness.TargetCall.of(harness.load_case(name))
            for name in harness.list_cases()}


def test_check_md_trainer_case_counts_are_the_codes(fixture_calls):
    """docs/check.md's counts of the cases each trainer target runs and skips are what the
    targets' own refusals give on the fixtures (no trainer needed: ``refusal`` is the part
    of ``supports`` that reads only the case)."""
    import importlib

    text = _flat(ROOT / "docs" / "check.md")
    total = f"Of the fixtures' {len(fixture_calls)} cases,"
    assert total in text, f"docs/check.md should say: {total}"
    for trainer in ("verl", "openrlhf", "trl"):
        module = importlib.import_module(f"ratiokl.harness.targets.{trainer}")
        runs = [sum(target.refusal(call) is None for call in fixture_calls.values())
                for target in (module.TARGET, module.NAN_PADDED)]
        assert runs[0] == runs[1], trainer
        row = (f"| `{trainer}:TARGET`, `{trainer}:NAN_PADDED` | {runs[0]} | "
               f"{len(fixture_calls) - runs[0]} |")
        assert row in text, f"docs/check.md should have the row\n{row}"


def test_check_md_port_summary_counts_are_the_codes(fixture_calls):
    """The summary lines of docs/check.md's port example count the cases its ``--case``
    globs select and the port supports (that it passes them: tests/test_check_target.py)."""
    from check_user_targets import port

    from ratiokl import harness

    text = (ROOT / "docs" / "check.md").read_text()
    command = text[text.index("$ ratiokl check --target examples.check_target_port"):]
    globs = re.findall(r"--case '([^']+)'", command.split("...")[0])
    assert globs, "the example's --case globs"
    names = sorted({n for g in globs for n in harness.list_cases(g)})
    for target in (port.TorchRatioKL(), port.JaxRatioKL()):
        runs = sum(target.supports(fixture_calls[n]) is None for n in names)
        line = re.search(rf"^\s+{target.name}\s+(\d+)/(\d+)\s+passed.*\((\d+) cases x 1\)$",
                         text, re.MULTILINE)
        assert line and [int(g) for g in line.groups()] == [runs, runs, len(names)], (
            f"docs/check.md: {target.name} should read {runs}/{runs} ({len(names)} cases x 1)")


def test_install_md_tested_versions_type_no_counts():
    """The tested-versions table records what ran and that it passed, not counts of cases
    or tests, which change with every fixture and test added (the command prints them)."""
    typed = [cells[-1] for cells in _table_rows(ROOT / "docs" / "install.md",
                                                  "Tested versions")
             if re.search(r"\b\d+/\d+\b|\b\d+ (passed|cases|tests)\b", cells[-1])]
    assert typed == []


def test_readme_install_commands_use_the_venvs_tools():
    """Each README command that installs this checkout (``pip install ... -e``) runs every
    step but the venv's creation from ``.venv/bin/`` (pip, ``ratiokl``, pytest,
    ``sphinx-build``), never whatever is on the PATH."""
    text = (ROOT / "README.md").read_text()
    spans = re.findall(r"```bash\n(.*?)```", text, re.DOTALL) + re.findall(r"`([^`\n]+)`", text)
    commands = [line for span in spans for line in span.splitlines()
                if re.search(r"\bpip install\b.* -e ", line)]
    assert len(commands) >= 3, commands
    steps = [step.strip() for command in commands for step in command.split("&&")]
    bare = [s for s in steps if not s.startswith((".venv/bin/", "python3 -m venv .venv"))]
    assert bare == []


def test_api_md_lm_head_table_is_the_results_file():
    """docs/api.md's table of the lm_head's precision and speed is the one
    ``benchmarks/lm_head_precision.py --markdown`` draws from the results file it names: a
    figure there is read from a run, never typed."""
    text = (ROOT / "docs" / "api.md").read_text()
    match = re.search(r"<!-- lm_head table: (\S+) -->\n(.*?)<!-- end lm_head table -->", text,
                      re.S)
    assert match, "docs/api.md lost its lm_head table markers"
    import json

    module = runpy.run_path(str(ROOT / "benchmarks" / "lm_head_precision.py"),
                            run_name="lm_head_precision")
    result = json.loads((ROOT / match.group(1)).read_text())
    assert match.group(2).strip() == module["markdown"](result).strip(), (
        f"regenerate: python benchmarks/lm_head_precision.py --markdown {match.group(1)}")


def test_policy_loss_md_rollout_parity_table_is_the_examples_output():
    """docs/policy_loss.md's table of the head's precision against the parity fractions is
    what ``examples/rollout_parity.py`` prints: a figure there is computed, never typed."""
    text = (ROOT / "docs" / "policy_loss.md").read_text()
    match = re.search(r"<!-- rollout parity table: (\S+) -->\n(.*?)<!-- end rollout parity "
                      r"table -->", text, re.S)
    assert match, "docs/policy_loss.md lost its rollout parity table markers"
    module = runpy.run_path(str(ROOT / match.group(1)), run_name="rollout_parity")
    got = module["markdown"](module["fractions"]()).strip()
    # The labels exactly; each percentage within 0.3 points (3 of the 1024 tokens): the bf16
    # head's logits come from the CPU's bf16 GEMM, whose summation order (so a token on a
    # band's edge) may differ from one CPU to another.
    number = r"(\d+(?:\.\d+)?) %"
    assert re.sub(number, "#", match.group(2).strip()) == re.sub(number, "#", got), (
        f"regenerate: python {match.group(1)}")
    typed = [float(v) for v in re.findall(number, match.group(2))]
    computed = [float(v) for v in re.findall(number, got)]
    assert typed and max(abs(a - b) for a, b in zip(typed, computed)) <= 0.3, (
        typed, computed, f"regenerate: python {match.group(1)}")
