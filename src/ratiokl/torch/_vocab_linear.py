r"""The two ops from hidden states over a vocabulary-sharded lm_head (``vocab_group``).

Rank ``r`` of the group holds rows ``[start_r, start_r + V_r)`` of the lm_head, ``weight
[V_r, H]`` and ``bias [V_r]``, in group-rank order (Megatron's ``ColumnParallelLinear``
layout: the logits path's column blocks); the hidden states, ids, mask, temperature and
the other per-token inputs are global and the same on every rank.

The chunk loop is ``ratiokl.torch._linear_logprobs``'s, run with the row operations of one
vocabulary block (:class:`_BlockRows`). Per chunk of ``C`` rows the GEMM writes the block's
logits ``x_r = softcap((h W_r^T + b_r) s) [C, V_r]``; their statistics are the sharded
logits path's (``ratiokl.torch._vocab_parallel``: ``(m_r, s_r, mu_r)`` from the framework
ops, or the block's log-sum-exp and ``mu_r`` from ``shard_stats_kernel``), combined by its
one MAX and one SUM all-reduce of ``[C]``-sized rows into the row's global ``lse``,
``logp = x_a / T - lse`` and entropy, the same bits on every rank. The backward recomputes
each chunk's block, writes its slice of ``dx = (g (onehot(a) - p) - g_H p (log p + H)) /
T`` with the global ``lse`` and ``H`` (the one-hot on the owning rank only;
``logp_backward_kernel`` on the Triton backends, given the block-local id) and adds its
share of the gradients:

.. math::

    dW_r = du_r^\top \bar h, \qquad db_r = \textstyle\sum_{\text{rows}} du_r, \qquad
    dh = \textstyle\sum_r du_r W_r

``dW_r`` and ``db_r`` are this rank's rows of the unsharded gradients. ``dh``: each rank
writes its partial ``du_r W_r`` in float32 (``[N, H]``: 128 MiB at N = 8192, H = 4096), one
SUM all-reduce of ``[N, H]`` float32 inside the op's backward sums the partials over the
ranks, and the total is rounded once to the hidden states' dtype (``sum_hidden`` of
``_linear_logprobs``), so every rank holds the full gradient, rounded as the unsharded op
rounds its one float32 sum. The sum sits inside the backward because autograd casts a
Function's gradient to its input's dtype: summed after it (Megatron's
``copy_to_tensor_model_parallel_region``), each rank's partial would be rounded to bfloat16
before the sum, 1.8x the linear fixtures' tolerance with bfloat16 hidden states beside a
float32 head.

Collectives per call: the shape agreement (``check_ids=True``), one MAX and one SUM
all-reduce per chunk, and in the backward the one ``[N, H]`` float32 all-reduce of ``dh``
(none when ``hidden`` needs no gradient). Nothing ``[N, V]``, nothing gathered.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from ratiokl.spec import LogitTransform
from ratiokl.torch import _linear_logprobs, _vocab_agree
from ratiokl.torch._checks import Temperature
from ratiokl.torch._vocab_parallel import VocabParallel
from ratiokl.torch._vocab_shard import native_block_grad

__all__ = ["selected_logprobs"]

Tensor = torch.Tensor


def _neutral(temperature: Temperature, mask: Tensor) -> Temperature:
    """A per-row temperature with inactive rows at 1 (as the logits path reads it)."""
    if isinstance(temperature, torch.Tensor):
        return torch.where(mask, temperature, torch.ones_like(temperature))
    return temperature


class _BlockRows:
    """The row operations (:class:`ratiokl.torch._linear_logprobs.RowOps`) of one rank's
    vocabulary block ``x [C, V_r]``: global statistics through the group, the block's
    slice of the gradient. Remembers the rank's first column, learnt by the forward's MAX
    all-reduce, for the backward."""

    def __init__(self, parallel: VocabParallel) -> None:
        self.parallel = parallel
        self.start: Optional[Tensor] = None

    def forward(self, x: Tensor, ids: Tensor, mask: Tensor, temperature: Temperature,
                entropy: bool):
        """``(logp, entropy | None, lse)`` float32 ``[C]``, global: two all-reduces."""
        logp, ent, lse, self.start = self.parallel.block_stats(
            x, ids, mask, _neutral(temperature, mask), entropy)
        return logp, ent, lse

    def backward(self, x: Tensor, ids: Tensor, mask: Tensor, temperature: Temperature,
                 lse: Tensor, ent: Optional[Tensor], g_logp: Optional[Tensor],
                 g_ent: Optional[Tensor], out: Tensor) -> Tensor:
        """This block's ``dx [C, V_r]`` in x's dtype from the global ``lse`` and entropy;
        no collective."""
        temperature = _neutral(temperature, mask)
        local = ids.long() - self.start
        owned = mask & (local >= 0) & (local < x.shape[1])
        zero = torch.zeros_like(lse)
        # Selected, never multiplied: a NaN upstream value on an inactive row stays out.
        g_ent = None if g_ent is None else torch.where(mask, g_ent, zero)
        if self.parallel.kernels:  # no one-hot where the id lies outside the block
            g_logp = None if g_logp is None else torch.where(mask, g_logp, zero)
            return _linear_logprobs.TRITON_ROWS.backward(
                x, torch.where(owned, local, -1), mask, temperature, lse, ent, g_logp, g_ent,
                out)
        g_logp = zero if g_logp is None else torch.where(mask, g_logp, zero)
        return native_block_grad(x, lse, torch.where(owned, local, 0), owned, mask,
                                 temperature, g_logp, g_ent, ent)


def selected_logprobs(parallel: VocabParallel, hidden: Tensor, weight: Tensor,
                      bias: Optional[Tensor], ids: Tensor, mask: Tensor,
                      temperature: Temperature, transform: LogitTransform, chunk_rows: int,
                      entropy: bool):
    """``logp`` float32 ``[N]``, or ``(logp, entropy)``, of ``hidden [N, H]`` through this
    rank's block of the head, ``weight [V_r, H]`` / ``bias [V_r]`` (module docstring); the
    same values on every rank. Differentiable w.r.t. ``hidden`` (the full gradient, summed
    over the group), ``weight`` and ``bias`` (this rank's rows)."""
    if parallel.check_ids:  # before any other collective
        kind = _vocab_agree.HIDDEN if bias is None else _vocab_agree.HIDDEN_BIAS
        row = _vocab_agree.signature(parallel.lead, kind, weight.shape[0], hidden.shape[-1],
                                     hidden.dtype)
        _vocab_agree.agree(parallel.group, row, parallel.lead, ids, mask)
    rows = _BlockRows(parallel)
    sum_hidden = functools.partial(dist.all_reduce, op=dist.ReduceOp.SUM, group=parallel.group)
    return _linear_logprobs.selected_logprobs(
        _linear_logprobs.RowOps(rows.forward, rows.backward), hidden, weight, bias, ids, mask,
        temperature, transform, chunk_rows, entropy, sum_hidden)
