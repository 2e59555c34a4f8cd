r"""Rollout correction: its options, checked once per set, and its float64 reference.

The engine that sampled the tokens (vLLM, SGLang, ...) reports log-probs
``rollout_logps`` that differ from the trainer's ``old_logps`` (other kernels,
precision, a stale copy of the weights). Per active token :math:`t`, with
:math:`b` = ``log_ratio_bound`` (None: no bound) and the sequences those of
``loss_agg`` (rows, or ``segment_ids``):

.. math::

    \ell_t = \log p_{\mathrm{old},t} - \log p_{\mathrm{rollout},t}, \qquad
    \ell = \begin{cases} \ell_t & \texttt{"token-*"} \\
           \sum_{u \in S_t} \ell_u & \texttt{"sequence-truncate"}, \texttt{"sequence-mask"} \\
           \frac{1}{|S_t|} \sum_{u \in S_t} \ell_u & \texttt{"sequence-geomean-mask"}
           \end{cases}

    e = \exp\big(\mathrm{clip}(\ell, -b, b)\big), \qquad
    w = \begin{cases} \min(e, \mathrm{hi}) & \texttt{"*-truncate"} \text{ (truncated IS, TIS)} \\
        \min(\max(e, \mathrm{lo}), \mathrm{hi})
        & \texttt{"token-clip"} \text{ (TIS with a floor)} \\
        e \text{ if } \mathrm{lo} \le e \le \mathrm{hi}, \text{ else } 0
        & \texttt{"token-mask"}, \texttt{"sequence-mask"} \text{ (rejection; IcePop)} \\
        e_t \text{ if } \mathrm{lo} \le e \le \mathrm{hi}, \text{ else } 0
        & \texttt{"sequence-geomean-mask"} \end{cases}

with :math:`S_t` the active tokens of :math:`t`'s sequence, :math:`e_t =
\exp(\mathrm{clip}(\ell_t, -b, b))` the token's own weight, and ``(lo, hi) =
rollout_bounds`` (``lo`` is read by the mask and clip modes only). ``"token-clip"`` is
OpenRLHF's ``is_correction_mode="clip"`` (its weight never below ``lo``);
``"sequence-geomean-mask"`` is OpenRLHF's ``is_correction_level="seq"`` mask: the gate
reads the geometric mean of the sequence's token ratios, and the tokens it keeps weigh
their own ratio (a NaN in the gate's mean makes the whole sequence's weights NaN, as
``"sequence-mask"`` does). ``w``
is detached and multiplies the per-token policy term together with
``importance_weights`` (never the KL term): ``loss_t = w * iw * pg + kl_coef * kl``.
A weight of 0 keeps its token in the aggregation's denominator. A NaN ``lw`` on
an active token gives ``w = NaN`` in every mode (NaN is neither above ``hi`` nor
outside ``[lo, hi]``): an invalid log-prob stays visible. Inactive tokens' log-probs
are never read (``where``, not a product).

``rollout_correction=None`` with ``rollout_logps`` given applies no weight (``w = 1``)
and reports the metrics only. Metrics, means over active tokens (0 when there is none):

    rollout_weight_mean       w
    rollout_masked_fraction   tokens the mask modes set to 0 (0 with the truncate modes)
    rollout_k3                exp(d) - d - 1 with d = clip(lw_t, -b, b): Schulman's k3
                              estimate of KL(engine || old) from the engine's samples

and the trainer/sampler parity (:func:`rollout_parity`), which compares the log-probs this
call computes, ``logp`` (the trainer's current policy; on-policy, or on the first step
after a rollout, the weights the engine sampled with), with the engine's, unclipped:

    rollout_logp_off_1pct_fraction   tokens whose exp(logp - rollout_logp) lies outside
                                     [0.99, 1.01]
    rollout_logp_off_5pct_fraction   the same outside [0.95, 1.05]

A NaN ratio (an invalid log-prob on either side) counts as outside: a mismatch stays
visible. verl's actor reports its ``rollout_corr/*`` diagnostics on the same pair (the
current log-probs against the rollout's); the three metrics above read ``old_logps``, as
the weight does.

References:
    Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (2025, truncated importance sampling, TIS); Liu, Li et al., "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (2025,
    token / sequence IS and rejection); Ling Team, "IcePop" (Ring-1T, 2025, token
    masking outside [0.5, 5]); Schulman, "Approximating KL Divergence" (2020).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from ratiokl._codes import KL
from ratiokl.spec.kl import estimator_value
from ratiokl.spec.options import ROLLOUT_CORRECTIONS, option_code

__all__ = [
    "DEFAULT_ROLLOUT_BOUNDS",
    "ROLLOUT_METRIC_NAMES",
    "ROLLOUT_PARITY_NAMES",
    "ROLLOUT_PARITY_TOLERANCES",
    "RolloutOptions",
    "rollout_options",
    "rollout_parity",
    "rollout_weights",
]

#: ``rollout_bounds``' default ``(lo, hi)``: verl's ``rollout_is_threshold`` (2.0).
DEFAULT_ROLLOUT_BOUNDS: Tuple[float, float] = (0.0, 2.0)

#: The metrics ``policy_loss`` adds when ``rollout_logps`` is given, in this order.
ROLLOUT_METRIC_NAMES: Tuple[str, ...] = (
    "rollout_weight_mean", "rollout_masked_fraction", "rollout_k3",
)

#: The parity metrics' relative tolerances: a token is off when ``exp(logp - rollout_logp)``
#: lies outside ``[1 - tol, 1 + tol]``.
ROLLOUT_PARITY_TOLERANCES: Tuple[float, ...] = (0.01, 0.05)
#: The parity metrics ``policy_loss`` adds after ``ROLLOUT_METRIC_NAMES``, one per tolerance.
ROLLOUT_PARITY_NAMES: Tuple[str, ...] = (
    "rollout_logp_off_1pct_fraction", "rollout_logp_off_5pct_fraction",
)


#: The code of ``rollout_correction=None`` (metrics only; every correction's code is above it).
NO_CORRECTION = 0
#: Codes of the sequence-level and of the masking corrections.
_GEOMEAN = ROLLOUT_CORRECTIONS["sequence-geomean-mask"]
_CLIP = ROLLOUT_CORRECTIONS["token-clip"]
_SEQUENCE_CODES = (ROLLOUT_CORRECTIONS["sequence-truncate"], ROLLOUT_CORRECTIONS["sequence-mask"],
                   _GEOMEAN)
_MASK_CODES = (ROLLOUT_CORRECTIONS["token-mask"], ROLLOUT_CORRECTIONS["sequence-mask"], _GEOMEAN)
#: The codes ``ratiokl._kernels.rollout``'s one-launch kernel implements.
_KERNEL_CODES = (NO_CORRECTION,) + tuple(ROLLOUT_CORRECTIONS[name] for name in (
    "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"))


@dataclass(frozen=True)
class RolloutOptions:
    """Validated rollout-correction options (shared by both frameworks)."""

    code: int  # ROLLOUT_CORRECTIONS, or NO_CORRECTION (metrics only)
    low: float  # lo: the mask modes' floor of exp(lw), token-clip's floor of the weight
    high: float  # hi: the truncate and clip modes' cap, the mask modes' ceiling (may be inf)

    @property
    def corrects(self) -> bool:
        """Whether a weight is applied (``rollout_correction`` is not None)."""
        return self.code != NO_CORRECTION

    @property
    def sequence(self) -> bool:
        """Whether the log-weight is the sequence's sum (``"sequence-*"``)."""
        return self.code in _SEQUENCE_CODES

    @property
    def geomean(self) -> bool:
        """Whether the sequence's log-weight is its mean (``"sequence-geomean-mask"``: the
        gate reads the geometric mean of the token ratios; the weight is the token's own)."""
        return self.code == _GEOMEAN

    @property
    def floors(self) -> bool:
        """Whether the weight is raised to ``lo`` below it (``"token-clip"``)."""
        return self.code == _CLIP

    @property
    def in_kernel(self) -> bool:
        """Whether the one-launch rollout kernel implements this mode (not ``"token-clip"``
        nor ``"sequence-geomean-mask"``, which take the framework's ops)."""
        return self.code in _KERNEL_CODES

    @property
    def masks(self) -> bool:
        """Whether tokens outside ``[lo, hi]`` get weight 0 (``"*-mask"``; else truncate)."""
        return self.code in _MASK_CODES


