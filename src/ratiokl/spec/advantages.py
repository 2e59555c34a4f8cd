r"""Float64 NumPy reference of the advantage estimators, and their option tables.

Written for clarity (a loop over groups, a loop over time), not speed; every backend of
both frameworks' ``advantages`` module is tested against these functions.

Group estimators take per-sequence scores ``x [B]`` and a group per sample (``group_ids
[B]``, any integers in any order, or ``group_size``: consecutive groups of that size).
Only *valid* samples (``valid [B]``, default all) enter any statistic; an invalid sample's
advantage is 0 whatever its score holds. With :math:`G` a group's valid samples,
:math:`n = |G|`, :math:`\bar x = \frac1n\sum_G x_j`:

* GRPO: :math:`a_i = (x_i - \bar x) / (s + \epsilon)`, ``scale="group"``: :math:`s` the
  group's std (``std="unbiased"``: :math:`n - 1` in the denominator, ``"population"``:
  :math:`n`); ``"batch"``: the std of every valid score of the batch; ``"none"``:
  :math:`a_i = x_i - \bar x` (Dr. GRPO).
* RLOO: :math:`a_i = x_i - \frac{1}{n-1}\sum_{j \ne i} x_j = \frac{n}{n-1}(x_i - \bar x)`.
* REINFORCE++-baseline: :math:`x_i - \bar x`, then whitened over the batch.
* OPO: :math:`a_i = x_i - \sum_G \ell_j x_j / \sum_G \ell_j` (``lengths`` :math:`\ell`).
* GRPO pass@k: the group's best sample gets :math:`(x_{(1)} - x_{(2)}) / (s + \epsilon)`
  (first minus second largest; ``scale="none"``: undivided), every other sample 0.
* GPG: :math:`a_i = \alpha (x_i - \bar x) / f`, :math:`\alpha` = valid samples / valid
  non-zero scores.
* GDPO: GRPO on each of ``K`` scores ``[B, K]`` apart, summed with ``weights``, whitened.

Edge cases (named conventions):

* ``singleton="score"`` (verl): a group with one valid sample has mean 0 and std 1, so
  GRPO gives :math:`x / (1 + \epsilon)`, RLOO / REINFORCE++-baseline :math:`x`;
  ``"zero"`` (TRL, verl's ``rloo_vectorized``): its advantage is 0.
* A group whose valid scores are all equal has advantage exactly 0 (the mean is taken
  about a member of the group, so no rounding is left to divide by :math:`\epsilon`).
* Active errors: a NaN or infinite score in a valid sample makes its own group's
  advantages NaN and nothing else; batch statistics (``scale="batch"``, whitening) leave
  such groups out.

Whitening over the batch (``whiten``), each valid sample weighted by its ``lengths`` (its
number of tokens: verl and OpenRLHF whiten over tokens; default 1): with :math:`N` the
total weight, :math:`m` the weighted mean and :math:`v` the weighted mean square about it,
``"unbiased"`` (verl's ``masked_whiten``) gives :math:`(x - m) / \sqrt{v N/(N-1) + 10^{-8}}`,
``"population"`` (OpenRLHF) :math:`(x - m) / \sqrt{\max(v, 10^{-8})}`; fewer than two
tokens: :math:`v` itself.

GAE on token-level ``rewards``, ``values`` and ``mask [B, T]``, backwards in time, skipping
masked positions as verl skips observation tokens (neither their value nor their TD error
enters; the recursion carries over them):

.. math::

    \delta_t = r_t + \gamma V_{\mathrm{next}} - V_t, \qquad
    A_t = \delta_t + \gamma\lambda A_{\mathrm{next}}, \qquad R_t = A_t + V_t

with :math:`V_{\mathrm{next}}`, :math:`A_{\mathrm{next}}` those of the next unmasked
position (0 past the end); masked positions give 0. REINFORCE++ is the same recursion
with :math:`V = 0`, :math:`\lambda = 1` (discounted returns). The advantages are then
whitened over the unmasked tokens (``whiten``).
"""

from __future__ import annotations

from typing import Literal, Sequence, Tuple

import numpy as np

__all__ = ["GROUP_SCALES", "GROUP_STDS", "SINGLETONS", "WHITENINGS", "GroupScale",
           "GroupStd", "Singleton", "Whitening", "WHITEN_EPS", "check_choice",
           "reference_gae", "reference_gdpo", "reference_gpg", "reference_grpo",
           "reference_grpo_passk", "reference_opo", "reference_reinforce_pp",
           "reference_reinforce_pp_baseline", "reference_rloo", "reference_whiten"]

GroupStd = Literal["unbiased", "population"]
GroupScale = Literal["group", "batch", "none"]
Singleton = Literal["score", "zero"]
Whitening = Literal["unbiased", "population", "none"]

