"""Sphinx configuration of the documentation site (how to build it: README.md, "More").

The source folder is the repository root, so every page keeps the path it has on
GitHub and the relative links between pages work unchanged in both places. Only the
pages below are read; the API reference (docs/reference/) is rendered from the public
docstrings, which are Google-style sections around reStructuredText markup (``code``,
``::`` literal blocks, :func: roles): napoleon reads the sections, Sphinx the markup.
"""

import re
import shutil
from pathlib import Path

import ratiokl

project = "ratiokl"
author = "the ratiokl authors"
release = version = ratiokl.__version__

extensions = [
    "myst_parser",          # the Markdown pages
    "sphinx.ext.autodoc",   # the API reference from the docstrings
    "sphinx.ext.napoleon",  # their Google-style Args:/Returns: sections
    "sphinx.ext.mathjax",   # math in the pages and docstrings, rendered by MathJax
    "sphinx.ext.viewcode",  # each documented object links to its highlighted source
]

root_doc = "README"
# The site's navigation, in order: (caption, pages). Appended to README.md as a hidden
# toctree when Sphinx reads it (README stays plain Markdown on GitHub); the test
# tests/test_docs.py checks that every page under docs/ is listed here.
NAV = [
    ("Guides", ["docs/install", "docs/api", "docs/policy_loss", "docs/advantages",
                "docs/trainers",
                "docs/check",
                "docs/vocab_parallel", "docs/design", "docs/performance", "PERF"]),
    ("API reference", ["docs/reference/torch", "docs/reference/jax", "docs/reference/spec",
                       "docs/reference/harness"]),
    ("Repository notes", ["benchmarks/README", "conformance/README"]),
]
include_patterns = ["README.md", "PERF.md", "docs/**.md", "benchmarks/README.md",
                    "conformance/README.md"]
exclude_patterns = ["_build", ".venv"]

source_suffix = {".md": "markdown"}
# $...$ and $$...$$ in the pages are math (MathJax).
myst_enable_extensions = ["dollarmath"]
# GitHub's heading anchors (README.md#the-api-at-a-glance) exist in the site too.
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
# The option types keep their names and link to their values (ratiokl.spec.options).
autodoc_type_aliases = {name: f"ratiokl.spec.options.{name}" for name in (
    "BackendName", "KLEstimator", "PolicyKLEstimator", "LossAgg", "RatioLevel", "Objective")}
python_use_unqualified_type_names = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" as fields of the class, not a second description of each dataclass field.
napoleon_use_ivar = True
# "Returns:" entries name the returned value first (``logp``: ...), not its type.
napoleon_use_rtype = False
maximum_signature_line_length = 88
# Indented blocks, in the docstrings (::) and in the guides, hold formulas, not code.
highlight_language = "none"

html_theme = "furo"
html_title = f"ratiokl {release}"
html_copy_source = False
html_show_copyright = False


def _toctrees(app, docname, source):
    if docname == root_doc:
        source[0] += "".join(
            f"\n\n```{{toctree}}\n:hidden:\n:caption: {caption}\n\n" + "\n".join(pages) + "\n```\n"
            for caption, pages in NAV)


def _index_html(app, exception):
    # README.html is the home page; a copy as index.html serves the site's root URL
    # (same folder, so its relative links hold).
    if exception is None and app.builder.format == "html":
        out = Path(app.outdir)
        shutil.copyfile(out / f"{root_doc}.html", out / "index.html")


# Napoleon reads the first line of a module constant's doc comment as "type: text";
# ratiokl's doc comments are sentences (the type is the annotation), so a constant's
# text is kept as written: saved before napoleon (priority 500) runs, put back after.
_data_docs = {}


def _save_data_doc(app, what, name, obj, options, lines):
    if what == "data":
        _data_docs[name] = list(lines)


def _restore_data_doc(app, what, name, obj, options, lines):
    if what == "data" and name in _data_docs:
        lines[:] = _data_docs.pop(name)


# A grouped Args entry ("policy_logits, ref_logits, ...: as in ratio_kl ...") reads once in
# help(); napoleon gives each name its own copy of the text. The site keeps the text under
# the group's first name and points the others at it.
_PARAM = re.compile(r":param (\S+): ?(.*)")


def _param_entries(lines):
    """``[start, end)`` line spans of napoleon's ``:param NAME: text`` entries (the text's
    continuation lines are indented)."""
    spans, i = [], 0
    while i < len(lines):
        if _PARAM.match(lines[i]):
            end = i + 1
            while end < len(lines) and lines[end].startswith(" ") and lines[end].strip():
                end += 1
            spans.append((i, end))
            i = end
        else:
            i += 1
    return spans


def _shared_param_text_once(app, what, name, obj, options, lines):
    """Each entry of a run whose text equals the run's first entry's: ``see ``first````."""
    spans, shared = _param_entries(lines), {}
    first = first_text = previous_end = None
    for start, end in spans:
        match = _PARAM.match(lines[start])
        text = " ".join([match.group(2)] + [line.strip() for line in lines[start + 1:end]])
        if start == previous_end and text == first_text:
            shared[start] = (end, f":param {match.group(1)}: see ``{first}``")
        else:
            first, first_text = match.group(1), text
        previous_end = end
    for start in sorted(shared, reverse=True):
        end, line = shared[start]
        lines[start:end] = [line]


def setup(app):
    app.connect("source-read", _toctrees)
    app.connect("build-finished", _index_html)
    app.connect("autodoc-process-docstring", _save_data_doc, priority=400)
    app.connect("autodoc-process-docstring", _restore_data_doc, priority=600)
    app.connect("autodoc-process-docstring", _shared_param_text_once, priority=600)
