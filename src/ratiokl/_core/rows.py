r"""The native backends' row math, written once for both frameworks.

Per row of scaled logits :math:`z = \mathrm{logits} / T` (float32 ``[N, V]``, inactive rows
already zero, ``T`` 1 there), three statistics -- the row max :math:`m`, the shifted sum
:math:`s = \sum_v e^{z_v - \mathrm{shift}(m)}` and the selected :math:`z_a` -- combine into

.. math::

    \mathrm{lse} = \mathrm{shift}(m) + \log s, \qquad \log p_a = z_a - \mathrm{lse}, \qquad
    H = -\sum_v p_v \log p_v, \quad p = e^{z - \mathrm{lse}},

with :math:`\mathrm{shift}(m) = m` where finite, else 0 (a row of all ``-inf`` keeps
``lse = -inf`` and ``logp = NaN``; a ``+inf`` logit gives ``lse = +inf``, as in the spec).
The vocabulary-parallel backends combine the same statistics across shards
(:func:`ownership`, :func:`shard_lse`, :func:`shard_entropy`) with their framework's
collectives. An active row whose id is outside ``[0, V)`` is poisoned (:func:`finish`): its
``lse``, outputs and gradient are NaN, checked or not.

What stays per framework: PyTorch's row chunks (a bounded float32 temporary) and both
frameworks' analytic backward (``torch.autograd.Function`` with in-place chunk updates,
``jax.custom_vjp``). ``xp`` is the framework's array adapter (:mod:`ratiokl._core`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from ratiokl._core.objective import token_ratio_kl

__all__ = ["bad_ids", "entropy_terms", "finish", "finite_shift", "log_sum_exp", "ownership",
           "ratio_kl", "row_values", "safe_ids", "shard_entropy", "shard_lse"]


def finite_shift(xp, m):
    """The max used to shift the exponentials: ``m`` where finite, 0 where ``+-inf`` / NaN
    (shifting by 0 leaves a non-finite ``lse`` visible instead of a ``0/0`` hiding it)."""
    return xp.where(xp.isfinite(m), m, xp.zeros_like(m))


def log_sum_exp(xp, m, s):
    """``lse`` ``[N]`` from one shard's row max ``m`` and shifted sum ``s`` (whole vocabulary)."""
    return finite_shift(xp, m) + xp.log(s)


def entropy_terms(xp, z, lse) -> Tuple[Any, Any]:
    """``(p, p * log p)`` of rows ``z`` ``[N, V]``; ``p * log p`` exactly 0 where ``p = 0`` (a
    ``-inf`` logit: never ``0 * -inf``) and NaN where ``p`` is NaN (a NaN or ``+inf`` logit
    in the row: its entropy is NaN, never a finite sum that skipped it)."""
    log_p = z - lse[:, None]
    p = xp.exp(log_p)
    return p, xp.where(p == 0.0, xp.zeros_like(p), p * log_p)


#: The lowest float32: a ``-inf`` shifted logit is raised to it before ``e * (z - shift)``,
#: so that its term is ``0 * lowest = 0``, never ``0 * -inf = NaN``.
_LOWEST = -3.4028234663852886e38


def row_values(xp, z, ids, entropy: bool) -> Tuple[Any, Any, Optional[Any]]:
    """``(lse, z_a, H | None)`` float32 ``[N]`` of scaled rows ``z`` ``[N, V]`` and in-range
    ``ids`` ``[N]`` (``H`` with ``entropy``): the statistics and their combine.

    ``z`` is a temporary: it may be overwritten. One exponential per logit serves both the
    normaliser and the entropy: with ``d = z - shift(m)`` and ``e = exp(d)``,
    ``s = sum e`` and ``H = log s - sum(e d) / s`` (``= lse - E_p[z]``, as
    :func:`shard_entropy`). A ``-inf`` logit adds 0 to both sums; a NaN or ``+inf`` one
    makes ``s`` (so ``lse``) or ``H`` NaN, as the spec's ``-sum p log p`` does.
    """
    m = xp.max(z, axis=-1)
    z_a = xp.take(z, ids[:, None])[:, 0]
    shift = finite_shift(xp, m)
    d = xp.sub_temporary(z, shift[:, None])
    if not entropy:
        return log_sum_exp(xp, m, xp.sum(xp.exp_temporary(d), axis=-1)), z_a, None
    s, h = xp.exp_sums(xp.maximum_temporary(d, _LOWEST))  # NaN stays NaN
    return log_sum_exp(xp, m, s), z_a, shard_entropy(xp, s, h)


def bad_ids(ids, mask, vocab: int):
    """Bool ``[N]``: the active rows whose id is outside ``[0, vocab)``, which every backend
    poisons with NaN and the host check (``check_ids``) names."""
    return mask & ((ids < 0) | (ids >= vocab))


def safe_ids(xp, ids, mask, vocab: int) -> Tuple[Any, Any]:
    """``(ids, bad)``: ids clamped into ``[0, V)`` (0 on inactive rows), and the active rows
    whose id is out of range (to poison)."""
    bad = bad_ids(ids, mask, vocab)
    return xp.clip(xp.where(mask, ids, xp.zeros_like(ids)), 0, vocab - 1), bad


def finish(xp, mask, bad, lse, z_a, ent) -> Tuple[Any, Any, Optional[Any]]:
    """``(logp, lse, H | None)``: ``bad`` rows poisoned with NaN (``lse`` too, so their
    gradient), then ``logp = z_a - lse`` and ``H`` selected to 0 on inactive rows."""
    nan = float("nan")
    lse = xp.where(bad, nan, lse)
    zero = xp.zeros_like(lse)
    logp = xp.where(mask, z_a - lse, zero)
    return logp, lse, None if ent is None else xp.where(mask, xp.where(bad, nan, ent), zero)


def ratio_kl(xp, logp, ref_logp: Callable[[], Any], ref_logps, old_logps, mask,
             kl_code: int) -> Tuple[Any, Any]:
    """``(ratio, kl)`` float32 ``[N]`` from the policy's ``logp``, differentiable through it
    only; the reference log-prob is ``ref_logps`` or, when None, ``ref_logp()`` (computed
    without a gradient)."""
    if ref_logps is None:
        with xp.no_grad():
            ref_logps = ref_logp()
    return token_ratio_kl(xp, logp, xp.stop_gradient(ref_logps),
                          xp.stop_gradient(old_logps), mask, kl_code)


def ownership(xp, ids, mask, start, local_vocab: int, vocab) -> Tuple[Any, Any, Any]:
    """``(local ids, owned, bad)`` ``[N]`` of a shard holding global columns
    ``[start, start + local_vocab)`` of a ``vocab``-wide vocabulary: the ids relative to
    the shard (0 where not owned), whether an active row's action lies in it, and the
    active rows whose id is outside ``[0, vocab)``."""
    local = ids - start
    owned = mask & (local >= 0) & (local < local_vocab)
    bad = bad_ids(ids, mask, vocab)
    return xp.where(owned, local, xp.zeros_like(local)), owned, bad


def shard_lse(xp, shift, total):
    """The global ``lse = shift(M) + log(S)`` from the shards' summed ``S``."""
    return shift + xp.log(total)


def shard_entropy(xp, total, h):
    """``H = log(S) - h / S`` (``= lse - E_p[z]``), ``h`` the shards' summed
    ``sum_v e^{z_v - shift} (z_v - shift)``."""
    return xp.log(total) - h / total
