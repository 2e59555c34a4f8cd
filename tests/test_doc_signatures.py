"""The signatures the README and docs/ print are the functions' own.

Each is compared with ``inspect.signature`` at test time, so a keyword added to (or a
default changed in) a public function fails here with the call to print instead. A
signature display is a ``loss.<name>(...)`` whose arguments hold the keyword-only marker
``*``; one that holds ``...`` shows a few keywords, which must still be the function's, in
its order, at its defaults. Displays are PyTorch's signature (``vocab_group``); JAX's is the
same with ``vocab_axis`` in its place. The README's "The API at a glance" block is runnable
code: its first call of each function passes the required arguments by position and every
other one by keyword, at its default, unless its comment says a few are shown.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any, Iterator, List, NamedTuple, Optional, Tuple

import pytest

from readme_blocks import python_blocks

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FUNCTIONS = ("ratio_kl", "policy_loss", "selected_logprobs", "policy_objective",
             "linear_selected_logprobs", "linear_policy_loss")
#: The README block's functions whose first call shows only a few keywords (its comments
#: say so, and say which keywords they take: see ``test_readme_partial_calls_say_which``).
README_PARTIAL = ("policy_objective", "linear_policy_loss")
_CALL = re.compile(r"\bloss\.(\w+)\(")

torch_loss = pytest.importorskip("ratiokl.torch.loss")


class Param(NamedTuple):
    name: str
    keyword_only: bool
    default: Any  # inspect.Parameter.empty when required


def _params(function: Any, framework_keyword: str = "vocab_group") -> List[Param]:
    out = []
    for p in inspect.signature(function).parameters.values():
        name = "vocab_group" if p.name == framework_keyword else p.name
        out.append(Param(name, p.kind is p.KEYWORD_ONLY, p.default))
    return out


def _fmt(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def expected_call(name: str, display: bool = True) -> str:
    """The call to print for ``loss.<name>``: the required arguments by position, then
    every other at its default (after ``*`` where the signature has it, when ``display``),
    wrapped at 90 columns."""
    items, marked = [], False
    for p in _params(getattr(torch_loss, name)):
        if p.keyword_only and not marked and display:
            items.append("*")
            marked = True
        items.append(p.name if p.default is inspect.Parameter.empty
                     else f"{p.name}={_fmt(p.default)}")
    lines, line = [], f"loss.{name}("
    for item in items:
        if len(line) + len(item) + 2 > 90:
            lines.append(line.rstrip())
            line = "    "
        line += item + ", "
    return "\n".join(lines + [line[:-2] + ")"])


def _arguments(text: str, start: int) -> str:
    """The text between the ``(`` before ``start`` and its matching ``)``."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError(f"unclosed call at {start}")


class Display(NamedTuple):
    page: str
    line: int
    name: str
    params: List[Param]
    partial: bool  # holds "...": a few keywords shown


def displays() -> Iterator[Display]:
    """Every signature display of the pages (a ``loss.<name>(...)`` holding ``*``)."""
    for page in PAGES:
        text = page.read_text()
        for match in _CALL.finditer(text):
            args = " ".join(_arguments(text, match.end()).replace("`", "").split())
            items = [item.strip() for item in args.split(",")]
            if "*" not in items:
                continue
            partial = "..." in items
            tree = ast.parse(f"def f({args.replace('...,', '').replace(', ...', '')}): pass")
            a = tree.body[0].args
            pos = [Param(x.arg, False, inspect.Parameter.empty) for x in a.args]
            for param, default in zip(reversed(pos), reversed(a.defaults)):
                pos[pos.index(param)] = param._replace(default=ast.literal_eval(default))
            kw = [Param(x.arg, True, ast.literal_eval(d)) for x, d in
                  zip(a.kwonlyargs, a.kw_defaults)]
            yield Display(str(page.relative_to(ROOT)), text[:match.start()].count("\n") + 1,
                          match.group(1), pos + kw, partial)


DISPLAYS = list(displays())


def test_the_known_displays_are_found():
    """The scan finds at least the displays the pages had when this test was written."""
    found = {(d.page, d.name) for d in DISPLAYS}
    assert {("docs/policy_loss.md", "policy_loss"), ("docs/policy_loss.md", "policy_objective"),
            ("docs/api.md", "linear_selected_logprobs"), ("docs/api.md", "policy_objective"),
            ("docs/api.md", "linear_policy_loss")} <= found


def _is_subsequence(shown: List[Param], full: List[Param]) -> bool:
    it = iter(full)
    return all(any(p == q for q in it) for p in shown)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("display", DISPLAYS, ids=lambda d: f"{d.page}:{d.line}:{d.name}")
