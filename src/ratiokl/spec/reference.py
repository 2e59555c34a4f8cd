r"""Float64 NumPy reference of ratiokl's operator: the numeric spec.

Every backend of both frameworks is tested against these functions. They are
written for clarity, not speed, and hold the math in one place.

Definitions, per row :math:`i` of the leading shape ``[...]`` (vocabulary last), with
:math:`T_i` its temperature (:math:`0 < T_i < \infty`) and :math:`a_i` its sampled
action id:

.. math::

    z = \mathrm{logits}_i / T_i, \qquad
    \mathrm{lse} = \log \sum_v e^{z_v}, \qquad
    \log p = z_{a_i} - \mathrm{lse}

    \mathrm{ratio} = e^{\log p - \log p_\mathrm{old}}, \qquad
    d = \log p_\mathrm{ref} - \log p, \qquad
    \mathrm{kl} = \begin{cases} -d & \text{k1} \\ d^2 / 2 & \text{k2} \\
                  e^{d} - d - 1 & \text{k3} \end{cases}

Gradient with respect to the policy logits, for an upstream cotangent
``g_logp`` on the row's log-prob:

.. math::

    \frac{\partial \log p}{\partial\, \mathrm{logits}_v}
        = \frac{[v = a] - \mathrm{softmax}(z)_v}{T}, \qquad
    \frac{\partial\, \mathrm{ratio}}{\partial \log p} = \mathrm{ratio}, \qquad
    \frac{\partial\, \mathrm{kl}}{\partial \log p}
        = \begin{cases} 1 & \text{k1} \\ -d & \text{k2} \\ 1 - e^{d} & \text{k3}
          \end{cases}

so ``grad_logits[v] = c * (onehot(a)[v] - softmax(z)[v]) / T`` with the
per-row coefficient ``c = g_ratio * ratio + g_kl * dkl/dlogp``
(:mod:`ratiokl.spec.ratio`; the estimators: :mod:`ratiokl.spec.kl`).

The entropy of the row's (temperature-scaled) distribution :math:`p = \mathrm{softmax}(z)`:

.. math::

    H = -\sum_v p_v \log p_v = \mathrm{lse} - \sum_v p_v z_v, \qquad
    \frac{\partial H}{\partial\, \mathrm{logits}_v} = -\frac{p_v (\log p_v + H)}{T}

where a ``-inf`` logit (vocabulary masking) has ``p[v] = 0`` and contributes 0 to
both (never ``0 * -inf``). A NaN or ``+inf`` logit makes the entropy NaN, and its
gradient NaN across the row (``p[v] = 0`` entries too: ``0 * NaN``).

Inactive rows (``mask`` false) are neutral *by construction*: their inputs
are replaced before any arithmetic, so whatever they hold (NaN, +-inf,
out-of-range ids, NaN ``old_logp``) never reaches another value:
``logp = 0``, ``ratio = 1``, ``kl = 0``, gradient exactly ``0``.

Active rows keep their errors visible: a NaN logit gives NaN outputs and a
NaN gradient for that row only; ``-inf`` logits at tokens other than the
action are valid vocabulary masking; an action id outside ``[0, V)`` or a
temperature that is not positive and finite raises :class:`ValueError`
naming the first bad position (:func:`check_action_ids`,
:func:`check_temperatures`); unchecked (under ``jit``, ``check_ids=False``)
such a row is NaN, outputs and gradient.

References:
    J. Schulman, "Approximating KL Divergence" (2020) -- the k1/k2/k3
    estimators. J. Schulman et al., "Proximal Policy Optimization
    Algorithms" (2017) -- the importance ratio.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np


ArrayLike = Union[np.ndarray, float]

__all__ = [
    "check_action_ids",
    "check_temperatures",
    "entropy",
    "entropy_grad",
    "selected_logprobs",
    "selected_logprobs_grad",
]


def check_action_ids(action_ids: np.ndarray, mask: np.ndarray, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the first active position whose id is outside ``[0, V)``."""
    ids = np.asarray(action_ids)
    bad = np.asarray(mask, dtype=bool) & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"action_ids{list(pos)} = {int(ids[pos])} is outside [0, {vocab_size}) on an "
            "active row; fix the sampled ids or mark the row inactive in `mask`"
        )


def check_temperatures(temperature: ArrayLike, mask: np.ndarray) -> None:
    """Raise ``ValueError`` naming the first active position whose temperature is not in (0, inf)."""
    mask = np.asarray(mask, dtype=bool)
    t = np.broadcast_to(np.asarray(temperature, dtype=np.float64), mask.shape)
    with np.errstate(invalid="ignore"):
        bad = mask & ~((t > 0.0) & (t < np.inf))
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"temperature{list(pos)} = {float(t[pos])} on an active row; a temperature must "
            "be positive and finite (e.g. the sampler's 1.0)"
        )


def _row_temperature(temperature: ArrayLike, lead_shape: Tuple[int, ...]) -> np.ndarray:
    """Temperature as a float64 array of the leading shape (scalar broadcast).

    An entry that is not positive and finite becomes NaN: its row (if active)
    is poisoned, never a silently wrong distribution (``T <= 0`` flips or
    degenerates the softmax).
    """
    t = np.broadcast_to(np.asarray(temperature, dtype=np.float64), lead_shape)
    with np.errstate(invalid="ignore"):
        return np.where((t > 0.0) & (t < np.inf), t, np.nan)


