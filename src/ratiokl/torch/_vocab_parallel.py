"""Vocabulary-parallel PyTorch backend: each rank holds a contiguous vocabulary shard.

Layout (Megatron's): the ranks of ``group``, in group-rank order, hold
consecutive column ranges of the logits; rank ``r`` holds
``[start_r, start_r + V_r)`` with ``start_r = V_0 + ... + V_{r-1}``. Shards may
be uneven; the global vocabulary is ``V = sum_r V_r``. Action ids, mask,
temperature and the other per-token inputs are global and identical on every
rank.

Per row, every rank computes its shard's statistics (max ``m_r`` and
``s_r = sum exp(z - shift(m_r))``, ``ratiokl.torch._vocab_shard``) and the
ranks combine them with two ``[N]``-sized all-reduces per call, fused over
the policy and the reference logits::

    MAX all-reduce of (m_policy, m_ref, one-hot shard sizes)   -> M, every V_r
    SUM all-reduce of (w_r = s_r * exp(m_r - shift(M)), z_a on the owning rank, 0 elsewhere
                       [, w_r * (mu_r - shift(M))])
    lse = shift(M) + log(S),   logp = z_a - lse   [, H = log(S) - sum_r w_r (mu_r - shift) / S]

(the MAX of a one-hot of the sizes is their all-gather, so uneven shards cost
nothing extra). The entropy (``logprobs_entropy``: ``policy_loss``'s ``entropy_mean``
and ``entropy_coef``) adds one ``[N]`` term to the SUM: ``mu_r``, the mean of ``z``
under the shard's own softmax, weighted as its ``s_r`` is, gives ``E_p[z]`` and
``H = lse - E_p[z]``. The outputs are then bitwise identical on every rank. The
backward needs no collective: each rank writes its slice of
``(g * (onehot(a) - p) - g_H * p * (log p + H)) / T`` with the global ``lse`` and
``H``, the one-hot only on the owning rank.
The collectives are plain ``torch.distributed.all_reduce`` calls on detached
tensors, never a differentiable all-reduce (whose backward all-reduce would
multiply the replicated loss's gradient by the group size).

With ``check_ids=True`` (the default) a call first makes sure the ranks agree
(:meth:`VocabParallel._agree`, ``ratiokl.torch._vocab_agree``): one small SUM all-reduce
of a ``[world, 10]`` integer table, each rank's row its call's shape (leading shape,
whether it passed reference logits, ``V_r``), read on the host together with the
active-id check against the global ``V`` (the call's one synchronisation). A rank whose
shapes differ would otherwise enter all-reduces of another length, which
NCCL does not detect (the ranks hang until its watchdog's timeout) and gloo
reports as a mismatch on one rank only; instead every rank raises the same
``ValueError`` naming the ranks and their shapes. ``check_ids=False`` skips
the agreement with the synchronisation (the shapes must agree).

The per-shard math runs on the backend that ``backend`` resolves to for
the logits' device (as unsharded: ``"auto"`` is ``"triton"`` on CUDA):
``"native"`` (framework ops) or the Triton kernels, ``"triton"`` on CUDA and
``"interpret"`` on CPU (``ratiokl.torch._triton``: the shard's
log-sum-exp from ``shard_stats_kernel``, combined as ``(m, s) = (lse_r, 1)``;
the backward from ``logp_backward_kernel`` with the global ``lse``). The
collectives are the same for every backend.
"""

from __future__ import annotations

import functools
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ratiokl._backend import Backend
from ratiokl._core import rows as _rows
from ratiokl.torch import _vocab_agree, _vocab_shard
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import Temperature

__all__ = ["VocabParallel", "backend"]


