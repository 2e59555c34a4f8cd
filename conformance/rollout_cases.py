"""``policy_loss`` rollout-correction cases: ``rollout_logps`` and each ``rollout_correction``.

Called by ``conformance/generate.py`` (the only writer of fixtures). The base
inputs are ``loss_cases``' (poisoned inactive rows, ratios off the clip
thresholds); on top, the engine's log-probs ``rollout_logps = old_logps + noise``
(NaN on inactive rows), with every weight ``exp(lw)`` (token or sequence) kept
``MARGIN`` away from the bounds so that float32 rounding cannot flip a mask
decision, and each group checked to hit the bounds it pins down (both sides for
the mask modes).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

import loss_cases  # noqa: E402 - conformance/ is the script's directory
from ratiokl import spec
from ratiokl.conformance import LOGIT_DTYPES, Case, build_case

OP = "policy_loss_rollout"
#: Minimum relative distance of an active token's weight exp(lw) from a bound.
MARGIN = 1e-3

Inputs = Dict[str, Any]

#: group -> (dtypes, scalar options, arrays besides the positional ones and
#: ``rollout_logps``, build kwargs, noise of ``rollout_logps`` around ``old_logps``,
#: description).
GROUPS: Dict[str, Tuple[Tuple[str, ...], Dict[str, Any], Tuple[str, ...], Dict[str, Any],
                        float, str]] = {
    "policy_rollout_token_truncate": (
        LOGIT_DTYPES, {"rollout_correction": "token-truncate", "kl_coef": 0.1}, (), {}, 0.6,
        "TIS per token: min(exp(old - rollout), 2); the k3 KL is not weighted"),
    "policy_rollout_token_mask": (
        ("float32",), {"rollout_correction": "token-mask", "rollout_bounds": (0.5, 2.0)}, (),
        {"per_token_adv": True}, 0.6,
        "token mask outside [0.5, 2], both sides hit; per-token advantages"),
    "policy_rollout_icepop": (
        ("float32", "bfloat16"), {"rollout_correction": "token-mask",
                                  "rollout_bounds": (0.5, 5.0), "kl_coef": 0.2},
        ("ref_logps",), {}, 1.2, "IcePop: token mask outside [0.5, 5], both sides hit"),
    "policy_rollout_sequence_truncate": (
        ("float32",), {"rollout_correction": "sequence-truncate",
                       "loss_agg": "seq-mean-token-mean"}, (), {}, 0.3,
        "sequence TIS: min(exp(sum over the row), 2), seq-mean-token-mean"),
    "policy_rollout_sequence_mask": (
        ("float32", "bfloat16"), {"rollout_correction": "sequence-mask",
                                  "rollout_bounds": (0.5, 2.0)}, (), {}, 0.5,
        "sequence mask outside [0.5, 2] (rows), both sides hit"),
    "policy_rollout_sequence_mask_packed": (
        ("float32",), {"rollout_correction": "sequence-mask", "rollout_bounds": (0.7, 1.5),
                       "loss_agg": "seq-mean-token-sum"}, ("segment_ids",), {"active": 0.9},
        0.25, "sequence mask over packed segments, both sides hit"),
    "policy_rollout_sequence_truncate_packed": (
        ("float32",), {"rollout_correction": "sequence-truncate", "rollout_bounds": (0.0, 1.2),
                       "loss_agg": "token-mean"}, ("segment_ids", "importance_weights"),
        {"active": 0.9}, 0.25, "sequence TIS over packed segments, with importance weights"),
    "policy_rollout_importance_weights": (
        ("float32",), {"rollout_correction": "token-truncate", "rollout_bounds": (0.0, 1.5),
                       "kl_coef": 0.3}, ("importance_weights",), {}, 0.6,
        "TIS times importance weights on the policy term, the KL term unweighted"),
    "policy_rollout_log_ratio_bound": (
        ("float32",), {"rollout_correction": "sequence-mask", "rollout_bounds": (0.8, 1.3),
                       "log_ratio_bound": 0.4}, (), {}, 0.4,
        "the sequence log-weight bounded at 0.4 before exp (weights in [e^-0.4, e^0.4])"),
    "policy_rollout_metrics_only": (
        ("float32",), {"kl_coef": 0.1}, (), {}, 0.6,
        "rollout_logps without rollout_correction: no weight, the metrics only"),
    "policy_rollout_gspo": (
        ("float32",), {"rollout_correction": "token-mask", "rollout_bounds": (0.6, 1.8),
                       "ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"}, (), {},
        0.6, "token mask with GSPO's sequence ratio (the two-pass route)"),
    "policy_rollout_cispo": (
        ("float32",), {"rollout_correction": "sequence-truncate", "objective": "cispo",
                       "clip_eps_high": 0.28, "rollout_bounds": (0.0, 0.6)}, (), {}, 0.5,
        "sequence TIS with CISPO"),
    "policy_rollout_all_inactive": (
        ("float32",), {"rollout_correction": "sequence-mask",
                       "loss_agg": "seq-mean-token-mean", "kl_coef": 0.5},
        ("segment_ids", "importance_weights"), {"active": 0.0}, 0.6,
        "no active token: loss 0, metrics 0, zero gradient"),
}


def _weights(x: Inputs, opts: spec.RolloutOptions, bound: Optional[float],
             segments: Optional[np.ndarray]) -> np.ndarray:
    """``exp(clip(lw))`` per token before truncation or masking (0 on inactive tokens)."""
    mask = x["mask"]
    lw = np.where(mask, x["old_logps"] - x["rollout_logps"], 0.0)
    if opts.sequence:
        seq, n = spec.sequence_index(mask, segments)
        sums = np.bincount(seq[mask], lw[mask], n)
        lw = np.where(mask, np.append(sums, 0.0)[seq], 0.0)
    return np.where(mask, np.exp(lw if bound is None else np.clip(lw, -bound, bound)), 0.0)


def _rollout_logps(group: str, noise: float, options: Dict[str, Any]):
    """The ``extend`` of ``loss_cases.build_inputs`` adding ``rollout_logps``."""
    opts = spec.rollout_options(options.get("rollout_correction"),
                                options.get("rollout_bounds", spec.DEFAULT_ROLLOUT_BOUNDS), True)
    bound = options.get("log_ratio_bound", spec.DEFAULT_LOG_RATIO_BOUND)

    def extend(rng, x: Inputs, segments: Optional[np.ndarray]) -> Inputs:
        mask = x["mask"]
        x["rollout_logps"] = x["old_logps"] + rng.normal(0.0, noise, mask.shape)
        for _ in range(8):
            e = _weights(x, opts, bound, segments)
            near = np.zeros(mask.shape, bool)
            for t in (opts.low, opts.high):
                if 0.0 < t < np.inf:
                    near |= mask & (np.abs(e / t - 1.0) < MARGIN)
            if not near.any():
                break
            x["rollout_logps"] = np.where(near, x["rollout_logps"] + 0.01, x["rollout_logps"])
        else:
            raise RuntimeError("could not keep the rollout weights away from the bounds")
        _check_bounds_hit(group, e[mask], opts)
        x["rollout_logps"] = np.where(mask, x["rollout_logps"], np.nan)
        return x

    return extend


def _check_bounds_hit(group: str, e: np.ndarray, opts: spec.RolloutOptions) -> None:
    """A correcting group hits ``hi`` (and, masking, ``lo`` when it is positive)."""
    if not opts.corrects or e.size == 0:
        return
    if not (e > opts.high).any() or (opts.masks and opts.low > 0 and not (e < opts.low).any()):
        raise RuntimeError(f"{group} does not reach its bounds ({opts.low}, {opts.high}): "
                           f"weights {np.sort(e)}; change its noise")


def build_cases() -> Iterator[Case]:
    """Every rollout-correction case, in a fixed order."""
    for group, (dtypes, options, arrays, kwargs, noise, description) in GROUPS.items():
        for dtype in dtypes:
            inputs = loss_cases.build_inputs(group, dtype, options, arrays + ("rollout_logps",),
                                             kwargs, extend=_rollout_logps(group, noise, options))
            yield build_case(
                f"{group}_{loss_cases.SUFFIX[dtype]}", group, OP, dtype, inputs,
                options=dict(options), cotangents={"loss": np.float32(0.75)},
                description=description,
            )
