"""The native PyTorch backend: framework ops only, any device, any logits dtype.

Implements the backend interface of ``ratiokl.torch._route`` on flattened
inputs (logits ``[N, V]``, per-row tensors ``[N]``).

How it works. Rows are processed in chunks whose size depends only on
``(N, V)`` (never on values, so no host sync). Per chunk, inactive rows are
replaced with zeros by ``torch.where`` *before* any arithmetic, the logits are
upcast to float32 and scaled by ``1/T``, and three row statistics are taken:
the row max ``m``, the shifted sum of exponentials ``s`` and the selected
scaled logit ``z_a``. Their combine gives ``lse`` (the vocabulary-parallel
mode all-reduces the same statistics across ranks first, see
docs/design.md). The backward recomputes the softmax chunk by chunk from the
saved ``lse`` and writes ``g * (onehot(a) - softmax(z)) / T`` directly in the
logits' dtype, selected (never multiplied) to exactly 0 on inactive rows.

Memory beyond the inputs and outputs:
  * saved for backward: ``lse`` (float32 ``[N]``) plus the clamped ids and
    per-row temperature (``[N]`` each) -- O(N); the logits themselves are
    the caller's tensor, referenced, not copied;
  * while running: a few float32 chunk temporaries of at most
    ``_CHUNK_BYTES`` each (2 MiB on the CPU, where a chunk's passes then run
    in cache, 512 MiB on a GPU, where each launch must move enough bytes to
    run at bandwidth; bounded, independent of ``N``);
  * the gradient: one ``[N, V]`` tensor in the logits' dtype;
  * if the caller's logits cannot be viewed as ``[N, V]`` (e.g. a transposed
    ``[T, B, V]`` tensor seen as ``[B, T, V]``), ``reshape`` in the public
    function makes one copy in the logits' dtype.

An active row with an id outside ``[0, V)`` is poisoned (NaN outputs and
gradient) whether or not the caller checks the ids, as on the Triton
backend: the host check reads its result only after the work is queued, so
``check_ids`` needs nothing here.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ratiokl._core import objective as _objective
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import Temperature

__all__ = ["entropy_terms", "finite_shift", "logprobs_entropy", "ratio_kl", "row_chunks",
           "rows_backward", "rows_forward", "scaled_logits", "selected_logprobs"]

#: Bytes of one float32 chunk temporary, by device type (``"cpu"``, else the default). On
#: a CPU the chunk's passes should hit its caches: selected_logprobs, N=1024, V=32768 fp32,
#: 2 cores (1 MiB L2 each, 32 MiB L3): eager 101 ms; chunks of 32 MiB 227 ms, 8 MiB 148,
#: 4 MiB 83, 2 MiB 70, 1 MiB 89 (per-op overhead). A GPU launch must move enough bytes.
_CHUNK_BYTES = {"cpu": 2 * 2**20, "default": 512 * 2**20}



def row_chunks(n_rows: int, vocab: int, device: torch.device) -> List[slice]:
    """Row chunks such that one float32 ``[rows, V]`` temporary fits ``_CHUNK_BYTES``.

    Under ``torch.compile`` one chunk, all rows: the compiler fuses the passes
    (no ``[N, V]`` temporary) and a Python loop over ``N`` would guard on it,
    recompiling for every sequence length.
    """
    if torch.compiler.is_compiling():
        return [slice(None)]
    budget = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES["default"])
    step = max(1, min(n_rows, budget // (4 * vocab)))
    return [slice(start, start + step) for start in range(0, n_rows, step)]


def scaled_logits(
    logits: torch.Tensor, mask: torch.Tensor, temperature: Temperature
) -> torch.Tensor:
    """Float32 ``z = logits / T`` of a chunk, with inactive rows zeroed first."""
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    # Select, never multiply: a NaN/inf on an inactive row must not survive.
    z = torch.where(mask[:, None], logits, zero).float()
    if isinstance(temperature, torch.Tensor):
        return z.div_(temperature[:, None])
    return z if temperature == 1.0 else z.div_(temperature)


def _row_stats(
    z: torch.Tensor, ids: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row max ``m``, ``s = sum exp(z - shift(m))`` and the selected ``z[a]``, each ``[rows]``."""
    m = z.amax(dim=1)
    s = (z - finite_shift(m)[:, None]).exp_().sum(dim=1)
    z_sel = z.gather(1, ids[:, None])[:, 0]
    return m, s, z_sel


