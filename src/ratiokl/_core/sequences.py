"""The sequences of ``loss_agg`` on ``[R, T]`` rows, and sums over them (framework-neutral).

A sequence is a row's active tokens, or with ``segment_ids`` a run of them: a sequence
starts at an active token that is the first active one of its row or whose segment id
differs from the previous active token's (``ratiokl.spec.sequence_index``). Inactive
tokens join the sequence before them; their ids are never compared. Everything here is
deterministic and free of scatters (a doubling scan and gathers), so it traces under
``jax.jit`` and ``torch.compile`` alike. ``xp`` is the framework's array adapter
(:mod:`ratiokl._core`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Tuple

__all__ = ["Segments", "as_rows", "log_weights", "segment_totals", "segments",
           "sequence_totals"]


def as_rows(x, lead: Tuple[int, ...]):
    """A per-token array of leading shape ``[..., T]`` (or ``[N]``) viewed as ``[R, T]``."""
    if not lead:
        return x.reshape(1, 1)
    return x.reshape(math.prod(lead[:-1]), lead[-1])  # explicit R: T may be 0


class Segments(NamedTuple):
    """Per token ``[R, T]``: its sequence's first and last position, and the starts."""

    first: Any  # index [R, T]
    last: Any  # index [R, T]
    starts: Any  # bool [R, T]: the token starts a sequence


def segments(xp, mask, segment_ids: Optional[Any]) -> Segments:
    """The sequences of bool ``mask [R, T]`` (and integer ``segment_ids [R, T]`` or None)."""
    width = mask.shape[-1]
    if width == 0:
        empty = xp.as_index(xp.zeros_like(mask))
        return Segments(empty, empty, mask)
    pos = xp.positions(mask)
    seg = xp.zeros_like(pos) if segment_ids is None else xp.as_index(segment_ids)
    last_active = xp.cummax(xp.where(mask, pos, -1))
    prev_active = xp.shift(last_active, 1, -1)
    prev_seg = xp.take(seg, xp.maximum(prev_active, 0))
    starts = mask & ((prev_active < 0) | (seg != prev_seg))
    first = xp.cummax(xp.where(starts, pos, 0))
    next_start = xp.reverse_cummin(xp.where(starts, pos, width))
    return Segments(first, xp.shift(next_start, -1, width) - 1, starts)


def segment_totals(xp, x, seq: Segments):
    """Per token, the sum of ``x [R, T]`` over its sequence: a segmented scan (doubling
    steps, Hillis-Steele), then a gather at the sequence's last position."""
    width = x.shape[-1]
    pos = xp.positions(x)
    acc, step = x, 1
    while step < width:
        acc = xp.where(pos - step >= seq.first, acc + xp.shift(acc, step, 0.0), acc)
        step *= 2
    return xp.take(acc, seq.last)


def sequence_totals(xp, x, mask, segment_ids: Optional[Any]):
    """Per token, the sum of ``x [R, T]`` over its sequence; ``x`` must hold 0 on inactive
    tokens (they join the sequence before them)."""
    return segment_totals(xp, x, segments(xp, mask, segment_ids))


def log_weights(xp, mask, old, rollout, segment_ids: Optional[Any], sequence: bool,
                mean: bool) -> Tuple[Any, Optional[Any]]:
    """The rollout correction's log-weights (``ratiokl.spec.rollout``) of bool ``mask [R,
    T]``: per token ``lw = old - rollout``, both selected first (0 on inactive tokens), and
    with ``sequence`` its sum (``mean``: its mean) over each token's sequence, ``[R, 1]``
    (one sequence a row) or, with ``segment_ids``, ``[R, T]``; else None."""
    lw = xp.where(mask, old, 0.0) - xp.where(mask, rollout, 0.0)
    if not sequence:
        return lw, None
    count = xp.as_float(mask)
    if segment_ids is None:
        total, count = xp.sum(lw, axis=-1, keepdims=True), xp.sum(count, axis=-1, keepdims=True)
    else:
        total = sequence_totals(xp, lw, mask, segment_ids)
        count = sequence_totals(xp, count, mask, segment_ids) if mean else count
    return lw, total / xp.maximum(count, 1.0) if mean else total