def _isolate(logits, action_ids, mask, temperature):
    """Replace inactive rows' inputs with neutral values before any arithmetic.

    Returns float64 scaled logits ``z = logits / T`` (zero on inactive rows),
    in-range ids (0 on inactive rows), the boolean mask and ``T``.
    """
    logits = np.asarray(logits, dtype=np.float64)
    lead = logits.shape[:-1]
    mask = np.ones(lead, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    temp = np.where(mask, _row_temperature(temperature, lead), 1.0)
    z = np.where(mask[..., None], logits, 0.0) / temp[..., None]
    ids = np.where(mask, np.asarray(action_ids), 0).astype(np.int64)
    return z, ids, mask, temp


def _isolate_checked(logits, action_ids, mask, temperature):
    """:func:`_isolate` after :func:`check_action_ids` on the active rows (``mask=None``: all)."""
    logits = np.asarray(logits, dtype=np.float64)
    if mask is None:
        mask = np.ones(logits.shape[:-1], dtype=bool)
    check_action_ids(action_ids, mask, logits.shape[-1])
    return _isolate(logits, action_ids, mask, temperature)


def _logsumexp(z: np.ndarray) -> np.ndarray:
    """Row log-sum-exp, max-shifted; ``-inf`` entries contribute 0, NaN propagates."""
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.max(z, axis=-1)
        # A row of all -inf has no valid distribution: keep it NaN, never 0/0 silently.
        shift = np.where(np.isfinite(m), m, 0.0)
        s = np.sum(np.exp(z - shift[..., None]), axis=-1)
        return shift + np.log(s)


def selected_logprobs(
    logits: np.ndarray,
    action_ids: np.ndarray,
    mask: Optional[np.ndarray] = None,
    *,
    temperature: ArrayLike = 1.0,
) -> np.ndarray:
    """``logp = logits[a]/T - logsumexp(logits/T)`` per row, float64 ``[...]``; 0 on inactive rows."""
    z, ids, mask, _ = _isolate_checked(logits, action_ids, mask, temperature)
    with np.errstate(invalid="ignore", over="ignore"):
        z_sel = np.take_along_axis(z, ids[..., None], axis=-1)[..., 0]
        logp = z_sel - _logsumexp(z)
    return np.where(mask, logp, 0.0)


def _softmax_terms(z: np.ndarray):
    """``(p, p * log p, entropy)`` of rows ``z``; ``p = 0`` entries give exactly 0 terms."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        log_p = z - _logsumexp(z)[..., None]
        p = np.exp(log_p)
        p_log_p = np.where(p > 0.0, p * log_p, np.where(np.isnan(p), np.nan, 0.0))
        return p, log_p, -np.sum(p_log_p, axis=-1)


def entropy(
    logits: np.ndarray,
    mask: Optional[np.ndarray] = None,
    *,
    temperature: ArrayLike = 1.0,
) -> np.ndarray:
    """``-sum_v p log p`` of ``p = softmax(logits / T)`` per row, float64 ``[...]``; 0 on
    inactive rows (``-inf`` logits contribute 0; a NaN logit on an active row gives NaN)."""
    logits = np.asarray(logits, dtype=np.float64)
    lead = logits.shape[:-1]
    mask = np.ones(lead, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    z, _, mask, _ = _isolate(logits, np.zeros(lead, np.int64), mask, temperature)
    return np.where(mask, _softmax_terms(z)[2], 0.0)


def entropy_grad(
    logits: np.ndarray,
    mask: Optional[np.ndarray],
    grad_entropy: np.ndarray,
    *,
    temperature: ArrayLike = 1.0,
) -> np.ndarray:
    """Gradient of ``sum(grad_entropy * entropy)`` w.r.t. ``logits``: float64 ``[..., V]``.

    ``grad[v] = -g * p[v] (log p[v] + entropy) / T``; 0 where ``p[v] = 0`` (a ``-inf``
    logit) and exactly 0 on inactive rows. A row whose entropy is NaN (a NaN or ``+inf``
    logit) has a NaN gradient at every ``v``, ``p[v] = 0`` included, whatever ``g``.
    """
    logits = np.asarray(logits, dtype=np.float64)
    lead = logits.shape[:-1]
    mask = np.ones(lead, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    z, _, mask, temp = _isolate(logits, np.zeros(lead, np.int64), mask, temperature)
    g = np.where(mask, np.asarray(grad_entropy, dtype=np.float64), 0.0)
    p, log_p, ent = _softmax_terms(z)
    with np.errstate(invalid="ignore", over="ignore"):
        # p = 0 adds 0 * entropy: exactly 0, or NaN when the row's entropy is NaN.
        terms = np.where(p > 0.0, p * (log_p + ent[..., None]),
                         np.where(np.isnan(p), np.nan, 0.0 * ent[..., None]))
        grad = -(g / temp)[..., None] * terms
    return np.where(mask[..., None], grad, 0.0)


def selected_logprobs_grad(
    logits: np.ndarray,
    action_ids: np.ndarray,
    mask: Optional[np.ndarray],
    grad_logp: np.ndarray,
    *,
    temperature: ArrayLike = 1.0,
) -> np.ndarray:
    """Gradient of ``sum(grad_logp * logp)`` w.r.t. ``logits``: float64 ``[..., V]``.

    ``grad[v] = g * (onehot(a)[v] - softmax(logits/T)[v]) / T``; exactly 0 on inactive rows.
    """
    z, ids, mask, temp = _isolate_checked(logits, action_ids, mask, temperature)
    g = np.where(mask, np.asarray(grad_logp, dtype=np.float64), 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        softmax = np.exp(z - _logsumexp(z)[..., None])
        onehot = np.zeros_like(z)
        np.put_along_axis(onehot, ids[..., None], 1.0, axis=-1)
        grad = (g / temp)[..., None] * (onehot - softmax)
    return np.where(mask[..., None], grad, 0.0)
