"""The launch plans the heuristics can choose, by name, and the shapes at their boundaries
(test support: not installed; ``ratiokl check`` and the conformance package never use it).

A launch plan is a branch: a kernel's code takes a different path (a row
in one program or shared at a meeting, a split forward with a combine, a
ragged tail tile, spans of one tile or of many) depending on the shape. A
plan that no test runs is untested code, so the tests enumerate them from
here:

* :func:`plans` names the plans every kernel launch takes for ``n_rows``
  rows of ``vocab`` logits of ``itemsize`` bytes, read from the very plan objects
  the bindings launch (``heuristics.forward_plan``, ``heuristics.backward_plan``,
  ``heuristics.launch_plan``) -- the GPU's plan, which
  Triton's interpreter now runs too (``meeting.stand_in_meeting``);
* :func:`sweep_vocabularies` and :func:`sweep_rows` scan the heuristics for
  every size where a tile width, warp count, split count or plan changes and
  return the sizes on both sides of it, so a changed heuristic moves the GPU
  sweep (``tests/gpu/test_launch_plan_sweep.py``) with it.

Imports only the heuristics and the fused kernel's plan (and so ``triton``).
"""

from __future__ import annotations

import functools
from typing import FrozenSet, Tuple

from ratiokl._kernels import heuristics
from ratiokl._kernels.heuristics import launch_plan

__all__ = ["Plan", "plans", "sweep_rows", "sweep_vocabularies"]

#: ``(kernel, choice, ...)``: e.g. ``("fused", "grad", "meeting", "whole+tail", "spans-of-many")``.
Plan = Tuple[str, ...]

#: Largest vocabulary the sweep scans (Gemma's 262,144), and sizes users have.
_MAX_VOCAB = 262_144
_REAL_VOCABULARIES = (50_257, 151_936, 262_144)
#: Row counts the sweep always has besides the boundaries (one row, a few, many).
_REAL_ROWS = (1, 7, 127, 128, 4096)
_MAX_ROWS = 8192


def _tiles(vocab: int, block: int) -> str:
    full, tail = divmod(vocab, block)
    return "tail-only" if full == 0 else ("whole" if tail == 0 else "whole+tail")


def _spans(spans: heuristics.SplitPlan) -> str:
    if spans.splits == 1:
        return "one-span"
    return "spans-of-1" if spans.tiles_per_split == 1 else "spans-of-many"


@functools.lru_cache(maxsize=None)
def plans(n_rows: int, vocab: int, itemsize: int) -> FrozenSet[Plan]:
    """The plans of every kernel the public ops launch at ``[n_rows, vocab]`` (``n_rows >= 1``).

    ``forward``: the log-prob forward (one program a row, or split + combine);
    ``backward``: its gradient (one program a row, or a row's tiles split);
    ``fused``: the one-kernel policy loss with and without its gradient.
    """
    fwd = heuristics.forward_plan(n_rows, vocab, itemsize)
    found = {("forward", "split" if fwd.split else "row", _tiles(vocab, fwd.config.block_v),
              _spans(fwd.spans))}
    bwd = heuristics.backward_plan(n_rows, vocab, itemsize)
    found.add(("backward", "split" if bwd.programs_per_row > 1 else "row",
               _tiles(vocab, bwd.config.block_v)))
    for write_grad in (True, False):
        plan = launch_plan(vocab, itemsize, n_rows, write_grad)
        found.add(("fused", "grad" if write_grad else "no-grad",
                   "meeting" if plan.row_programs > 1 else "row",
                   _tiles(vocab, plan.config.block_v), _spans(plan.spans)))
    return frozenset(found)


def _geometry(vocab: int, itemsize: int) -> Tuple:
    """Everything the launch heuristics decide from ``vocab`` alone."""
    fwd = heuristics.forward_plan(1, vocab, itemsize)
    fused = launch_plan(vocab, itemsize, 1, True).spans
    bwd = heuristics.backward_plan(1, vocab, itemsize)
    return (fwd.config, fwd.spans.splits, fwd.spans.tiles_per_split > 1, fused.splits,
            fused.tiles_per_split > 1, bwd.config)


@functools.lru_cache(maxsize=None)
def sweep_vocabularies(itemsize: int) -> Tuple[int, ...]:
    """Vocabulary sizes on both sides of every change of the launch geometry, sorted.

    Scans ``V = 1 .. 262144``: wherever a tile width, a warp count, a split
    count or whether spans hold one tile or several changes between ``V - 1``
    and ``V``, keeps ``V - 2, V - 1, V`` (a tile width ``B`` changes at
    ``B + 1``: ``B - 1, B, B + 1``; a tile count at ``k B + 1``: a ragged
    tail, whole tiles, a tail of one column), plus 1, 2 and real vocabularies.
    """
    sizes = {1, 2, *_REAL_VOCABULARIES}
    before = _geometry(1, itemsize)
    for vocab in range(2, _MAX_VOCAB + 1):
        now = _geometry(vocab, itemsize)
        if now != before:
            sizes.update((vocab - 2, vocab - 1, vocab))
        before = now
    return tuple(sorted(sizes))


@functools.lru_cache(maxsize=None)
def sweep_rows(itemsize: int) -> Tuple[int, ...]:
    """Row counts on both sides of every row threshold of the plans, sorted.

    Scans ``N = 1 .. 8192`` at the largest sweep vocabulary (where every
    row-dependent choice is open) for a change of :func:`plans`.
    """
    vocab = _MAX_VOCAB
    sizes = set(_REAL_ROWS)
    for n_rows in range(2, _MAX_ROWS + 1):
        if plans(n_rows, vocab, itemsize) != plans(n_rows - 1, vocab, itemsize):
            sizes.update((n_rows - 1, n_rows, n_rows + 1))
    return tuple(sorted(sizes))
