"""Float64 reference of the optimal token baseline (verl's ``optimal_token_baseline`` and
``tir_optimal_token_baseline``), with the conventions of :mod:`ratiokl.spec.advantages`.

Per response token ``t`` of sample ``i``: the return ``G_t`` (the sum of the rewards of
the unmasked tokens from ``t`` on), the path-variance weight ``w_t = (1 - 2 pi_t +
sum_pi_squared_t) rho_t^2`` (``pi_t = exp(old_logp_t)``; ``rho``: the rollout
importance weights, 1 without them) and its running sum ``W_t`` over the unmasked tokens.
Within a group, the baseline at step ``k`` is

    b_k = sum_i G_ik W_ik / (sum_i W_ik + eps)

over the group's members that have a step ``k``, and the advantage ``G_ik - b_k``. A step is
the position ``t`` itself (``align="position"``) or, for masks with gaps (multi-turn
responses with tool output between the turns), the rank of the token among its row's
unmasked ones (``align="active"``). Members: the valid samples, and with
``align="active"`` only those with an unmasked token (verl's two functions differ there).
A group of one member has baseline 0 (advantage = return). ``zero_tail``: where a single
member is the longest, its baseline is 0 from the second longest member's length on.
Masked positions and invalid samples get 0.
"""

from __future__ import annotations

from typing import Literal, Tuple

import numpy as np

__all__ = ["ALIGNS", "Align", "reference_optimal_token_baseline"]

Align = Literal["position", "active"]
ALIGNS: Tuple[str, ...] = ("position", "active")


def _steps(m: np.ndarray, align: str) -> np.ndarray:
    """Each position's step: ``t``, or its rank among the row's unmasked positions."""
    if align == "position":
        return np.broadcast_to(np.arange(m.shape[1]), m.shape)
    return np.cumsum(m, axis=1) - 1


def reference_optimal_token_baseline(rewards, mask, old_logps, sum_pi_squared,
                                     group_ids=None, *, group_size=None, valid=None,
                                     is_weights=None, align="position", zero_tail=True,
                                     eps=1e-8) -> Tuple[np.ndarray, np.ndarray]:
    """``(advantages, returns)`` ``[B, T]``, float64; 0 on masked positions."""
    m = np.asarray(mask, bool)
    n, width = m.shape
    r = np.where(m, np.asarray(rewards, np.float64), 0.0)
    returns = np.where(m, np.cumsum(r[:, ::-1], axis=1)[:, ::-1], 0.0)
    pi = np.exp(np.asarray(old_logps, np.float64))
    w = 1.0 - 2.0 * pi + np.asarray(sum_pi_squared, np.float64)
    if is_weights is not None:
        w = w * np.asarray(is_weights, np.float64) ** 2
    big_w = np.cumsum(np.where(m, w, 0.0), axis=1)
    ids = np.asarray(group_ids).reshape(-1) if group_ids is not None else (
        np.arange(n) // int(group_size))
    ok = np.ones(n, bool) if valid is None else np.asarray(valid, bool).reshape(-1)
    lengths = m.sum(axis=1)
    member = ok & ((lengths > 0) if align == "active" else True)
    step = _steps(m, align)
    adv = np.zeros((n, width))
    for g in np.unique(ids[member]):
        rows = np.flatnonzero((ids == g) & member)
        num, den = np.zeros(width), np.zeros(width)
        for i in rows:
            on = m[i]
            np.add.at(num, step[i][on], returns[i][on] * big_w[i][on])
            np.add.at(den, step[i][on], big_w[i][on])
        base = num / (den + eps) if rows.size > 1 else np.zeros(width)
        ordered = np.sort(lengths[rows])
        for i in rows:
            b = base.copy()
            longest = lengths[i] == ordered[-1] and (lengths[rows] == ordered[-1]).sum() == 1
            if zero_tail and rows.size > 1 and longest:
                b[ordered[-2]:] = 0.0
            on = m[i]
            adv[i][on] = returns[i][on] - b[step[i][on]]
    return adv, returns