def rollout_options(
    rollout_correction: Optional[str],
    rollout_bounds: Sequence[float],
    logps_given: bool,
    *,
    old_given: bool = True,
    cached: bool = True,
) -> Optional[RolloutOptions]:
    """Check the rollout options; None when there is nothing to do (no ``rollout_logps``).

    ``logps_given``: whether ``rollout_logps`` was passed (a correction needs it);
    ``old_given``: whether ``old_logps`` was (the weight and the metrics need it).
    Errors name the argument and the fix. With ``cached`` the checks run once per
    distinct option set (``torch.compile``, which sees through caches, passes False).
    """
    if not isinstance(rollout_bounds, (tuple, list)):
        raise TypeError(
            f"`rollout_bounds` must be a pair (lo, hi) of Python numbers, e.g. (0.0, 2.0); got "
            f"{type(rollout_bounds).__name__}"
        )
    check = _cached_rollout_options if cached else _rollout_options
    # A tuple: hashable, for the cache; its values are checked there.
    return check(rollout_correction, tuple(rollout_bounds), bool(logps_given), bool(old_given))


def _rollout_options(correction, bounds, logps_given, old_given=True) -> Optional[RolloutOptions]:
    code = NO_CORRECTION if correction is None else option_code(
        "rollout_correction", correction, ROLLOUT_CORRECTIONS)
    low, high = _checked_bounds(bounds, truncates=code != NO_CORRECTION and code not in _MASK_CODES)
    if not logps_given:
        if code:
            raise ValueError(
                f"`rollout_correction={correction!r}` needs `rollout_logps` (the sampled "
                "tokens' log-probs under the inference engine, shape [...]); pass them, or "
                "rollout_correction=None"
            )
        return None
    if not old_given:
        raise ValueError(
            "`rollout_logps` needs `old_logps`: the rollout weight and metrics compare the "
            "behaviour policy's log-probs with the engine's (exp(old_logp - rollout_logp)); "
            "pass old_logps, or leave rollout_logps out"
        )
    return RolloutOptions(code=code, low=low, high=high)