def finite_shift(m: torch.Tensor) -> torch.Tensor:
    """The max used to shift the exponentials; 0 where the max is +-inf or NaN.

    A row of all ``-inf`` then gets ``lse = -inf`` and ``logp = NaN`` (no valid
    distribution), and a ``+inf`` logit gives ``lse = +inf``, as in the spec.
    """
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _lse(m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Combine row statistics into the log-sum-exp (single shard)."""
    return finite_shift(m) + torch.log(s)


def _forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
    bad: Optional[torch.Tensor],
    entropy: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(logp, lse, entropy)``, float32 ``[N]`` each (``entropy`` None unless asked for).

    ``logp`` and ``entropy`` are 0 on inactive rows; ``lse`` is NaN on ``bad`` rows (so
    are their ``logp``, ``entropy`` and, through the saved ``lse``, their gradient). The
    entropy comes from each chunk while it is at hand: one read of the logits.
    """
    n_rows, vocab = logits.shape
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    z_sel = torch.empty_like(lse)
    ent = torch.empty_like(lse) if entropy else None
    for rows in row_chunks(n_rows, vocab, logits.device):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        z = scaled_logits(logits[rows], mask[rows], t)
        m, s, selected = _row_stats(z, ids[rows])
        lse[rows] = _lse(m, s)
        z_sel[rows] = selected
        if entropy:
            ent[rows] = -entropy_terms(z, lse[rows])[1].sum(dim=1)
    if bad is not None:
        # An out-of-range active id (unchecked): poison the row, forward and backward.
        nan = torch.full_like(lse, float("nan"))
        lse = torch.where(bad, nan, lse)
        ent = None if ent is None else torch.where(bad, nan, ent)
    zero = torch.zeros_like(lse)
    logp = torch.where(mask, z_sel - lse, zero)
    return logp, lse, None if ent is None else torch.where(mask, ent, zero)


def _backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
    lse: torch.Tensor,
    grad_logp: torch.Tensor,
) -> torch.Tensor:
    """``g * (onehot(a) - softmax(z)) / T`` in the logits' dtype ``[N, V]``; 0 on inactive rows."""
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    coef = torch.where(mask, grad_logp, torch.zeros_like(grad_logp)) / temperature
    for rows in row_chunks(n_rows, vocab, logits.device):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        # -softmax(z), then +1 at the action: exactly onehot - softmax.
        d = (scaled_logits(logits[rows], mask[rows], t) - lse[rows, None]).exp_().neg_()
        d.scatter_add_(1, ids[rows, None], torch.ones_like(d[:, :1]))
        d.mul_(coef[rows, None]).masked_fill_(~mask[rows, None], 0.0)
        grad[rows] = d
    return grad


