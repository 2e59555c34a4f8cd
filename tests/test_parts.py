"""``--part I/N`` (``tests/helpers/parts.py``): disjoint parts that cover the selection."""

from __future__ import annotations

import pytest
from parts import in_part, parse_part


def test_parts_are_disjoint_and_cover_every_id() -> None:
    ids = [f"test_sweep[{d}-{v}]" for d in ("bf16", "fp32") for v in (1, 33, 4097, 151936)]
    parts = [in_part(ids, i, 3) for i in (1, 2, 3)]
    assert [sum(flags) for flags in zip(*parts)] == [1] * len(ids)
    assert sorted(sum(p) for p in parts) == [2, 3, 3]


def test_a_malformed_part_names_the_option() -> None:
    assert parse_part("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ValueError, match="--part must be I/N"):
            parse_part(bad)
