"""The advantage estimators' public bodies, written once for PyTorch and JAX.

Each framework's ``advantages`` module holds the signatures and docstrings and calls the
function of the same name here with its array adapter ``xp``; this module validates the
arguments (shapes, dtypes and Python options only: no host synchronisation) and runs the
math of :mod:`ratiokl._core.advantages`. GAE's scan is the binding's own (``scan``: the
raw advantages ``[B, T]`` from the float32 inputs): a Triton kernel or XLA's scan.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from ratiokl._core import advantages as math
from ratiokl.spec.advantages import (GROUP_SCALES, GROUP_STDS, SINGLETONS, WHITENINGS,
                                     check_choice)
from ratiokl.spec.token_baselines import ALIGNS

__all__ = ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
           "reinforce_pp", "reinforce_pp_baseline", "rloo", "spread"]


def _array(xp, name: str, value: Any, shape, kind: str):
    """``value`` as the framework's array of ``shape`` and ``kind`` (float / int / bool)."""
    if not xp.is_array(value):
        raise TypeError(f"`{name}` must be {xp.any_array}; got {type(value).__name__}")
    value = xp.as_array(value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"`{name}` must have shape {list(shape)}; got {list(value.shape)}")
    dtype = value.dtype
    ok = {"float": xp.is_floating(dtype),
          "int": xp.is_integer(dtype),
          "number": xp.is_bool(dtype) or xp.is_integer(dtype) or xp.is_floating(dtype)}[kind]
    if not ok:
        fix = {"float": "float", "int": "ids", "number": "float"}[kind]
        raise TypeError(f"`{name}` must be {'a floating' if kind == 'float' else 'an integer'} "
                        f"{xp.noun}; got {dtype}. Cast it, e.g. "
                        f"`{xp.casts[fix].format(name)}`")
    return value


def _scores(xp, scores: Any, ndim: int):
    if not xp.is_array(scores):
        raise TypeError(f"`scores` must be {xp.any_array}; got {type(scores).__name__}")
    scores = xp.as_array(scores)
    if scores.ndim != ndim:
        want = "[B] (one score per sequence)" if ndim == 1 else "[B, K] (K scores per sequence)"
        raise ValueError(f"`scores` must have shape {want}; got {list(scores.shape)}")
    return xp.as_float(_array(xp, "scores", scores, scores.shape, "float"))


def _inputs(xp, scores, group_ids, group_size: Optional[int], valid, ndim: int = 1):
    """Checked float32 scores, the bool ``valid [B]`` and the :class:`math.Groups`."""
    x = _scores(xp, scores, ndim)
    n = x.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("pass exactly one of `group_ids` (a group id per sample) and "
                         "`group_size` (consecutive groups of that many samples)")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"`group_size` must be a positive int; got {group_size!r}")
        if n % group_size:
            raise ValueError(f"`group_size` ({group_size}) must divide the batch ({n} "
                             "scores); pass `group_ids` for groups of unequal sizes")
    else:
        group_ids = _array(xp, "group_ids", group_ids, (n,), "int")
    valid = (xp.ones_like(x[:, 0] if ndim == 2 else x) > 0 if valid is None
             else _array(xp, "valid", valid, (n,), "number") != 0)
    like = x[:, 0] if ndim == 2 else x
    return x, valid, math.groups(xp, group_ids, group_size, n, like)


def _lengths(xp, lengths, n: int, required: bool = False):
    if lengths is None:
        if required:
            raise ValueError("`lengths` is required here: each sequence's number of "
                             "response tokens, e.g. `mask.sum(-1)`")
        return None
    return xp.as_float(_array(xp, "lengths", lengths, (n,), "number"))


def _eps(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"`{name}` must be a non-negative Python number; got {value!r}")


def grpo(xp, scores, group_ids, *, group_size, valid, std, scale, eps, singleton):
    check_choice("std", std, GROUP_STDS)
    check_choice("scale", scale, GROUP_SCALES)
    check_choice("singleton", singleton, SINGLETONS)
    _eps("eps", eps)
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    return math.grpo(xp, x, valid, seg, std, scale, float(eps), singleton)


def rloo(xp, scores, group_ids, *, group_size, valid, singleton):
    check_choice("singleton", singleton, SINGLETONS)
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    return math.rloo(xp, x, valid, seg, singleton)


def reinforce_pp_baseline(xp, scores, group_ids, *, group_size, valid, lengths, whiten,
                          singleton):
    check_choice("whiten", whiten, WHITENINGS)
    check_choice("singleton", singleton, SINGLETONS)
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    lens = _lengths(xp, lengths, x.shape[0])
    weights = xp.as_float(xp.ones_like(x)) if lens is None else lens
    return math.reinforce_pp_baseline(xp, x, valid, seg, weights, whiten, singleton)


def opo(xp, scores, group_ids, *, group_size, valid, lengths):
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    return math.opo(xp, x, valid, seg, _lengths(xp, lengths, x.shape[0], required=True))


def grpo_passk(xp, scores, group_ids, *, group_size, valid, std, scale, eps):
    check_choice("std", std, GROUP_STDS)
    check_choice("scale", scale, ("group", "none"))
    _eps("eps", eps)
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    return math.grpo_passk(xp, x, valid, seg, std, scale, float(eps))


