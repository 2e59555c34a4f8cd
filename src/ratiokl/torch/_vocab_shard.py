"""One rank's shard math of the vocabulary-parallel PyTorch backend (``_vocab_parallel``).

The shard's row statistics before the all-reduces (:func:`stats`: the native row max and
shifted sum, chunk by chunk, or the Triton kernels' shard log-sum-exp), the selected scaled
logit on the owning rank (:func:`selected`) and, after them, the shard's slice of the
gradient from the global ``lse`` and entropy (:func:`native_block_grad`; no collective).
The row math is :mod:`ratiokl._core.rows`'s; the collectives are ``_vocab_parallel``'s.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ratiokl._core import rows as _rows
from ratiokl.torch import _native
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import Temperature

__all__ = ["Stats", "native_block_grad", "selected", "stats"]


#: One shard tensor's statistics: row max ``m``, ``s = sum exp(z - shift(m))`` and, for the
#: policy's entropy, ``mu`` (the mean ``z`` under the shard's softmax; else None).
Stats = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def _shard_stats(logits: torch.Tensor, mask: torch.Tensor, temperature: Temperature,
                 entropy: bool) -> Stats:
    """This shard's ``(m, s, mu)``, float32 ``[N]`` each (``mu`` with ``entropy``; 0 on a
    row of no mass)."""
    n_rows, vocab = logits.shape
    m = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    mu = torch.empty_like(m) if entropy else None
    for rows in _native.row_chunks(n_rows, vocab, logits.device):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        z = _native.scaled_logits(logits[rows], mask[rows], t)
        m[rows] = z.amax(dim=1)
        shift = _rows.finite_shift(XP, m[rows])[:, None]
        e = (z - shift).exp_()
        s[rows] = e.sum(dim=1)
        if entropy:  # E[z] = shift + sum e (z - shift) / s; a -inf logit (e = 0) adds 0,
            # a NaN (e NaN) stays NaN: select on e == 0 only, never on e > 0.
            h = torch.where(e == 0.0, torch.zeros_like(e), e * (z - shift)).sum(dim=1)
            mu[rows] = torch.where(s[rows] == 0.0, torch.zeros_like(h),
                                   shift[:, 0] + h / s[rows])
    return m, s, mu


def selected(
    logits: torch.Tensor,
    local_ids: torch.Tensor,
    owned: torch.Tensor,
    temperature: Temperature,
) -> torch.Tensor:
    """``z[a]`` float32 ``[N]`` on rows whose action lies in this shard, 0 elsewhere."""
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    x = torch.where(owned, logits.gather(1, local_ids[:, None])[:, 0], zero).float()
    return x / temperature


def stats(shards: Sequence[torch.Tensor], mask: torch.Tensor, temperature: Temperature,
           kernels: bool, entropy: bool) -> List[Stats]:
    """``(m, s, mu)`` float32 ``[N]`` per shard tensor (policy, then ref if given; ``mu``
    for the policy with ``entropy``, else None).

    Native: the row max and shifted sum. Kernels: the shard's log-sum-exp
    ``lse_r`` as ``(lse_r, 1)`` (one pass over policy and ref together), which
    the combine turns into the same ``M`` shift and ``S`` sum.
    """
    if not kernels:
        return [_shard_stats(x, mask, temperature, entropy and k == 0)
                for k, x in enumerate(shards)]
    from ratiokl.torch import _triton  # imports triton: only when a kernel backend runs

    temp = _triton.kernel_temperature(temperature, shards[0].device)
    lse, ref_lse, mu = _triton.shard_lse(shards[0], shards[1] if len(shards) > 1 else None,
                                         mask, temp, entropy)
    stats = [(lse, torch.ones_like(lse), mu)]
    return stats if ref_lse is None else stats + [(ref_lse, torch.ones_like(ref_lse), None)]




def native_block_grad(logits, lse, local_ids, owned, mask, temperature, g_logp, g_ent,
                      ent) -> torch.Tensor:
    """This shard's slice of ``(g * (onehot(a) - p) - g_ent * p * (log p + H)) / T`` in the
    logits' dtype, ``p = softmax(z)`` (``g_ent`` None: no entropy term)."""
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    coef = g_logp / temperature
    c_ent = None if g_ent is None else g_ent / temperature
    for rows in _native.row_chunks(n_rows, vocab, logits.device):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        z = _native.scaled_logits(logits[rows], mask[rows], t)
        if c_ent is None:
            d = (z - lse[rows, None]).exp_().neg_()
        else:
            p, p_log_p = _rows.entropy_terms(XP, z, lse[rows])
            entropy_term = (p_log_p + p * ent[rows, None]).mul_(c_ent[rows, None])
            d = p.neg_()
        # +1 at the action, on the owning shard only (others write their column back).
        col = d.gather(1, local_ids[rows, None])
        d.scatter_(1, local_ids[rows, None], torch.where(owned[rows, None], col + 1.0, col))
        d.mul_(coef[rows, None])
        if c_ent is not None:
            d.sub_(entropy_term)
        grad[rows] = d.masked_fill_(~mask[rows, None], 0.0)
    return grad
