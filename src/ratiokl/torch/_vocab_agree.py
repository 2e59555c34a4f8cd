"""The ranks' agreement on a vocabulary-parallel call (``vocab_group``, ``check_ids=True``).

A rank whose shapes differ from the others' would enter all-reduces of another length,
which NCCL does not detect (the ranks hang until its watchdog's timeout) and gloo reports
as a mismatch on one rank only. So before any other collective every rank writes its
call's shapes as one row of integers (:func:`signature`) into a ``[world, 10]`` table,
one SUM all-reduce gathers the table, and a host read of it (together with the active-id
flag against the global ``V``) decides the same outcome on every rank: go on, or the
same ``ValueError`` naming the ranks and their shapes (:func:`agree`).

A row: ``[kind, V_r, H, dtype, N, len(lead), lead dims...]``. ``kind`` says what the
rank passed (:data:`LOGITS`, :data:`LOGITS_REF`: logits ``[..., V_r]`` without / with
reference logits; :data:`HIDDEN`, :data:`HIDDEN_BIAS`: hidden states ``[..., H]`` and a
weight ``[V_r, H]`` without / with a bias ``[V_r]``); ``H`` and the hidden states' dtype
(the linear ops all-reduce ``d hidden`` ``[N, H]`` in it) are 0 for logits. Only ``V_r``,
the rank's vocabulary block, may differ between ranks.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ratiokl._core.rows import bad_ids
from ratiokl.spec import vocab_blocks
from ratiokl.torch import _checks

__all__ = ["HIDDEN", "HIDDEN_BIAS", "LOGITS", "LOGITS_REF", "agree", "signature"]

#: What a rank passed (a row's first entry).
LOGITS, LOGITS_REF, HIDDEN, HIDDEN_BIAS = 1, 2, 3, 4
#: Leading dimensions compared one by one (``N`` covers the rest).
_LEAD_DIMS = 4
#: A row's dtype entry: 1 + the index here (0: not compared).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def signature(lead: Tuple[int, ...], kind: int, local_vocab: int, width: int = 0,
              dtype: Optional[torch.dtype] = None) -> List[int]:
    """This rank's call as integers: ``[kind, V_r, H, dtype, N, len(lead), lead dims...]``,
    the dims zero-padded (``width``, ``dtype``: the hidden states', for the linear ops)."""
    dims = list(lead[:_LEAD_DIMS])
    code = 0 if dtype is None else 1 + _DTYPES.index(dtype)
    return [kind, local_vocab, width, code, math.prod(lead), len(lead), *dims,
            *[0] * (_LEAD_DIMS - len(dims))]


def _describe(row: Sequence[int]) -> str:
    """One rank's :func:`signature` as the shapes the caller passed."""
    kind, local_vocab, width, code, n_rows, ndim, *dims = row
    lead = [str(d) for d in dims[:ndim]] + (["..."] if ndim > _LEAD_DIMS else [])
    if kind in (LOGITS, LOGITS_REF):
        text = f"logits [{', '.join(lead + [str(local_vocab)])}] ({n_rows} rows)"
        return text + (" and ref_logits" if kind == LOGITS_REF else ", no ref_logits")
    dtype = str(_DTYPES[code - 1]).replace("torch.", "")
    text = (f"hidden [{', '.join(lead + [str(width)])}] {dtype} ({n_rows} rows), "
            f"weight [{local_vocab}, {width}]")
    return text + (" and bias" if kind == HIDDEN_BIAS else ", no bias")


def _disagreement(table: Sequence[Sequence[int]]) -> Optional[str]:
    """The error message when the ranks' signatures differ in more than ``V_r``, else None."""
    same = lambda row: [row[0], *row[2:]]  # noqa: E731 - V_r (column 1) may differ
    differ = [r for r, row in enumerate(table) if same(row) != same(table[0])]
    if not differ:
        return None
    shapes = "; ".join(f"rank {r}: {_describe(row)}" for r, row in enumerate(table))
    return (
        f"`vocab_group`: rank(s) {', '.join(map(str, differ))} passed inputs whose shapes "
        "differ from rank 0's. Every rank of the group must pass the same leading shape "
        "(action_ids, mask, the per-token inputs and the hidden states are global) and the "
        "same arguments; only the rank's vocabulary block (the logits' last dimension, the "
        f"weight's and the bias's rows) may differ. Shapes by rank: {shapes}"
    )


def agree(group: dist.ProcessGroup, row: List[int], lead: Tuple[int, ...], ids: torch.Tensor,
          mask: torch.Tensor) -> None:
    """Raise ``ValueError`` on every rank unless all ranks' rows (:func:`signature`) agree
    and every block holds a token, then check the active ids against the global ``V``: one
    SUM all-reduce of the ``[world, 10]`` table (the other ranks' rows zero: an all-gather)
    and one host read of it and the id flag together. The table is identical on every
    rank, so is the outcome."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    table = torch.zeros((world, len(row)), dtype=torch.int64, device=ids.device)
    table[rank] = torch.tensor(row, dtype=torch.int64)
    dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group)
    vocab = table[:, 1].sum()
    bad = bad_ids(ids, mask, vocab).any()
    *host, any_bad = torch.cat([table.reshape(-1), bad.reshape(1).long()]).tolist()
    rows = [host[r * len(row):(r + 1) * len(row)] for r in range(world)]
    message = _disagreement(rows)
    if message is not None:
        raise ValueError(message)
    sharded = "logits" if row[0] in (LOGITS, LOGITS_REF) else "weight"
    _, vocab = vocab_blocks([r[1] for r in rows], sharded)
    if any_bad:
        _checks.check_active_ids(ids.reshape(lead), mask.reshape(lead), vocab)