def gpg(xp, scores, group_ids, *, group_size, valid, f_norm):
    if not isinstance(f_norm, (int, float)) or isinstance(f_norm, bool) or not f_norm > 0:
        raise ValueError(f"`f_norm` must be a positive Python number; got {f_norm!r}")
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid)
    return math.gpg(xp, x, valid, seg, float(f_norm))


def gdpo(xp, scores, group_ids, *, group_size, valid, weights: Optional[Sequence[float]],
         std, eps, singleton, lengths, whiten):
    check_choice("std", std, GROUP_STDS)
    check_choice("singleton", singleton, SINGLETONS)
    check_choice("whiten", whiten, WHITENINGS)
    _eps("eps", eps)
    x, valid, seg = _inputs(xp, scores, group_ids, group_size, valid, ndim=2)
    k = x.shape[1]
    weights = [1.0] * k if weights is None else [float(w) for w in weights]
    if len(weights) != k:
        raise ValueError(f"`weights` must hold one number per score column ({k}); got "
                         f"{len(weights)}")
    total = 0.0
    for column, weight in enumerate(weights):
        total = total + weight * math.grpo(xp, x[:, column], valid, seg, std, "group",
                                           float(eps), singleton)
    bad = valid & ~xp.isfinite(total)
    lens = _lengths(xp, lengths, x.shape[0])
    lens = xp.as_float(xp.ones_like(total)) if lens is None else lens
    out = math.whiten_groups(xp, xp.where(bad, 0.0, total), xp.where(valid & ~bad, lens, 0.0),
                             whiten, seg)
    return xp.where(bad, float("nan"), out)


def _token_inputs(xp, rewards, values, mask):
    r = _array(xp, "rewards", rewards, getattr(rewards, "shape", ()), "float")
    if r.ndim != 2:
        raise ValueError(f"`rewards` must have shape [B, T]; got {list(r.shape)}")
    v = None if values is None else _array(xp, "values", values, r.shape, "float")
    m = _array(xp, "mask", mask, r.shape, "number") != 0
    return r, v, m


def _discount(name: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ValueError(f"`{name}` must be a Python number in [0, 1]; got {value!r}")
    return float(value)


def gae(xp, scan: Callable, rewards, values, mask, gamma, lam, *, whiten):
    """``(advantages, returns)``; ``scan(rewards, values, mask, gamma, lam)`` is the
    binding's raw ``(advantages, returns)`` ``[B, T]`` (float32, 0 where masked)."""
    check_choice("whiten", whiten, WHITENINGS)
    gamma, lam = _discount("gamma", gamma), _discount("lam", lam)
    r, v, m = _token_inputs(xp, rewards, values, mask)
    adv, returns = scan(r, v, m, gamma, lam)
    return math.whiten_tokens(xp, adv, m, whiten), returns


def reinforce_pp(xp, scan: Callable, rewards, mask, gamma, *, whiten):
    """``(advantages, returns)``: discounted returns (GAE with ``V = 0``, ``lam = 1``)."""
    check_choice("whiten", whiten, WHITENINGS)
    gamma = _discount("gamma", gamma)
    r, _, m = _token_inputs(xp, rewards, None, mask)
    returns, _ = scan(r, xp.zeros_like(xp.as_float(r)), m, gamma, 1.0)
    return math.whiten_tokens(xp, returns, m, whiten), returns


def optimal_token_baseline(xp, scan: Callable, rewards, mask, old_logps, sum_pi_squared,
                           group_ids, *, group_size, valid, is_weights, align, zero_tail,
                           eps):
    """``(advantages, returns)`` ``[B, T]``: verl's (TIR) optimal token baseline."""
    check_choice("align", align, ALIGNS)
    if not isinstance(zero_tail, bool):
        raise ValueError(f"`zero_tail` must be True or False; got {zero_tail!r}")
    _eps("eps", eps)
    r, _, m = _token_inputs(xp, rewards, None, mask)
    w = 1.0 - 2.0 * xp.exp(xp.as_float(_array(xp, "old_logps", old_logps, r.shape, "float")))
    w = w + xp.as_float(_array(xp, "sum_pi_squared", sum_pi_squared, r.shape, "float"))
    if is_weights is not None:
        rho = xp.as_float(_array(xp, "is_weights", is_weights, r.shape, "float"))
        w = w * rho * rho
    rows = xp.sum(xp.as_float(r), axis=-1)  # a [B] array for the group checks
    _, ok, seg = _inputs(xp, rows, group_ids, group_size, valid)
    returns, _ = scan(r, xp.zeros_like(xp.as_float(r)), m, 1.0, 1.0)
    adv = math.optimal_token_baseline(xp, returns, xp.where(m, w, 0.0), m, ok, seg, align,
                                      zero_tail, float(eps))
    return adv, returns


def spread(xp, advantages, mask):
    """Per-sequence ``advantages [B]`` on every unmasked token of ``mask [B, T]``."""
    if not xp.is_array(mask) or xp.as_array(mask).ndim != 2:
        raise ValueError("`mask` must be a [B, T] array")
    mask = xp.as_array(mask)
    adv = _array(xp, "advantages", advantages, (mask.shape[0],), "float")
    m = _array(xp, "mask", mask, mask.shape, "number") != 0
    return xp.where(m, xp.as_float(adv)[:, None], 0.0)
