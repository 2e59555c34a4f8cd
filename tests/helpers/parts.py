"""``--part I/N``: the I-th of N interleaved parts of the selected tests (1-based).

For runs that outlast one call of the device tool (the GPU launch-plan sweep): every
part takes every N-th test id in sorted order, so the parts are disjoint, cover the
selection together and mix small and large shapes alike.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


def parse_part(text: str) -> Tuple[int, int]:
    """``"I/N"`` -> ``(I, N)``; raises ``ValueError`` naming the option and the fix."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise ValueError(f"--part must be I/N with 1 <= I <= N (e.g. 1/3); got {text!r}")
    return index, count


def in_part(ids: Sequence[str], index: int, count: int) -> List[bool]:
    """Whether each of ``ids`` belongs to part ``index`` of ``count``."""
    order = {name: rank for rank, name in enumerate(sorted(ids))}
    return [order[name] % count == index - 1 for name in ids]