GROUP_STDS: Tuple[str, ...] = ("unbiased", "population")
GROUP_SCALES: Tuple[str, ...] = ("group", "batch", "none")
SINGLETONS: Tuple[str, ...] = ("score", "zero")
WHITENINGS: Tuple[str, ...] = ("unbiased", "population", "none")

#: The variance floor of whitening (verl adds it, OpenRLHF clamps to it).
WHITEN_EPS = 1e-8


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {listed}; got {value!r}")


def _groups(n: int, group_ids, group_size) -> np.ndarray:
    if group_ids is not None:
        return np.asarray(group_ids).reshape(-1)
    return np.arange(n) // int(group_size)


def _valid(n: int, valid) -> np.ndarray:
    return np.ones(n, bool) if valid is None else np.asarray(valid, bool).reshape(-1)


def _members(ids, valid):
    """(group's valid member indices) for each group id that has valid members."""
    for g in np.unique(ids[valid]) if valid.any() else []:
        yield np.flatnonzero((ids == g) & valid)


def _std(x: np.ndarray, std: str) -> float:
    ddof = 1 if std == "unbiased" and x.size > 1 else 0
    return float(np.std(x, ddof=ddof))


def _group_centered(x, ids, valid, singleton):
    """x - group mean (singleton "score": the score itself) and the member lists."""
    out = np.zeros_like(x)
    groups = list(_members(ids, valid))
    for j in groups:
        out[j] = x[j] if (j.size == 1 and singleton == "score") else x[j] - x[j].mean()
    return out, groups


def _poisoned(x, groups) -> np.ndarray:
    """Valid members of groups holding a non-finite score."""
    bad = np.zeros(x.shape, bool)
    for j in groups:
        if not np.isfinite(x[j]).all():
            bad[j] = True
    return bad


def reference_whiten(x, weights, whiten: str) -> np.ndarray:
    """Weighted whitening of ``x [B]`` (``weights`` 0: left out, output 0)."""
    x = np.asarray(x, np.float64)
    w = np.asarray(weights, np.float64)
    used = w > 0
    if whiten == "none" or not used.any():
        return np.where(used, x, 0.0)
    total = w[used].sum()
    mean = (w[used] * x[used]).sum() / total
    var = (w[used] * (x[used] - mean) ** 2).sum() / total
    if whiten == "unbiased":
        var = (var * total / (total - 1) if total > 1 else var) + WHITEN_EPS
    else:
        var = max(var, WHITEN_EPS)
    return np.where(used, (x - mean) / np.sqrt(var), 0.0)


