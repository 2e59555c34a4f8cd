"""The public functions' docstrings: written once (``ratiokl._docs``), complete in both
frameworks, and the same text in both but for the named per-framework pieces."""

from __future__ import annotations

import inspect
import re
from string import Template

import pytest

from ratiokl import _docs

FRAMEWORKS = ("torch", "jax")
NAMES = sorted(_docs.TEMPLATES)
ENTRY = re.compile(r"^  ([a-z_][a-z0-9_]*(?:(?:, | \.\.\. )[a-z_][a-z0-9_]*)*):(?: |$)")


def public(framework: str, name: str):
    return getattr(pytest.importorskip(f"ratiokl.{framework}.loss"), name)


def args_entries(doc: str):
    """The names each entry of the ``Args:`` section documents (``a ... b``: a to b)."""
    lines = doc.splitlines()
    start = lines.index("Args:") + 1
    end = next(i for i in range(start, len(lines)) if lines[i] and not lines[i][0].isspace())
    return [m.group(1) for line in lines[start:end] if (m := ENTRY.match(line))]


def named_parameters(entries, parameters):
    named = []
    for entry in entries:
        for part in entry.split(", "):
            if " ... " in part:
                first, last = part.split(" ... ")
                named += parameters[parameters.index(first):parameters.index(last) + 1]
            else:
                named.append(part)
    return named


def test_every_public_function_has_a_template():
    for framework in FRAMEWORKS:
        module = pytest.importorskip(f"ratiokl.{framework}.loss")
        assert sorted(module.__all__) == NAMES


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", NAMES)
def test_docstring_names_each_parameter_once_and_states_shapes(framework, name):
    function = public(framework, name)
    doc = inspect.getdoc(function)
    parameters = list(inspect.signature(function).parameters)
    named = named_parameters(args_entries(doc), parameters)
    assert sorted(named) == sorted(parameters), (
        f"{framework}.{name}: undocumented {sorted(set(parameters) - set(named))}, "
        f"not parameters {sorted(set(named) - set(parameters))}, "
        f"twice {sorted({p for p in named if named.count(p) > 1})}")
    assert "``[...]``" in doc and "Returns:" in doc


@pytest.mark.parametrize("name", NAMES)
def test_frameworks_share_the_text_but_their_pieces(name):
    """Each function's ``__doc__`` is its template with only the pieces filled in: the
    text between the placeholders is the same in both frameworks, whatever wrote it."""
    template, _ = _docs.TEMPLATES[name]
    parts = re.split(r"\$\{?([a-z_]+)\}?", template)
    pattern = "".join(re.escape(part) if i % 2 == 0
                      else f"(?P={part})" if part in parts[1:i:2] else f"(?P<{part}>.*?)"
                      for i, part in enumerate(parts))
    for framework in FRAMEWORKS:
        doc = public(framework, name).__doc__
        match = re.fullmatch(pattern, doc, flags=re.DOTALL)
        assert match, f"{framework}.{name}.__doc__ is not its template's text ({framework})"
        assert doc == _docs.render(name, framework)


@pytest.mark.parametrize("module", [_docs.logprobs, _docs.policy, _docs.linear],
                         ids=lambda m: m.__name__)
def test_pieces_are_used_and_differ(module):
    """Every piece fills a placeholder, and differs between the frameworks (text that is
    the same in both belongs in the template)."""
    used = {identifier for text in module.TEXT.values()
            for identifier in Template(text).get_identifiers()}
    torch_pieces, jax_pieces = module.PIECES["torch"], module.PIECES["jax"]
    assert set(torch_pieces) == set(jax_pieces) == used - set(_docs.COMMON["torch"])
    assert [key for key in torch_pieces if torch_pieces[key] == jax_pieces[key]] == []
