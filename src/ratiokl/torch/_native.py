"""The native PyTorch backend: framework ops only, any device, any logits dtype.

Float64 logits are computed in float64 (outputs, ``lse`` and gradient float64: what
``torch.autograd.gradcheck`` needs); every other dtype in float32, as below.

Implements the backend interface of ``ratiokl.torch._route`` on flattened
inputs (logits ``[N, V]``, per-row tensors ``[N]``).

How it works. Rows are processed in chunks whose size depends only on
``(N, V)`` (never on values, so no host sync). Per chunk, the logits are copied
to float32, inactive rows are replaced with zeros (:func:`keep_rows`) *before*
any arithmetic, the rest is scaled by ``1/T``, and the row statistics and their
combine (``lse``, ``logp``, the entropy, from one exponential per logit) are
:mod:`ratiokl._core.rows`'s. The backward recomputes the softmax chunk by chunk
from the saved ``lse`` and writes ``g * (onehot(a) - softmax(z)) / T`` directly
in the logits' dtype, selected (never multiplied) to exactly 0 on inactive rows.

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

An active row with an id outside ``[0, V)`` is poisoned whether or not the
caller checks the ids (the host check reads its result after the work is queued).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ratiokl._core import rows as _rows
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import Temperature

__all__ = ["compute_dtype", "keep_rows", "logprobs_entropy", "ratio_kl", "row_chunks",
           "rows_backward",
           "rows_forward", "scaled_logits", "selected_logprobs"]

#: Bytes of one float32 chunk temporary, by device type (``"cpu"``, else the default). On
#: a CPU the chunk's passes should hit its caches: selected_logprobs, N=1024, V=32768 fp32,
#: 2 cores (1 MiB L2 each, 32 MiB L3): eager 101 ms; chunks of 32 MiB 227 ms, 8 MiB 148,
#: 4 MiB 83, 2 MiB 70, 1 MiB 89 (per-op overhead). A GPU launch must move enough bytes.
_CHUNK_BYTES = {"cpu": 2 * 2**20, "default": 512 * 2**20}


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype the rows are computed in: float64 for float64 logits, else float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def row_chunks(n_rows: int, vocab: int, device: torch.device, itemsize: int = 4
               ) -> List[slice]:
    """Row chunks such that one ``[rows, V]`` temporary of ``itemsize``-byte elements (the
    compute dtype's) fits ``_CHUNK_BYTES``.

    Under ``torch.compile`` one chunk, all rows: the compiler fuses the passes
    (no ``[N, V]`` temporary) and a Python loop over ``N`` would guard on it,
    recompiling for every sequence length.
    """
    if torch.compiler.is_compiling():
        return [slice(None)]
    budget = _CHUNK_BYTES.get(device.type, _CHUNK_BYTES["default"])
    step = max(1, min(n_rows, budget // (itemsize * vocab)))
    return [slice(start, start + step) for start in range(0, n_rows, step)]


def keep_rows(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` (float32 or float64 ``[rows, V]``, a temporary) with the rows where ``mask`` is
    false set to +0, in place: a select, never a multiplication (a NaN/inf there must not
    survive).

    Each row's bits are ANDed with all ones (kept) or all zeros: one vectorised pass, where
    ``torch.where`` / ``masked_fill_`` with a per-row condition run element by element on
    the CPU (as slow as an ``exp`` there). Under ``torch.compile``, ``torch.where``: fused.
    """
    if torch.compiler.is_compiling():
        return torch.where(mask[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
    ints = torch.int64 if x.dtype == torch.float64 else torch.int32  # the same width
    bits = mask.to(ints).neg_()  # -1: every bit set
    x.view(ints).bitwise_and_(bits[:, None])
    return x


def scaled_logits(
    logits: torch.Tensor, mask: torch.Tensor, temperature: Temperature
) -> torch.Tensor:
    """``z = logits / T`` of a chunk in the compute dtype (:func:`compute_dtype`; a new
    tensor), with inactive rows zeroed first."""
    z = keep_rows(logits.to(compute_dtype(logits), copy=True), mask)
    if isinstance(temperature, torch.Tensor):
        return z.div_(temperature[:, None])
    return z if temperature == 1.0 else z.div_(temperature)


def _forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
    bad: torch.Tensor,
    entropy: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(logp, lse, entropy)``, ``[N]`` each in the compute dtype (``entropy`` None unless
    asked for).

    ``logp`` and ``entropy`` are 0 on inactive rows; ``lse`` is NaN on ``bad`` rows (so
    are their ``logp``, ``entropy`` and, through the saved ``lse``, their gradient). The
    entropy comes from each chunk while it is at hand: one read of the logits.
    """
    n_rows, vocab = logits.shape
    lse = torch.empty(n_rows, dtype=compute_dtype(logits), device=logits.device)
    z_sel = torch.empty_like(lse)
    ent = torch.empty_like(lse) if entropy else None
    for rows in row_chunks(n_rows, vocab, logits.device, lse.element_size()):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        z = scaled_logits(logits[rows], mask[rows], t)
        lse[rows], z_sel[rows], chunk_ent = _rows.row_values(XP, z, ids[rows], entropy)
        if entropy:
            ent[rows] = chunk_ent
    return _rows.finish(XP, mask, bad, lse, z_sel, ent)


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
    neg_coef = coef.neg()
    for rows in row_chunks(n_rows, vocab, logits.device, lse.element_size()):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        # -c * softmax(z), then +c at the action: c * (onehot - softmax).
        d = scaled_logits(logits[rows], mask[rows], t).sub_(lse[rows, None]).exp_()
        d.mul_(neg_coef[rows, None]).scatter_add_(1, ids[rows, None], coef[rows, None])
        grad[rows] = keep_rows(d, mask[rows])
    return grad


def _entropy_backward(logits, ids, mask, temperature, lse, ent, grad_logp,
                      grad_ent) -> torch.Tensor:
    """``(g_logp * (onehot - p) - g_ent * p * (log p + H)) / T`` in the logits' dtype
    ``[N, V]`` (one rounding); an absent upstream term (None) is 0; 0 on inactive rows."""
    n_rows, vocab = logits.shape
    grad = torch.empty((n_rows, vocab), dtype=logits.dtype, device=logits.device)
    zero = torch.zeros((), dtype=lse.dtype, device=logits.device)

    def coef(g):
        return zero.expand(n_rows) if g is None else torch.where(mask, g, zero) / temperature

    c_logp, c_ent = coef(grad_logp), coef(grad_ent)
    for rows in row_chunks(n_rows, vocab, logits.device, lse.element_size()):
        t = temperature[rows] if isinstance(temperature, torch.Tensor) else temperature
        p, p_log_p = _rows.entropy_terms(XP, scaled_logits(logits[rows], mask[rows], t),
                                         lse[rows])
        d = (p_log_p + p * ent[rows, None]).mul_(-c_ent[rows, None])
        d.sub_(p * c_logp[rows, None])
        d.scatter_add_(1, ids[rows, None], c_logp[rows, None].contiguous())
        grad[rows] = keep_rows(d, mask[rows])
    return grad


def _fold_rows(fn):
    """A ``vmap`` staticmethod for a row-wise op whose tensor arguments and outputs all lead
    with the row axis ``N``: ``vmap``'s batch becomes more rows (``[B * N, ...]``; an
    unbatched argument is expanded to every example), the op runs once, and each output is
    reshaped back to ``[B, N, ...]``. The ops' forwards and backwards write row chunks into
    buffers, which a batched tensor cannot enter: they only ever see plain tensors."""

    def vmap(info, in_dims, *args):
        batch = info.batch_size
        # N: the first tensor's leading axis once the batch axis (``d``) is set aside.
        rows = next(a.shape[1 if d == 0 else 0] for a, d in zip(args, in_dims)
                    if isinstance(a, torch.Tensor))

        def fold(a, d):
            if not isinstance(a, torch.Tensor):
                return a
            a = a.expand(batch, *a.shape) if d is None else a.movedim(d, 0)
            return a.reshape(batch * rows, *a.shape[2:])

        out = fn(*(fold(a, d) for a, d in zip(args, in_dims)))
        unfold = lambda o: None if o is None else o.reshape(batch, rows, *o.shape[1:])  # noqa: E731
        if isinstance(out, tuple):
            return tuple(unfold(o) for o in out), (0,) * len(out)
        return unfold(out), 0

    return staticmethod(vmap)


class _RowsGrad(torch.autograd.Function):
    """``d / d logits`` of ``sum(grad_logp * logp + grad_ent * entropy)`` (``[N, V]``, the
    logits' dtype) as an op of its own, so that a backward run under ``torch.func.vmap``
    (per-example gradients) folds the batch into rows. Not differentiable again."""

    @staticmethod
    def forward(logits, ids, mask, temperature, lse, ent, grad_logp, grad_ent):
        if grad_ent is None:
            return _backward(logits, ids, mask, temperature, lse, grad_logp)
        return _entropy_backward(logits, ids, mask, temperature, lse, ent, grad_logp,
                                 grad_ent)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("ratiokl's native log-prob gradient is not differentiable again "
                           "(no double backward)")

    vmap = _fold_rows(forward.__func__)


def _rows_grad(ctx, grad_logp, grad_ent=None):
    """The two Functions' backward: None when no output is used (gradcheck's undefined
    output gradients); an unused output's term is skipped."""
    if grad_logp is None and grad_ent is None:
        return None, None, None, None, None
    saved = ctx.saved_tensors
    logits, ids, mask, lse, ent = saved[:5]
    temperature = saved[5] if len(saved) == 6 else ctx.temperature
    grad = _RowsGrad.apply(logits, ids, mask, temperature, lse, ent, grad_logp, grad_ent)
    return grad, None, None, None, None


def _save(ctx, inputs, lse, ent) -> None:
    logits, ids, mask, temperature, _ = inputs
    saved = (logits, ids, mask, lse, ent)
    if isinstance(temperature, torch.Tensor):
        saved = saved + (temperature,)
    else:
        ctx.temperature = temperature
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


class _LogprobEntropy(torch.autograd.Function):
    """``(logp[N], entropy[N], lse[N])`` from ``logits[N, V]``; the backward sums both terms
    (an unused output's gradient is None: its term is skipped; both None: no gradient).
    ``setup_context`` and the row-folding ``vmap``: ``torch.func`` transforms it."""

    @staticmethod
    def forward(logits, ids, mask, temperature, bad):
        logp, lse, ent = _forward(logits, ids, mask, temperature, bad, entropy=True)
        return logp, ent, lse

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _save(ctx, inputs, output[2], output[1])

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        return _rows_grad(ctx, grad_logp, grad_ent)

    vmap = _fold_rows(forward.__func__)


class _SelectedLogprob(torch.autograd.Function):
    """``(logp[N], lse[N])`` from ``logits[N, V]`` with the analytic, chunked backward;
    ``setup_context`` and the row-folding ``vmap``: ``torch.func`` transforms it."""

    @staticmethod
    def forward(logits, ids, mask, temperature, bad):
        logp, lse, _ = _forward(logits, ids, mask, temperature, bad)
        return logp, lse

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _save(ctx, inputs, output[1], output[1])  # the entropy's slot: a placeholder

    @staticmethod
    def backward(ctx, grad_logp, _grad_lse):
        return _rows_grad(ctx, grad_logp)

    vmap = _fold_rows(forward.__func__)


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
    safe_ids, bad = _rows.safe_ids(XP, ids, mask, vocab)
    if isinstance(temperature, torch.Tensor):
        temperature = torch.where(mask, temperature, torch.ones_like(temperature))
    return safe_ids.long(), temperature, bad


def selected_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
) -> torch.Tensor:
    """``logp[N]`` (float32; float64 for float64 logits) of ``logits[N, V]``;
    differentiable w.r.t. ``logits``."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, logits.shape[1])
    return _SelectedLogprob.apply(logits, safe_ids, mask, temp, bad)[0]


def logprobs_entropy(
    logits: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor,
    temperature: Temperature,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(logp[N], entropy[N])`` (float32; float64 for float64 logits) of ``logits[N, V]``;
    differentiable w.r.t. ``logits``."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, logits.shape[1])
    return _LogprobEntropy.apply(logits, safe_ids, mask, temp, bad)[:2]


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
    """``(ratio[N], kl[N])`` (float32; float64 for float64 policy logits); differentiable
    w.r.t. ``policy`` only."""
    safe_ids, temp, bad = _prepare_rows(ids, mask, temperature, policy.shape[1])
    logp = _SelectedLogprob.apply(policy, safe_ids, mask, temp, bad)[0]
    return _rows.ratio_kl(XP.for_dtype(policy.dtype), logp,
                          lambda: _SelectedLogprob.apply(ref.detach(), safe_ids, mask, temp,
                                                         bad)[0],
                          ref_logps, old_logps, mask, kl_code)
