"""The checks of the public calls' scalar options: errors name the argument and the fix.

:func:`check_bool_option` checks a flag (``check_ids``) for both frameworks;
:func:`policy_loss_options` turns the public keywords into a
:class:`ratiokl.spec.PolicyLossOptions`, once per distinct set of Python values (cached).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

from ratiokl._codes import Objective as ObjectiveCode
from ratiokl.spec.loss_options import PolicyLossOptions
from ratiokl.spec.options import (DEFAULT_SAPO_TEMPERATURES, LOSS_AGGS, OBJECTIVES,
                                  POLICY_KL_ESTIMATORS, RATIO_LEVELS, TERM_AGGS, Coefficient,
                                  option_code)

__all__ = ["check_bool_option", "policy_loss_options"]


def check_bool_option(name: str, value: object) -> bool:
    """A Python bool option (``check_ids``): static in both frameworks (a JAX tracer or a
    tensor is refused, and so is ``1``, which would read as a flag in one framework only)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a Python bool; got {type(value).__name__}")
    return value


def _number(name: str, value: object, *, allow_none: bool = False) -> Optional[float]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a Python number; got {type(value).__name__}")
    # Comparisons, not math.isfinite: they also trace under torch.compile(dynamic=True).
    if not -math.inf < float(value) < math.inf:
        raise ValueError(f"`{name}` must be finite; got {value}")
    return float(value)


#: The exact types of Python-valued options (cacheable: hashable, never device data).
_SCALAR_TYPES = frozenset((type(None), bool, int, float, str))


def _is_array(value: object) -> bool:
    """A framework array (torch tensor, JAX array or tracer): not a Python scalar or None.

    Anything else that is not a scalar (a list, say) counts too: it then meets the
    array checks, which reject it by name, and never the cache (it may be unhashable).

    (``isinstance`` only, no ``hasattr``: ``torch.compile(dynamic=True)`` traces a Python
    float as a symbolic float, which it cannot ask for attributes.)
    """
    return value is not None and not isinstance(value, (bool, int, float, str))