def reference_grpo(scores, group_ids=None, *, group_size=None, valid=None, std="unbiased",
                   scale="group", eps=1e-6, singleton="score") -> np.ndarray:
    """GRPO's advantages ``[B]`` (float64); see the module docstring."""
    x = np.asarray(scores, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    centered, groups = _group_centered(x, ids, ok, singleton)
    bad = _poisoned(x, groups)
    adv = np.zeros_like(x)
    for j in groups:
        if scale == "none":
            adv[j] = centered[j]
        elif scale == "group":
            if j.size == 1:
                s = 1.0 if singleton == "score" else 0.0
            else:
                s = _std(x[j], std)
            adv[j] = centered[j] / (s + eps)
    if scale == "batch":
        kept = ok & ~bad
        s = _std(x[kept], std) if kept.any() else 0.0
        adv = np.where(ok, centered / (s + eps), 0.0)
    return np.where(bad, np.nan, adv)


def reference_rloo(scores, group_ids=None, *, group_size=None, valid=None,
                   singleton="score") -> np.ndarray:
    """RLOO's advantages ``[B]``: each score minus the mean of its group's others."""
    x = np.asarray(scores, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    adv = np.zeros_like(x)
    groups = list(_members(ids, ok))
    for j in groups:
        if j.size == 1:
            adv[j] = x[j] if singleton == "score" else 0.0
        else:
            adv[j] = x[j] - (x[j].sum() - x[j]) / (j.size - 1)
    return np.where(_poisoned(x, groups), np.nan, adv)


def reference_reinforce_pp_baseline(scores, group_ids=None, *, group_size=None, valid=None,
                                    lengths=None, whiten="unbiased",
                                    singleton="score") -> np.ndarray:
    """REINFORCE++-baseline: the group-centred score, whitened over the batch."""
    x = np.asarray(scores, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    centered, groups = _group_centered(x, ids, ok, singleton)
    bad = _poisoned(x, groups)
    w = np.ones_like(x) if lengths is None else np.asarray(lengths, np.float64).reshape(-1)
    out = reference_whiten(np.where(bad, 0.0, centered), np.where(ok & ~bad, w, 0.0), whiten)
    return np.where(bad, np.nan, out)


def reference_opo(scores, group_ids=None, *, group_size=None, valid=None,
                  lengths=None) -> np.ndarray:
    """OPO: each score minus its group's length-weighted mean score (singleton: 0)."""
    x = np.asarray(scores, np.float64).reshape(-1)
    lens = np.asarray(lengths, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    adv = np.zeros_like(x)
    groups = list(_members(ids, ok))
    for j in groups:
        total = lens[j].sum()
        base = 0.0 if j.size == 1 else ((lens[j] * x[j]).sum() / total if total > 0
                                        else x[j].mean())
        adv[j] = x[j] - base
    return np.where(_poisoned(x, groups), np.nan, adv)


def reference_grpo_passk(scores, group_ids=None, *, group_size=None, valid=None,
                         std="unbiased", scale="group", eps=1e-6) -> np.ndarray:
    """GRPO pass@k: the best sample of each group of two or more gets best minus second
    best (over the group's std plus ``eps`` unless ``scale="none"``); ties give 0."""
    x = np.asarray(scores, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    adv = np.zeros_like(x)
    groups = list(_members(ids, ok))
    for j in groups:
        if j.size < 2:
            continue
        top = np.sort(x[j])[::-1]
        gap = top[0] - top[1]
        if scale != "none":
            gap = gap / (_std(x[j], std) + eps)
        adv[j[x[j] == top[0]]] = gap
    return np.where(_poisoned(x, groups), np.nan, adv)


def reference_gpg(scores, group_ids=None, *, group_size=None, valid=None,
                  f_norm=1.0) -> np.ndarray:
    """GPG: ``alpha * (x - group mean) / f_norm`` (singleton mean 0), ``alpha`` = valid
    samples over valid samples with a non-zero score (at least 1)."""
    x = np.asarray(scores, np.float64).reshape(-1)
    ids, ok = _groups(x.size, group_ids, group_size), _valid(x.size, valid)
    centered, groups = _group_centered(x, ids, ok, "score")
    alpha = ok.sum() / max(int(np.count_nonzero(x[ok])), 1)
    return np.where(_poisoned(x, groups), np.nan, alpha * centered / f_norm)


def reference_gdpo(scores, group_ids=None, *, group_size=None, valid=None, weights=None,
                   std="unbiased", eps=1e-6, singleton="score", lengths=None,
                   whiten="unbiased") -> np.ndarray:
    """GDPO: GRPO on each column of ``scores [B, K]``, summed with ``weights [K]``, then
    whitened over the batch (weighted by ``lengths``)."""
    x = np.asarray(scores, np.float64)
    k = x.shape[-1]
    w = np.ones(k) if weights is None else np.asarray(weights, np.float64)
    total = sum(w[c] * reference_grpo(x[:, c], group_ids, group_size=group_size, valid=valid,
                                      std=std, eps=eps, singleton=singleton)
                for c in range(k))
    ok = _valid(x.shape[0], valid)
    bad = ~np.isfinite(total) & ok
    lens = np.ones(x.shape[0]) if lengths is None else np.asarray(lengths, np.float64)
    out = reference_whiten(np.where(bad, 0.0, total), np.where(ok & ~bad, lens, 0.0), whiten)
    return np.where(bad, np.nan, out)


def _recursion(rewards, values, mask, gamma, lam) -> np.ndarray:
    r = np.asarray(rewards, np.float64)
    v = np.asarray(values, np.float64)
    m = np.asarray(mask, bool)
    adv = np.zeros_like(r)
    next_value = np.zeros(r.shape[0])
    next_adv = np.zeros(r.shape[0])
    for t in reversed(range(r.shape[1])):
        on = m[:, t]
        vt = np.where(on, v[:, t], 0.0)
        delta = np.where(on, r[:, t], 0.0) + gamma * next_value - vt
        a = delta + gamma * lam * next_adv
        adv[:, t] = np.where(on, a, 0.0)
        next_adv = np.where(on, a, next_adv)
        next_value = np.where(on, vt, next_value)
    return adv


def reference_gae(rewards, values, mask, gamma, lam,
                  whiten="unbiased") -> Tuple[np.ndarray, np.ndarray]:
    """GAE ``(advantages, returns)`` ``[B, T]``; 0 on masked positions."""
    m = np.asarray(mask, bool)
    adv = _recursion(rewards, values, m, gamma, lam)
    returns = np.where(m, adv + np.where(m, values, 0.0), 0.0)
    flat = reference_whiten(adv.reshape(-1), m.reshape(-1).astype(np.float64), whiten)
    return flat.reshape(adv.shape), returns


def reference_reinforce_pp(rewards, mask, gamma,
                           whiten="unbiased") -> Tuple[np.ndarray, np.ndarray]:
    """REINFORCE++ ``(advantages, returns)``: discounted returns, whitened over tokens."""
    zeros = np.zeros(np.shape(rewards))
    returns = _recursion(rewards, zeros, mask, gamma, 1.0)
    m = np.asarray(mask, bool)
    flat = reference_whiten(returns.reshape(-1), m.reshape(-1).astype(np.float64), whiten)
    return flat.reshape(returns.shape), returns