def test_signature_display_is_the_signature(display, framework):
    module = torch_loss if framework == "torch" else pytest.importorskip("ratiokl.jax.loss")
    full = _params(getattr(module, display.name),
                   "vocab_group" if framework == "torch" else "vocab_axis")
    where = f"{display.page}:{display.line}"
    if display.partial:
        assert _is_subsequence(display.params, full), (
            f"{where} shows keywords that are not loss.{display.name}'s, in its order, at "
            f"its defaults; the whole signature:\n{expected_call(display.name)}")
    else:
        assert display.params == full, (
            f"{where} is not the signature of {framework}'s loss.{display.name}; print:\n"
            f"{expected_call(display.name)}")


def _first_calls() -> List[Tuple[str, ast.Call]]:
    (block,) = [b for b in python_blocks() if b.heading == "The API at a glance"]
    calls, seen = [], set()
    for node in ast.walk(ast.parse(block.code)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "loss"
                and node.func.attr not in seen):
            seen.add(node.func.attr)
            calls.append((node.func.attr, node))
    return sorted(calls, key=lambda c: (c[1].lineno, c[1].col_offset))


@pytest.mark.parametrize("name, call", [pytest.param(*c, id=c[0]) for c in _first_calls()])
def test_readme_api_at_a_glance_call_is_the_signature(name, call):
    full = _params(getattr(torch_loss, name))
    required = [p for p in full if p.default is inspect.Parameter.empty]
    shown = [Param(k.arg, True, ast.literal_eval(k.value)) for k in call.keywords]
    with_defaults = [p._replace(keyword_only=True) for p in full
                     if p.default is not inspect.Parameter.empty]
    message = (f"README, The API at a glance: the first loss.{name} call is not its "
               f"signature; print:\n{expected_call(name, display=False)}")
    assert len(call.args) == len(required), message
    if name in README_PARTIAL:
        assert _is_subsequence(shown, with_defaults), message
    else:
        assert shown == with_defaults, message


def test_readme_api_at_a_glance_calls_every_function():
    assert sorted(name for name, _ in _first_calls()) == sorted(FUNCTIONS)


def _keywords(name: str, framework_keyword: str = "vocab_group") -> List[str]:
    return [p.name for p in _params(getattr(torch_loss, name), framework_keyword)
            if p.default is not inspect.Parameter.empty]


def test_readme_partial_calls_say_which():
    """The README's comments above the two partial calls say which keywords they take:
    ``policy_objective`` "policy_loss's keywords but temperature, backend and the
    logits'" (plus ``entropy``), ``linear_policy_loss`` "policy_loss's keywords but
    ratio_level and inplace_grad" (plus the head's)."""
    (block,) = [b for b in python_blocks() if b.heading == "The API at a glance"]
    comments = " ".join(line.strip().lstrip("#").strip() for line in block.code.splitlines()
                        if line.strip().startswith("#"))
    assert "policy_loss's keywords but temperature, backend and the logits'" in comments
    assert "linear_policy_loss takes policy_loss's keywords" in comments
    assert "but ratio_level and inplace_grad" in comments
    logits_only = {"temperature", "backend", "check_ids", "vocab_group", "inplace_grad"}
    policy = _keywords("policy_loss")
    assert [k for k in policy if k not in logits_only] == \
        [k for k in _keywords("policy_objective") if k not in ("entropy", "mask")]
    head = {"bias", "logit_scale", "logit_softcap", "logits_dtype", "fp32_matmul",
            "grad_weight_accum", "chunk_rows"}
    assert [k for k in policy if k not in {"ratio_level", "inplace_grad"}] == \
        [k for k in _keywords("linear_policy_loss") if k not in head]


def test_expected_call_is_valid_python():
    """What the failure messages print parses (a display, with ``*``, as a ``def``)."""
    for name in FUNCTIONS:
        ast.parse(expected_call(name, display=False))
        text = expected_call(name)
        ast.parse(f"def f({text[text.index('(') + 1:-1]}): pass")


@pytest.mark.parametrize("name", FUNCTIONS)
def test_jax_calls_are_the_same_with_vocab_axis(name):
    """What the README's block and the displays claim for JAX: the same parameters, order
    and defaults, with ``vocab_axis`` for ``vocab_group``."""
    jax_loss = pytest.importorskip("ratiokl.jax.loss")
    assert _params(getattr(jax_loss, name), "vocab_axis") == _params(getattr(torch_loss, name))