def _checked_bounds(bounds: Tuple[object, ...], truncates: bool) -> Tuple[float, float]:
    """``(lo, hi)`` with ``0 <= lo <= hi``, ``lo`` finite, and ``hi`` finite to truncate."""
    if len(bounds) != 2 or any(isinstance(b, bool) or not isinstance(b, (int, float))
                               for b in bounds):
        raise TypeError(
            f"`rollout_bounds` must be a pair (lo, hi) of Python numbers, e.g. (0.0, 2.0); "
            f"got {bounds!r}"
        )
    low, high = float(bounds[0]), float(bounds[1])
    # Comparisons, not math.isfinite: they also trace under torch.compile(dynamic=True).
    if not (0.0 <= low < math.inf and low <= high):
        raise ValueError(
            f"`rollout_bounds` must be (lo, hi) with 0 <= lo <= hi and lo finite; got "
            f"{bounds!r}"
        )
    if truncates and not high < math.inf:
        raise ValueError(
            "`rollout_bounds`' hi is the truncate and clip modes' cap min(exp(lw), hi) and "
            "must be "
            f"finite; got {bounds!r}. Pass e.g. (0.0, 2.0)"
        )
    return low, high


#: Python-valued option sets, checked once each (typed: ``True`` is not ``1``).
_cached_rollout_options = functools.lru_cache(maxsize=64, typed=True)(_rollout_options)