def entropy_terms(z: torch.Tensor, lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(p, p * log p)`` of a chunk's rows, ``p * log p`` exactly 0 where ``p = 0`` (a
    ``-inf`` logit: never ``0 * -inf``) and NaN where ``p`` is NaN (a NaN or ``+inf`` logit
    in the row: its entropy is NaN, never a finite sum that skipped it)."""
    log_p = z - lse[:, None]
    p = log_p.exp()
    return p, torch.where(p == 0.0, torch.zeros_like(p), p * log_p)


def _entropy_backward(logits, ids, mask, temperature, lse, ent, grad_logp,
                      grad_ent) -> torch.Tensor:
    """``(g_logp * (onehot - p) - g_ent * p * (log p + H)) / T`` in the logits' dtype
    ``[N, V]`` (one rounding); an absent upstream term (None) is 0; 0 on inactive rows."""
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    zero = torch.zeros((), dtype=torch.float32, device=logits.device)

    def coef(g):
        return zero.expand(n_rows) if g is None else torch.where(mask, g, zero) / temperature

    c_logp, c_ent = coef(grad_logp), coef(grad_ent)
    for rows in row_chunks(n_rows, vocab, logits.device):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        p, p_log_p = entropy_terms(scaled_logits(logits[rows], mask[rows], t), lse[rows])
        d = (p_log_p + p * ent[rows, None]).mul_(-c_ent[rows, None])
        d.sub_(p * c_logp[rows, None])
        d.scatter_add_(1, ids[rows, None], c_logp[rows, None].contiguous())
        grad[rows] = d.masked_fill_(~mask[rows, None], 0.0)
    return grad


class _LogprobEntropy(torch.autograd.Function):
    """``(logp[N], entropy[N])`` from ``logits[N, V]``; the backward sums both terms."""

    @staticmethod
    def forward(ctx, logits, ids, mask, temperature, bad):
        logp, lse, ent = _forward(logits, ids, mask, temperature, bad, entropy=True)
        saved = (logits, ids, mask, lse, ent)
        if isinstance(temperature, torch.Tensor):
            saved = saved + (temperature,)
        else:
            ctx.temperature = temperature
        ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        saved = ctx.saved_tensors
        logits, ids, mask, lse, ent = saved[:5]
        temperature = saved[5] if len(saved) == 6 else ctx.temperature
        if grad_ent is None:  # the entropy only logged (policy_loss's entropy_mean)
            grad = _backward(logits, ids, mask, temperature, lse, grad_logp)
        else:
            grad = _entropy_backward(logits, ids, mask, temperature, lse, ent, grad_logp,
                                     grad_ent)
        return grad, None, None, None, None


class _SelectedLogprob(torch.autograd.Function):
    """``logp[N]`` from ``logits[N, V]`` with the analytic, chunked backward."""

    @staticmethod
    def forward(ctx, logits, ids, mask, temperature, bad):
        logp, lse, _ = _forward(logits, ids, mask, temperature, bad)
        if isinstance(temperature, torch.Tensor):
            ctx.save_for_backward(logits, ids, mask, lse, temperature)
        else:
            ctx.save_for_backward(logits, ids, mask, lse)
            ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        saved = ctx.saved_tensors
        logits, ids, mask, lse = saved[:4]
        temperature = saved[4] if len(saved) == 5 else ctx.temperature
        grad = _backward(logits, ids, mask, temperature, lse, grad_logp)
        return grad, None, None, None, None


def _prepare_rows(
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
    vocab: int,
) -> Tuple[torch.Tensor, Temperature, torch.Tensor]:
    """In-range int64 ids (0 on inactive rows), neutral temperature, and the rows to poison.

    The poison is applied whether or not the caller checks the ids: the host
    check (``check_ids``) reads its result after the kernels are queued.
    """
    bad = mask & ((ids < 0) | (ids >= vocab))
    safe_ids = torch.where(mask, ids, torch.zeros_like(ids)).clamp(0, vocab - 1).long()
    if isinstance(temperature, torch.Tensor):
        temperature = torch.where(mask, temperature, torch.ones_like(temperature))
    return safe_ids, temperature, bad


def selected_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
) -> torch.Tensor:
    """Float32 ``logp[N]`` of ``logits[N, V]``; differentiable w.r.t. ``logits``."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, logits.shape[1])
    return _SelectedLogprob.apply(logits, safe_ids, mask, temp, bad)


def logprobs_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(logp[N], entropy[N])`` of ``logits[N, V]``; differentiable w.r.t. ``logits``."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, logits.shape[1])
    return _LogprobEntropy.apply(logits, safe_ids, mask, temp, bad)


def rows_forward(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                 temperature: Temperature, entropy: bool
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(logp, entropy | None, lse)`` float32 ``[N]`` of ``logits [N, V]``, outside autograd
    (the linear ops' chunks; :func:`rows_backward` is their gradient)."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, logits.shape[1])
    logp, lse, ent = _forward(logits, safe_ids, mask, temp, bad, entropy)
    return logp, ent, lse


def rows_backward(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                  temperature: Temperature, lse: torch.Tensor, ent: Optional[torch.Tensor],
                  grad_logp: Optional[torch.Tensor], grad_ent: Optional[torch.Tensor],
                  out: torch.Tensor) -> torch.Tensor:
    """``d / d logits`` of ``sum(grad_logp * logp + grad_ent * entropy)`` (None: a zero
    term) in the logits' dtype, from :func:`rows_forward`'s ``lse`` and entropy; a new
    tensor (``out`` is not used: the chunks are temporaries of their own)."""
    del out
    safe_ids, temp, _ = _prepare_rows(ids, mask, temperature, logits.shape[1])
    if grad_ent is None:
        grad_logp = torch.zeros_like(lse) if grad_logp is None else grad_logp
        return _backward(logits, safe_ids, mask, temp, lse, grad_logp)
    return _entropy_backward(logits, safe_ids, mask, temp, lse, ent, grad_logp, grad_ent)


def ratio_kl(
    policy: torch.Tensor, ref: Optional[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor,
    old_logps: torch.Tensor, ref_logps: Optional[torch.Tensor], kl_code: int,
    temperature: Temperature,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(ratio[N], kl[N])``; differentiable w.r.t. ``policy`` only."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, policy.shape[1])
    logp = _SelectedLogprob.apply(policy, safe_ids, mask, temp, bad)
    if ref_logps is None:
        with torch.no_grad():
            ref_logps, _, _ = _forward(ref.detach(), safe_ids, mask, temp, bad)
    return _objective.token_ratio_kl(XP, logp, ref_logps.detach(), old_logps.detach(), mask,
                                     kl_code)