def _coefficient(name: str, value: object) -> Coefficient:
    """A finite Python number as float, or a 0-d floating array passed through (not read)."""
    if not _is_array(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(
                f"`{name}` must be a Python number or a 0-d floating tensor/array; got "
                f"{type(value).__name__}"
            )
        return _number(name, value)
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or tuple(shape) != () or "float" not in str(dtype):
        got = (type(value).__name__ if shape is None
               else f"shape {tuple(shape)} dtype {dtype}")
        raise TypeError(
            f"`{name}` must be a Python number or a 0-d floating tensor/array; got {got}"
        )
    return value


def _above(name: str, value: Optional[float], floor: float, hint: str) -> None:
    if value is not None and not value > floor:
        raise ValueError(f"`{name}` must be > {floor} ({hint}); got {value}")


def policy_loss_options(
    *,
    clip_eps: Coefficient,
    clip_eps_high: Optional[Coefficient],
    dual_clip: Optional[float],
    ratio_cap: Optional[float],
    kl_coef: Coefficient,
    kl_estimator: str,
    loss_agg: str,
    ratio_level: str,
    log_ratio_bound: Optional[float],
    objective: str = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[str] = None,
    entropy_agg: Optional[str] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    cached: bool = True,
) -> PolicyLossOptions:
    """Check ``policy_loss``'s scalar options; errors name the argument and the fix.

    ``clip_eps``, ``clip_eps_high``, ``kl_coef`` and ``entropy_coef`` may be 0-d
    floating arrays (their values are then the caller's responsibility: reading them would
    synchronise). ``kl_agg`` / ``entropy_agg`` (``TERM_AGGS`` names or None) aggregate
    the KL / entropy term apart (not with ``loss_agg="none"``); ``kl_clamp`` (a number > 0
    or None) clamps the KL value; ``sapo_temperatures`` (two numbers > 0, or None: the
    defaults) are ``objective="sapo"``'s. With ``cached``, calls with Python values only are
    cached: a step pays the checks once per distinct option set (a tracer such as
    ``torch.compile``, which sees through caches, passes False).
    """
    args = (clip_eps, clip_eps_high, dual_clip, ratio_cap, kl_coef, kl_estimator, loss_agg,
            ratio_level, log_ratio_bound, objective, entropy_coef, kl_agg, entropy_agg, kl_clamp,
            sapo_temperatures)
    # Python values only (their exact types: a subclass takes the checks every call):
    # the cache. One C-level pass, no Python call per value (host time per call).
    if cached and all(map(_SCALAR_TYPES.__contains__, map(type, args))):
        return _cached_policy_loss_options(*args)
    return _policy_loss_options(*args)


def _policy_loss_options(clip_eps, clip_eps_high, dual_clip, ratio_cap, kl_coef,
                         kl_estimator, loss_agg, ratio_level,
                         log_ratio_bound, objective, entropy_coef, kl_agg=None,
                         entropy_agg=None, kl_clamp=None,
                         sapo_temperatures=None) -> PolicyLossOptions:
    objective_code = option_code("objective", objective, OBJECTIVES)
    cispo = objective_code == ObjectiveCode.CISPO
    sapo_tau = _sapo_temperatures(sapo_temperatures, objective_code == ObjectiveCode.SAPO)
    if objective_code == ObjectiveCode.SAPO and (dual_clip is not None or ratio_cap is not None):
        raise ValueError(
            "`dual_clip` / `ratio_cap` have no meaning with objective=\"sapo\" (its soft gate "
            "replaces the clip); pass dual_clip=None and ratio_cap=None")
    eps_low = _coefficient("clip_eps", clip_eps)
    # CISPO's weight may have no floor (clip_eps = 1, MiniMax-M1's setting); PPO's may not.
    if not _is_array(eps_low) and not (0.0 <= eps_low < 1.0 or (cispo and eps_low == 1.0)):
        interval = "[0, 1] with objective=\"cispo\"" if cispo else "[0, 1)"
        raise ValueError(
            f"`clip_eps` must be in {interval} (the ratio floor is 1 - clip_eps); got {eps_low}"
        )
    eps_high = eps_low if clip_eps_high is None else _coefficient("clip_eps_high",
                                                                  clip_eps_high)
    if not _is_array(eps_high) and eps_high < 0.0:
        raise ValueError(f"`clip_eps_high` must be >= 0; got {eps_high}")
    dual = _number("dual_clip", dual_clip, allow_none=True)
    _above("dual_clip", dual, 1.0, "the dual-clip constant c > 1; None turns it off")
    cap = _number("ratio_cap", ratio_cap, allow_none=True)
    if cispo:  # the weight's ceiling, which may be below 1 (TRL's epsilon_high <= 1)
        _above("ratio_cap", cap, 0.0, "with objective=\"cispo\" the ceiling of the detached "
               "weight, e.g. 5.0; None turns it off")
    else:
        _above("ratio_cap", cap, 1.0, "INTELLECT-2's delta, e.g. 4.0; None turns it off")
    if cap is not None and _is_array(eps_high):
        raise ValueError(
            "`ratio_cap` needs Python-number clip bounds (the ceiling is "
            "min(1 + clip_eps_high, ratio_cap)); pass `clip_eps_high` as a float, or "
            "ratio_cap=None"
        )
    bound = _number("log_ratio_bound", log_ratio_bound, allow_none=True)
    _above("log_ratio_bound", bound, 0.0, "a bound on |log ratio| before exp; None: no bound")
    kl_coef = _coefficient("kl_coef", kl_coef)
    if not _is_array(kl_coef) and kl_coef < 0.0:
        raise ValueError(
            f"`kl_coef` must be >= 0 (a negative weight rewards moving away from the "
            f"reference); got {kl_coef}. Pass 0.0 to turn the KL term off"
        )
    if cispo and dual is not None:
        raise ValueError(
            "`dual_clip` has no meaning with objective=\"cispo\" (its weight is already "
            "clipped to [1 - clip_eps, min(1 + clip_eps_high, ratio_cap)] for every "
            "advantage); pass dual_clip=None, or ratio_cap= to lower the ceiling"
        )
    clamp = _number("kl_clamp", kl_clamp, allow_none=True)
    _above("kl_clamp", clamp, 0.0, "the KL value's bound c, e.g. 10.0; None: no clamp")
    agg_code = option_code("loss_agg", loss_agg, LOSS_AGGS)
    term_codes = [None if agg is None else option_code(name, agg, TERM_AGGS)
                  for name, agg in (("kl_agg", kl_agg), ("entropy_agg", entropy_agg))]
    for name, code in zip(("kl_agg", "entropy_agg"), term_codes):
        if code is not None and loss_agg == "none":
            raise ValueError(
                f"`{name}` has no meaning with loss_agg=\"none\" (the per-token loss is "
                f"returned unreduced); pass {name}=None and aggregate the terms yourself"
            )
    caps = [c for c in (dual, cap) if c is not None]
    if cispo:
        caps = []  # CISPO: ratio_cap only lowers the one ceiling (ratio_high)
    return PolicyLossOptions(
        ratio_low=1.0 - eps_low,
        ratio_high=min(1.0 + eps_high, cap) if cap is not None else 1.0 + eps_high,
        neg_cap=min(caps) if caps else None,
        kl_coef=kl_coef,
        kl_code=option_code("kl_estimator", kl_estimator, POLICY_KL_ESTIMATORS),
        agg_code=agg_code,
        sequence_ratio=option_code("ratio_level", ratio_level, RATIO_LEVELS) == 1,
        log_ratio_bound=bound,
        objective_code=objective_code,
        # Any finite number: > 0 rewards entropy (exploration), < 0 penalises it.
        entropy_coef=_coefficient("entropy_coef", entropy_coef),
        kl_agg_code=term_codes[0],
        entropy_agg_code=term_codes[1],
        kl_clamp=clamp,
        sapo_tau=sapo_tau,
    )


def _sapo_temperatures(value: object, sapo: bool) -> Tuple[float, float]:
    """SAPO's ``(tau for A > 0, tau for A <= 0)``: two finite numbers > 0; None: the
    defaults. ``ValueError`` naming ``sapo_temperatures`` when given without SAPO."""
    if value is None:
        return DEFAULT_SAPO_TEMPERATURES if sapo else (1.0, 1.0)
    if not sapo:
        raise ValueError(
            "`sapo_temperatures` has no meaning without objective=\"sapo\"; pass "
            "objective=\"sapo\", or sapo_temperatures=None")
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(
            f"`sapo_temperatures` must be a pair (tau for A > 0, tau for A <= 0), e.g. "
            f"{DEFAULT_SAPO_TEMPERATURES}; got {value!r}")
    pos, neg = (_number("sapo_temperatures", v) for v in value)
    for tau in (pos, neg):
        _above("sapo_temperatures", tau, 0.0, "the soft gate's temperatures, e.g. "
               f"{DEFAULT_SAPO_TEMPERATURES}")
    return pos, neg


#: Python-valued option sets, checked once each (typed: ``True`` is not ``1``).
_cached_policy_loss_options = functools.lru_cache(maxsize=256, typed=True)(_policy_loss_options)