def rollout_weights(
    old_logps: np.ndarray,
    rollout_logps: np.ndarray,
    mask: np.ndarray,
    sequences: Tuple[np.ndarray, int],
    opts: RolloutOptions,
    log_ratio_bound: Optional[float],
) -> Tuple[np.ndarray, Dict[str, float]]:
    """Float64 ``(w, metrics)``: the weight of every token ``[...]`` (0 on inactive ones)
    and the three metrics (the module docstring has the formulas).

    ``sequences``: ``ratiokl.spec.sequence_index(mask, segment_ids)``, the sequence of
    every active token and their count.
    """
    mask = np.asarray(mask, dtype=bool)
    with np.errstate(invalid="ignore", over="ignore"):
        lw_tok = np.where(mask, np.asarray(old_logps, np.float64), 0.0) - np.where(
            mask, np.asarray(rollout_logps, np.float64), 0.0)
        lw = lw_tok
        if opts.sequence:
            seq, n_seq = sequences
            sums = np.bincount(seq[mask], weights=lw_tok[mask], minlength=n_seq)
            if opts.geomean:  # the mean: the log of the token ratios' geometric mean
                sums = sums / np.maximum(np.bincount(seq[mask], minlength=n_seq), 1)
            lw = np.where(mask, np.append(sums, 0.0)[seq], 0.0)  # slot -1: inactive tokens

        def bounded(x):
            return x if log_ratio_bound is None else np.clip(x, -log_ratio_bound,
                                                             log_ratio_bound)

        e = np.exp(bounded(lw))
        outside = np.zeros(mask.shape, bool)
        w = np.ones(mask.shape)
        if opts.masks:
            outside = (e < opts.low) | (e > opts.high)
            # The geometric-mean gate keeps the token's own weight (a NaN gate: NaN).
            w = np.where(outside, 0.0, np.where(np.isnan(e), e, np.exp(bounded(lw_tok)))
                         if opts.geomean else e)
        elif opts.corrects:
            w = np.where(e > opts.high, opts.high, e)
            if opts.floors:
                w = np.where(e < opts.low, opts.low, w)
        d = bounded(lw_tok)
        k3 = estimator_value(np, d, KL.K3)
    n_tok = max(int(mask.sum()), 1)

    def mean(x) -> float:
        return float(np.where(mask, x, 0.0).sum() / n_tok)

    metrics = {"rollout_weight_mean": mean(w), "rollout_masked_fraction": mean(outside),
               "rollout_k3": mean(k3)}
    return np.where(mask, w, 0.0), metrics


def rollout_parity(logp: np.ndarray, rollout_logps: np.ndarray,
                   mask: np.ndarray) -> Dict[str, float]:
    """Float64 ``ROLLOUT_PARITY_NAMES``: the fraction of active tokens (0 when there is none)
    whose ``exp(logp - rollout_logps)`` lies outside ``[1 - tol, 1 + tol]`` for each of
    ``ROLLOUT_PARITY_TOLERANCES`` (NaN counts as outside); inactive tokens are never read.

    ``logp``: the trainer's log-probs of the sampled tokens (the call's own, not
    ``old_logps``), ``rollout_logps`` the engine's, both ``[...]`` like ``mask``.
    """
    mask = np.asarray(mask, dtype=bool)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(np.where(mask, np.asarray(logp, np.float64), 0.0)
                   - np.where(mask, np.asarray(rollout_logps, np.float64), 0.0))
    n_tok = max(int(mask.sum()), 1)
    return {name: float((mask & ~((e >= 1.0 - tol) & (e <= 1.0 + tol))).sum() / n_tok)
            for name, tol in zip(ROLLOUT_PARITY_NAMES, ROLLOUT_PARITY_TOLERANCES)}
