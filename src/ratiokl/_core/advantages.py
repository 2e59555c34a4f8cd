"""The advantage estimators, written once for both frameworks.

The math and the conventions are ``ratiokl.spec.advantages``'s (its module docstring).
Everything here is float32 ``[B]`` (group estimators) or ``[B, T]`` (GAE), computed
through the framework's array adapter ``xp`` (:mod:`ratiokl._core`) without host
synchronisation, so it traces under ``jax.jit`` and ``torch.compile``.

Groups: arbitrary integer ids are compacted to ``0 .. S-1`` by one stable sort (``S <= B``
segments, a static count: no unique, no data-dependent shape); ``group_size`` gives them
directly. Group sums and maxima are deterministic on every device: no scatter-add (CUDA's
atomics add in the order they land, and so do ``index_add_`` and ``segment_sum`` there).
The samples are laid out by group (the stable sort), each group reduced by a segmented
inclusive scan of recursive doubling (``log2 B`` steps of whole-array ops, the GAE scan's
method) and its total read at the group's last position. A group's total depends on its
own samples in their order alone: the same bits whatever the other groups hold or however
the batch interleaves them. The batch statistics (GRPO's ``scale="batch"``, whitening)
sum in that group order too.

Invalid samples and masked tokens are replaced by 0 with ``where`` before any arithmetic,
so whatever they hold (NaN, inf) reaches no statistic. A group's mean is taken about a
pivot (its largest valid score): equal scores give a centred value of exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ratiokl.spec.advantages import WHITEN_EPS

__all__ = ["Groups", "GroupStats", "gae_elements", "group_max", "group_stats", "group_sum",
           "groups", "grpo", "grpo_passk", "gpg", "opo", "reinforce_pp_baseline",
           "optimal_token_baseline", "reverse_scan", "rloo", "scan_combine", "whiten",
           "whiten_groups", "whiten_tokens"]


@dataclass(frozen=True)
class Groups:
    """The batch laid out by group, all ``[B]`` integer arrays: ``order`` (the samples
    sorted by group, stable) and its inverse ``rank`` (each sample's position in that
    layout); per position of the layout, ``start`` (its group's first position) and
    ``last`` per sample (its group's last position)."""

    order: Any
    rank: Any
    start: Any
    last: Any


def groups(xp, ids, group_size: Optional[int], n: int, like) -> Groups:
    """Groups from ``ids [B]`` (any integers, any order) or consecutive ``group_size``.
    Integer arithmetic only: exact, whatever the order it runs in."""
    pos = xp.as_index(xp.positions(like))
    if ids is None:
        start = pos - pos % group_size  # group_size divides B (checked)
        return Groups(pos, pos, start, start + group_size - 1)
    order = xp.argsort(ids)
    ordered = ids[order]
    starts = (ordered != xp.shift(ordered, 1, 0)) | (pos == 0)
    ends = (ordered != xp.shift(ordered, -1, 0)) | (pos == n - 1)
    rank = xp.unpermute(pos, order)
    start = xp.cummax(xp.where(starts, pos, 0))
    end = xp.reverse_cummin(xp.where(ends, pos, n - 1))
    return Groups(order, rank, start, xp.gather(end, rank))


def _group_scan(xp, values, seg: Groups, combine, fill: float):
    """The inclusive scan of ``combine`` within each group over the first axis of
    ``values [B, ...]``, in the group layout: after the step of width ``w`` each position
    holds its group's last ``2w`` values combined."""
    flip = (lambda a: a) if values.ndim == 1 else (lambda a: a.T)  # noqa: E731 (B last)
    x = flip(xp.gather(values, seg.order))
    pos = xp.as_index(xp.positions(x))
    width = 1
    while width < pos.shape[-1]:
        x = xp.where(pos - width >= seg.start, combine(x, xp.shift(x, width, fill)), x)
        width *= 2
    return flip(x)


def group_sum(xp, values, seg: Groups):
    """Each sample's group's sum of ``values [B]`` or ``[B, T]`` (per position)
    (deterministic: see the module)."""
    return xp.gather(_group_scan(xp, values, seg, lambda a, b: a + b, 0.0), seg.last)


def group_max(xp, values, seg: Groups):
    """Each sample's group's maximum of ``values [B]`` (a NaN gives its group an
    unspecified value: the callers mark such a group bad)."""
    larger = lambda a, b: xp.where(b > a, b, a)  # noqa: E731
    return xp.gather(_group_scan(xp, values, seg, larger, -float("inf")), seg.last)


def _in_group_order(xp, seg: Groups, *arrays):
    """``arrays`` in the group layout, so that a batch sum adds in that order."""
    return tuple(xp.gather(a, seg.order) for a in arrays)


def whiten_groups(xp, x, weights, kind: str, seg: Groups):
    """:func:`whiten` with its batch sums in the group layout (see the module)."""
    return xp.gather(whiten(xp, *_in_group_order(xp, seg, x, weights), kind), seg.rank)


@dataclass(frozen=True)
class GroupStats:
    """Per sample (``[B]``, float32): the group's valid count, the score minus the group
    mean (0 for invalid samples), the group's sum of squares about its mean, and whether
    the group holds a non-finite valid score."""

    count: Any
    centered: Any
    squares: Any
    bad: Any


def group_stats(xp, x, valid, seg: Groups) -> GroupStats:
    """The statistics of each sample's group over its valid samples."""
    count = group_sum(xp, xp.as_float(valid), seg)
    kept = xp.where(valid, x, 0.0)
    bad = ~xp.isfinite(group_sum(xp, kept, seg)) & valid
    # A non-finite score makes its group bad: the pivot need not be right there.
    finite = valid & xp.isfinite(kept)
    pivot = group_max(xp, xp.where(finite, kept, -float("inf")), seg)
    d = xp.where(valid, kept - xp.where(valid, pivot, 0.0), 0.0)
    mean_d = group_sum(xp, d, seg) / xp.maximum(count, 1.0)
    centered = xp.where(valid, d - mean_d, 0.0)
    squares = group_sum(xp, centered * centered, seg)
    return GroupStats(count, centered, squares, bad)


def _singleton_score(xp, x, valid, stats: GroupStats, singleton: str):
    """The centred score with the singleton convention: ``"score"`` (mean 0) keeps the
    score of a group's only valid sample, ``"zero"`` its centred value (0)."""
    single = valid & (stats.count == 1.0)
    if singleton == "score":
        return xp.where(single, xp.where(valid, x, 0.0), stats.centered), single
    return stats.centered, single


def _std(xp, squares, count, std: str):
    ddof = 1.0 if std == "unbiased" else 0.0
    return (squares / xp.maximum(count - ddof, 1.0)) ** 0.5


def _finish(xp, adv, valid, bad):
    """0 for invalid samples, NaN for the valid samples of a group with a bad score."""
    return xp.where(bad, float("nan"), xp.where(valid, adv, 0.0))


def _batch_moments(xp, x, weights):
    """Weighted mean and mean square about it over ``weights > 0``, and the total weight."""
    used = weights > 0
    w = xp.where(used, weights, 0.0)
    total = xp.sum(w)
    safe = xp.where(total > 0, total, 1.0)
    kept = xp.where(used, x, 0.0)
    mean = xp.sum(w * kept) / safe
    centered = xp.where(used, kept - mean, 0.0)
    return mean, xp.sum(w * centered * centered) / safe, total


def whiten(xp, x, weights, kind: str):
    """``ratiokl.spec.reference_whiten``: weighted whitening, 0 where ``weights`` is 0."""
    used = weights > 0
    if kind == "none":
        return xp.where(used, x, 0.0)
    mean, var, total = _batch_moments(xp, x, weights)
    if kind == "unbiased":
        var = xp.where(total > 1, var * total / xp.where(total > 1, total - 1, 1.0), var)
        var = var + WHITEN_EPS
    else:
        var = xp.maximum(var, WHITEN_EPS)
    return xp.where(used, (xp.where(used, x, 0.0) - mean) / var ** 0.5, 0.0)


def grpo(xp, x, valid, seg: Groups, std: str, scale: str, eps: float, singleton: str):
    """GRPO (``scale`` group / batch / none) on float32 ``x [B]``."""
    stats = group_stats(xp, x, valid, seg)
    centered, single = _singleton_score(xp, x, valid, stats, singleton)
    if scale == "none":
        return _finish(xp, centered, valid, stats.bad)
    if scale == "group":
        s = _std(xp, stats.squares, stats.count, std)
        if singleton == "score":
            s = xp.where(single, 1.0, s)
        return _finish(xp, centered / (s + eps), valid, stats.bad)
    kept = valid & ~stats.bad
    _, var, total = _batch_moments(xp, *_in_group_order(xp, seg, x, xp.as_float(kept)))
    ddof = 1.0 if std == "unbiased" else 0.0
    s = (var * total / xp.maximum(total - ddof, 1.0)) ** 0.5
    return _finish(xp, centered / (s + eps), valid, stats.bad)


def rloo(xp, x, valid, seg: Groups, singleton: str):
    """RLOO: ``n / (n - 1)`` times the centred score (singleton by ``singleton``)."""
    stats = group_stats(xp, x, valid, seg)
    centered, single = _singleton_score(xp, x, valid, stats, singleton)
    n = stats.count
    adv = xp.where(single, centered, centered * n / xp.maximum(n - 1.0, 1.0))
    return _finish(xp, adv, valid, stats.bad)


def reinforce_pp_baseline(xp, x, valid, seg: Groups, lengths, whitening: str,
                          singleton: str):
    """The group-centred score, whitened over the batch with weights ``lengths``."""
    stats = group_stats(xp, x, valid, seg)
    centered, _ = _singleton_score(xp, x, valid, stats, singleton)
    kept = valid & ~stats.bad
    out = whiten_groups(xp, centered, xp.where(kept, lengths, 0.0), whitening, seg)
    return _finish(xp, out, valid, stats.bad)


def opo(xp, x, valid, seg: Groups, lengths):
    """OPO: the score minus its group's length-weighted mean (singleton: the score)."""
    stats = group_stats(xp, x, valid, seg)
    lens = xp.where(valid, lengths, 0.0)
    # Lengths times the centred score: the weighted mean about the group mean.
    weighted = group_sum(xp, lens * stats.centered, seg)
    total = group_sum(xp, lens, seg)
    base = xp.where(total > 0, weighted / xp.where(total > 0, total, 1.0), 0.0)
    adv = xp.where(stats.count == 1.0, xp.where(valid, x, 0.0), stats.centered - base)
    return _finish(xp, adv, valid, stats.bad)


def grpo_passk(xp, x, valid, seg: Groups, std: str, scale: str, eps: float):
    """Pass@k: the group's best sample(s) get best minus second best, others 0."""
    stats = group_stats(xp, x, valid, seg)
    low = -float("inf")
    kept = xp.where(valid, x, low)
    best = group_max(xp, kept, seg)
    is_best = valid & (kept == best)
    ties = group_sum(xp, xp.as_float(is_best), seg)
    second = group_max(xp, xp.where(is_best, low, kept), seg)
    gap = xp.where(ties > 1.0, 0.0, xp.where(is_best, best, 0.0) - xp.where(is_best, second, 0.0))
    if scale != "none":
        gap = gap / (_std(xp, stats.squares, stats.count, std) + eps)
    adv = xp.where(is_best & (stats.count >= 2.0), gap, 0.0)
    return _finish(xp, adv, valid, stats.bad)


def gpg(xp, x, valid, seg: Groups, f_norm: float):
    """GPG: ``alpha * (x - group mean) / f_norm``, singleton mean 0."""
    stats = group_stats(xp, x, valid, seg)
    centered, _ = _singleton_score(xp, x, valid, stats, "score")
    nonzero = xp.sum(xp.as_float(valid & (x != 0)))
    alpha = xp.sum(xp.as_float(valid)) / xp.maximum(nonzero, 1.0)
    return _finish(xp, alpha * centered / f_norm, valid, stats.bad)


# --- GAE: a reverse scan of affine maps --------------------------------------------------
#
# One step backwards in time maps the carried state (A, V) -- the advantage and value of
# the next unmasked position -- to (p A + q V + u, s V + w): an unmasked position is
# (p, q, s, u, w) = (gamma lam, gamma, 0, r - v, v), a masked one the identity
# (1, 0, 1, 0, 0). Composing maps is associative, so A_t is one scan over T (a reverse
# inclusive scan of compositions applied to the state (0, 0): A_t = u of the composite).


def gae_elements(xp, rewards, values, mask, gamma: float, lam: float):
    """The per-position maps ``(p, q, s, u, w)``, float32 ``[B, T]`` each."""
    r = xp.where(mask, xp.as_float(rewards), 0.0)
    v = xp.where(mask, xp.as_float(values), 0.0)
    one, zero = xp.as_float(xp.ones_like(mask)), xp.as_float(xp.zeros_like(mask))
    return (xp.where(mask, gamma * lam, one), xp.where(mask, gamma, zero),
            xp.where(mask, 0.0, one), r - v, v)


def scan_combine(outer, inner):
    """``outer`` after ``inner`` (``inner`` applied first): the composed map."""
    p1, q1, s1, u1, w1 = outer
    p2, q2, s2, u2, w2 = inner
    return (p1 * p2, p1 * q2 + q1 * s2, s1 * s2, p1 * u2 + q1 * w2 + u1, s1 * w2 + w1)


def reverse_scan(xp, elements) -> Tuple[Any, ...]:
    """The reverse inclusive scan of :func:`scan_combine` along the last axis, by
    recursive doubling (``log2 T`` steps of whole-array ops)."""
    identity = (1.0, 0.0, 1.0, 0.0, 0.0)
    width = elements[0].shape[-1]
    step = 1
    while step < width:
        later = tuple(xp.shift(e, -step, fill) for e, fill in zip(elements, identity))
        elements = scan_combine(elements, later)
        step *= 2
    return elements


def whiten_tokens(xp, x, mask, whitening: str):
    """:func:`whiten` of ``[B, T]`` values over the unmasked tokens (0 where masked)."""
    flat = whiten(xp, x.reshape(-1), xp.as_float(mask).reshape(-1), whitening)
    return flat.reshape(x.shape)


# --- The optimal token baseline ----------------------------------------------------------


def _packing(xp, m):
    """Per row, the order that puts the unmasked positions first (in their order), and
    its inverse: ``take(x, order)`` packs a row, ``take(packed, inverse)`` unpacks it."""
    order = xp.argsort(xp.as_index(~m))
    return order, xp.argsort(order)


def optimal_token_baseline(xp, returns, w, m, valid, seg: Groups, align: str,
                           zero_tail: bool, eps: float):
    """``ratiokl.spec.token_baselines``' advantages ``[B, T]`` from the float32 returns
    and per-token weights ``w`` (0 where masked), the mask ``m`` and ``valid [B]``."""
    if align == "active":
        order, inverse = _packing(xp, m)
        returns, w, m = (xp.take(a, order) for a in (returns, w, m))
    lengths = xp.sum(xp.as_float(m), axis=-1)
    member = valid & (lengths > 0) if align == "active" else valid
    on = m & member[:, None]
    big_w = xp.where(on, xp.cumsum(w), 0.0)
    g = xp.where(on, returns, 0.0)
    members = group_sum(xp, xp.as_float(member), seg)
    base = group_sum(xp, g * big_w, seg) / (group_sum(xp, big_w, seg) + eps)
    cut = members < 2.0
    if zero_tail:
        size = xp.where(member, lengths, -1.0)
        longest = group_max(xp, size, seg)
        top = member & (size == longest)
        single = top & (group_sum(xp, xp.as_float(top), seg) == 1.0)
        second = group_max(xp, xp.where(top, -1.0, size), seg)
        tail = single[:, None] & (xp.as_float(xp.positions(m)) >= second[:, None])
        cut = cut[:, None] | tail
    else:
        cut = cut[:, None]
    adv = xp.where(on, g - xp.where(cut, 0.0, base), 0.0)
    return xp.take(adv, inverse) if align == "active" else adv