def backend(group: dist.ProcessGroup, lead: Tuple[int, ...], kernels: bool,
            check_ids: bool, linear_selected_logprobs: Callable) -> Backend:
    """The vocabulary-parallel backend over ``group`` for inputs of leading shape ``lead``.

    ``kernels``: the per-shard math runs the Triton kernels (else framework ops);
    ``check_ids``: range-check active ids against the global vocabulary;
    ``linear_selected_logprobs``: the op from hidden states, called with the
    :class:`VocabParallel` first (``ratiokl.torch._vocab_linear.selected_logprobs``, which
    builds on this module).
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "`vocab_group` needs torch.distributed: call "
            "torch.distributed.init_process_group first"
        )
    parallel = VocabParallel(group, lead, kernels, check_ids)
    return Backend(parallel.selected_logprobs, parallel.ratio_kl, parallel.logprobs_entropy,
                   linear_selected_logprobs=functools.partial(linear_selected_logprobs,
                                                              parallel))


class _AttachGrad(torch.autograd.Function):
    """``logp = z_a - lse`` (0 on inactive rows), and the entropy ``H`` when given, with this
    shard's analytic backward.

    ``ent``: the row's global entropy (float32 ``[N]``), or None (then ``logp`` alone is
    returned). ``kernels``: the backward runs ``logp_backward_kernel`` (``"triton"`` /
    ``"interpret"`` backends) instead of the native math.
    """

    @staticmethod
    def forward(ctx, logits, z_sel, lse, ent, local_ids, owned, mask, temperature, kernels):
        ctx.kernels = kernels
        ctx.temperature = None if isinstance(temperature, torch.Tensor) else temperature
        saved = (logits, lse, local_ids, owned, mask)
        saved += (lse if ent is None else ent,)  # a placeholder without the entropy
        ctx.save_for_backward(*saved, *([temperature] if ctx.temperature is None else []))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        zero = torch.zeros_like(lse)
        logp = torch.where(mask, z_sel - lse, zero)
        return logp if ent is None else (logp, torch.where(mask, ent, zero))

    @staticmethod
    def backward(ctx, grad_logp, grad_ent=None):
        saved = ctx.saved_tensors
        logits, lse, local_ids, owned, mask, ent = saved[:6]
        temperature = saved[6] if ctx.temperature is None else ctx.temperature
        zero = torch.zeros_like(lse)
        # Selected, never multiplied: a NaN upstream value on an inactive row stays out.
        g_logp = zero if grad_logp is None else torch.where(mask, grad_logp, zero).float()
        g_ent = None if grad_ent is None else torch.where(mask, grad_ent, zero).float()
        if ctx.kernels:
            from ratiokl.torch import _triton  # imports triton: only when a kernel backend runs

            grad = _triton.shard_grad(
                logits, torch.where(owned, local_ids, -1), mask,
                _triton.kernel_temperature(temperature, logits.device), lse, g_logp,
                g_ent, ent,
            )
        else:
            grad = _vocab_shard.native_block_grad(logits, lse, local_ids, owned, mask,
                                                  temperature, g_logp, g_ent, ent)
        return grad, None, None, None, None, None, None, None, None


class VocabParallel:
    """The backend interface of ``ratiokl.torch._route`` over a vocabulary-sharded group.

    ``check_ids=True`` here means: before any other collective, make sure every
    rank passed the same shapes and range-check active ids against the global
    vocabulary (:meth:`_agree`: one small all-reduce and one host read), raising
    ``ValueError`` on every rank (naming the ranks' shapes, or the position of a
    bad id in the leading shape ``lead``).
    """

    def __init__(self, group: dist.ProcessGroup, lead: Tuple[int, ...], kernels: bool,
                 check_ids: bool) -> None:
        self.group = group
        self.lead = lead
        self.kernels = kernels
        self.check_ids = check_ids
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def selected_logprobs(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        temperature: Temperature,
    ) -> torch.Tensor:
        """Float32 ``logp[N]`` of this rank's shard ``logits[N, V_r]``; same on every rank."""
        return self.logprobs(logits, None, ids, mask, temperature)[0]

    def logprobs_entropy(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        mask: torch.Tensor,
        temperature: Temperature,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(logp[N], entropy[N])`` of this rank's shard; same on every rank, both
        differentiable w.r.t. the shard (one more ``[N]`` term in the SUM all-reduce)."""
        logp, _, ent = self.logprobs(logits, None, ids, mask, temperature, entropy=True)
        return logp, ent

    def ratio_kl(
        self,
        policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
        old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor], kl_code: int,
        temperature: Temperature,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(ratio[N], kl[N])``; differentiable w.r.t. this rank's ``policy`` shard."""
        logp, logp_ref, _ = self.logprobs(policy, ref, ids, mask, temperature)
        return _rows.ratio_kl(XP, logp, lambda: logp_ref, ref_logps, old_logps, mask, kl_code)

    def logprobs(
        self,
        policy: torch.Tensor,
        ref: Optional[torch.Tensor],
        ids: torch.Tensor,
        mask: torch.Tensor,
        temperature: Temperature,
        entropy: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(logp, logp_ref, entropy)`` float32 ``[N]`` from shards ``[N, V_r]``.

        ``logp`` (and, with ``entropy``, the policy's entropy; else None) is
        differentiable w.r.t. ``policy``; ``logp_ref`` (None when ``ref`` is None) is
        detached. One MAX and one SUM all-reduce in all.
        """
        if self.check_ids:  # before any other collective (the empty case too)
            self._agree(1 if ref is None else 2, policy.shape[1], ids, mask)
        if isinstance(temperature, torch.Tensor):
            temperature = torch.where(mask, temperature, torch.ones_like(temperature))
        kernels = self.kernels
        shards = [policy.detach()] + ([] if ref is None else [ref.detach()])
        if mask.numel() == 0:
            empty = torch.zeros(0, dtype=torch.float32, device=policy.device)
            local = torch.zeros(0, dtype=torch.long, device=policy.device)
            out = _AttachGrad.apply(policy, empty, empty, empty if entropy else None, local,
                                    mask, mask, temperature, kernels)
            logp, ent = out if entropy else (out, None)
            return logp, None if ref is None else empty, ent
        with torch.no_grad():
            stats = _vocab_shard.stats(shards, mask, temperature, kernels, entropy)
            z_sel, lse, ent, local_ids, owned, _ = self._combine(shards, stats, ids, mask,
                                                                 temperature)
        out = _AttachGrad.apply(
            policy, z_sel[0], lse[0], ent, local_ids, owned, mask, temperature, kernels
        )
        logp, ent = out if entropy else (out, None)
        if ref is None:
            return logp, None, ent
        return logp, torch.where(mask, z_sel[1] - lse[1], torch.zeros_like(lse[1])), ent

    def block_stats(self, block: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                    temperature: Temperature, entropy: bool):
        """``(logp, entropy | None, lse, start_r)`` of this rank's block ``[N, V_r]`` of the
        logits (detached; ``temperature`` 1 on inactive rows): the global float32 ``[N]``
        row values of :meth:`logprobs` without its gradient, and the rank's first column,
        from the same statistics and the same two all-reduces (the linear ops' chunks)."""
        stats = _vocab_shard.stats([block], mask, temperature, self.kernels, entropy)
        z_sel, lse, ent, _, _, start = self._combine([block], stats, ids, mask, temperature)
        zero = torch.zeros_like(lse[0])
        logp = torch.where(mask, z_sel[0] - lse[0], zero)
        return logp, None if ent is None else torch.where(mask, ent, zero), lse[0], start

    def _combine(
        self,
        shards: Sequence[torch.Tensor],
        stats: Sequence[_vocab_shard.Stats],
        ids: torch.Tensor,
        mask: torch.Tensor,
        temperature: Temperature,
    ) -> Tuple[List[torch.Tensor], List[torch.Tensor], Optional[torch.Tensor], torch.Tensor,
               torch.Tensor, torch.Tensor]:
        """Global ``z_a`` and ``lse`` per shard tensor, the policy's entropy (None without
        its ``mu``), plus local ids and ownership ``[N]`` and this rank's first column
        ``start_r`` (0-d int64).

        ``stats`` holds each shard tensor's ``(m, s, mu)`` from :func:`ratiokl.torch._vocab_shard.stats`.
        """
        n_rows, local_vocab = shards[0].shape
        sizes = torch.zeros(self.world, dtype=torch.float64, device=ids.device)
        sizes[self.rank] = local_vocab
        maxima = torch.cat([m.double() for m, _, _ in stats] + [sizes])
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.group)
        sizes = maxima[len(shards) * n_rows :].long()
        start, vocab = sizes[: self.rank].sum(), sizes.sum()
        local_ids, owned, bad = _rows.ownership(XP, ids.long(), mask, start, local_vocab, vocab)
        shift = _rows.finite_shift(XP, maxima[: len(shards) * n_rows].float())
        shift = shift.reshape(len(shards), n_rows)
        sums = []
        for k, (x, (m, s, _)) in enumerate(zip(shards, stats)):
            sums.append(s * torch.exp(m - shift[k]))
            sums.append(_vocab_shard.selected(x, local_ids, owned, temperature))
        mu = stats[0][2]
        if mu is not None:  # the entropy's term: E_p[z] - shift = sum_r w_r (mu_r - shift) / S
            sums.append(sums[0] * (mu - shift[0]))
        sums = torch.stack(sums)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=self.group)
        nan = torch.full_like(shift[0], float("nan"))
        # log(S) after the max shift; an out-of-range active id poisons its row (unchecked calls).
        lse = [torch.where(bad, nan, _rows.shard_lse(XP, shift[k], sums[2 * k]))
               for k in range(len(shards))]
        ent = None
        if mu is not None:  # H = lse - E_p[z] = log(S) - (E_p[z] - shift)
            ent = torch.where(bad, nan, _rows.shard_entropy(XP, sums[0], sums[-1]))
        return [sums[2 * k + 1] for k in range(len(shards))], lse, ent, local_ids, owned, start

    def _agree(self, n_shards: int, local_vocab: int, ids: torch.Tensor,
               mask: torch.Tensor) -> None:
        """The ranks' agreement on the call's shapes, then the id check against the global
        ``V`` (:func:`ratiokl.torch._vocab_agree.agree`)."""
        kind = _vocab_agree.LOGITS if n_shards == 1 else _vocab_agree.LOGITS_REF
        _vocab_agree.agree(self.group, _vocab_agree.signature(self.lead, kind, local_vocab),
                           self.lead, ids, mask)
