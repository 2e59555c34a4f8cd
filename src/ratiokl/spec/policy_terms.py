"""The float64 policy loss on per-token log-probs, and its gradient: the spec's core.

``ratiokl.spec.policy_loss`` (its module docstring has the formulas) and
``ratiokl.spec.policy_objective`` both evaluate :func:`policy_loss_terms`: the per-token
ratio, the policy term (PPO's clipped surrogate or CISPO's), the KL
(:func:`ratiokl.spec.policy_kl_terms`) and the entropy, weighed by their aggregations
(:func:`ratiokl.spec.aggregation_terms`), with the derivatives with respect to each
token's log-prob and entropy.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ratiokl.spec.aggregation import aggregation_terms
from ratiokl.spec.kl import policy_kl_terms
from ratiokl.spec.loss_options import (PolicyLossOptions, check_loss_normalizer,
                                       check_term_normalizer)
from ratiokl.spec.option_checks import policy_loss_options
from ratiokl.spec.options import DEFAULT_LOG_RATIO_BOUND
from ratiokl.spec.reference import ArrayLike
from ratiokl.spec.rollout import (DEFAULT_ROLLOUT_BOUNDS, rollout_options, rollout_parity,
                                  rollout_weights)

__all__ = ["POLICY_LOSS_DEFAULTS", "policy_loss_from_logps", "policy_loss_terms", "sequence_index"]

#: ``policy_loss``'s scalar options and their defaults (as in both frameworks' signatures).
POLICY_LOSS_DEFAULTS = dict(
    clip_eps=0.2, clip_eps_high=None, dual_clip=None, ratio_cap=None, kl_coef=0.0,
    kl_estimator="k3", loss_agg="token-mean", ratio_level="token",
    log_ratio_bound=DEFAULT_LOG_RATIO_BOUND, objective="ppo", entropy_coef=0.0,
    kl_agg=None, entropy_agg=None, kl_clamp=None, sapo_temperatures=None,
)


def sequence_index(
    mask: np.ndarray, segment_ids: Optional[np.ndarray] = None
) -> Tuple[np.ndarray, int]:
    """Sequence number of every active token (``-1`` on inactive ones) and the count.

    Rows are the leading shape without its last axis. Without ``segment_ids`` a
    row's active tokens form one sequence; with them, a new sequence starts at
    each active token whose id differs from the previous *active* token's in the
    row (inactive tokens' ids are never read).
    """
    mask = np.asarray(mask, dtype=bool)
    lead = mask.shape
    width = lead[-1] if lead else 1
    rows = mask.reshape(-1, width)
    segs = np.zeros(rows.shape, np.int64) if segment_ids is None else np.asarray(segment_ids)
    segs = segs.reshape(rows.shape)
    out = np.full(rows.shape, -1, dtype=np.int64)
    count = 0
    for r in range(rows.shape[0]):
        previous = None
        for t in range(width):
            if not rows[r, t]:
                continue
            if previous is None or segs[r, t] != previous:
                count += 1
            previous = segs[r, t]
            out[r, t] = count - 1
    return out.reshape(lead), count


def _advantages(advantages: ArrayLike, lead: Tuple[int, ...]) -> np.ndarray:
    """Per-token advantages: ``[...]``, ``[..., 1]`` or one per row ``lead[:-1]``."""
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.shape == lead:
        return adv
    if lead and adv.shape in (lead[:-1], lead[:-1] + (1,)):
        return np.broadcast_to(adv.reshape(lead[:-1] + (1,)), lead)
    raise ValueError(
        f"`advantages` must have shape {list(lead)} (per token) or {list(lead[:-1])} "
        f"(per sequence); got {list(adv.shape)}"
    )


def _clipped(r, adv, opts: PolicyLossOptions):
    """``q`` (the ratio the surrogate uses), ``dq/dr`` and the clip indicators."""
    high = (adv > 0) & (r > opts.ratio_high)
    low = (adv < 0) & (r < opts.ratio_low)
    cap = np.inf if opts.neg_cap is None else opts.neg_cap
    capped = (adv < 0) & (r > cap)
    q = np.where(high, opts.ratio_high, np.where(low, opts.ratio_low, np.where(capped, cap, r)))
    return q, np.where(high | low | capped, 0.0, 1.0), high, low, capped


def _cispo_weight(r, opts: PolicyLossOptions):
    """CISPO's detached weight ``clip(r, ratio_low, ratio_high)`` and its clip indicators."""
    high, low = r > opts.ratio_high, r < opts.ratio_low
    weight = np.where(high, opts.ratio_high, np.where(low, opts.ratio_low, r))
    return weight, high, low, np.zeros_like(high)


def _sapo_terms(r, dr, adv, w, opts: PolicyLossOptions):
    """SAPO's ``pg = -A * w * 4 / tau * sigmoid(tau * (r - 1))`` (``tau`` by the sign of
    ``A``) and ``d pg / d logp = -A * w * 4 * g * (1 - g) * dr``, ``g`` the sigmoid."""
    tau = np.where(adv > 0, opts.sapo_tau[0], opts.sapo_tau[1])
    gate = 1.0 / (1.0 + np.exp(-tau * (r - 1.0)))
    return -adv * w * 4.0 / tau * gate, -adv * w * 4.0 * gate * (1.0 - gate) * dr


def policy_loss_from_logps(
    logp: np.ndarray,
    logp_ref: Optional[np.ndarray],
    old_logps: Optional[np.ndarray],
    advantages: ArrayLike,
    mask: np.ndarray,
    *,
    loss_normalizer: Optional[float] = None,
    segment_ids: Optional[np.ndarray] = None,
    importance_weights: Optional[np.ndarray] = None,
    rollout_logps: Optional[np.ndarray] = None,
    rollout_correction: Optional[str] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    entropy: Optional[np.ndarray] = None,
    kl_entropy_normalizer: Optional[float] = None,
    **options,
) -> Tuple[float, np.ndarray, Dict[str, float]]:
    """Policy loss from per-token log-probs ``[...]``: ``(loss, dloss/dlogp, metrics)``.

    ``options`` are ``policy_loss``'s scalar options (``clip_eps`` ...
    ``entropy_coef``); see the module docstring for the formulas. ``logp_ref``
    may be None when ``kl_coef == 0`` (the KL is then 0); ``entropy`` (the per-token
    entropies ``[...]``) may be None when ``entropy_coef == 0`` (then no
    ``entropy_mean``). Metrics are means over active tokens (0 when there is none):
    ``clip_fraction`` (= ``_low`` + ``_high``), ``dual_clip_fraction``, ``ratio_mean``,
    ``kl_mean``, ``approx_kl``, given ``entropy`` ``entropy_mean``, and with
    ``rollout_logps`` ``ratiokl.spec.rollout.ROLLOUT_METRIC_NAMES`` and
    ``ROLLOUT_PARITY_NAMES``.
    """
    loss, dlogp, _, metrics = policy_loss_terms(
        logp, logp_ref, old_logps, advantages, mask, entropy, loss_normalizer=loss_normalizer,
        segment_ids=segment_ids, importance_weights=importance_weights,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds, kl_entropy_normalizer=kl_entropy_normalizer, **options)
    return loss, dlogp, metrics


def policy_loss_terms(logp, logp_ref, old_logps, advantages, mask, entropy, *,
                      loss_normalizer, segment_ids, importance_weights, rollout_logps=None,
                      rollout_correction=None, rollout_bounds=DEFAULT_ROLLOUT_BOUNDS,
                      kl_entropy_normalizer=None, **options):
    """Float64 ``(loss, dloss/dlogp, dloss/dentropy, metrics)``: the loss a float (``"none"``:
    ``[...]``), the derivatives ``[...]`` (0 on inactive tokens); arguments as
    :func:`policy_loss_from_logps`'s."""
    opts = policy_loss_options(**{**POLICY_LOSS_DEFAULTS, **options})
    check_loss_normalizer(opts.loss_agg, loss_normalizer)
    check_term_normalizer(opts, kl_entropy_normalizer)
    mask = np.asarray(mask, dtype=bool)
    lead = mask.shape
    if logp_ref is None and opts.kl_coef != 0.0:
        raise ValueError("`kl_coef` != 0 needs `ref_logits` or `ref_logps`")
    if entropy is None and opts.entropy_coef != 0.0:
        raise ValueError("`entropy_coef` != 0 needs the per-token `entropy`")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        logp = np.where(mask, np.asarray(logp, np.float64), 0.0)
        # On-policy (no old_logps): old = sg(logp), so r = 1 with dr/dlogp = r.
        old = logp if old_logps is None else np.where(
            mask, np.asarray(old_logps, np.float64), 0.0)
        adv = np.where(mask, _advantages(advantages, lead), 0.0)
        w = 1.0 if importance_weights is None else np.asarray(importance_weights, np.float64)
        w = np.where(mask, w, 0.0)
        seq, n_seq = sequence_index(mask, segment_ids)
        rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                                  old_given=old_logps is not None)
        rollout_metrics = {}
        if rollout is not None:
            w_rollout, rollout_metrics = rollout_weights(
                old, rollout_logps, mask, (seq, n_seq), rollout, opts.log_ratio_bound)
            w = w * w_rollout
            rollout_metrics.update(rollout_parity(logp, rollout_logps, mask))
        lr = logp - old
        if opts.sequence_ratio:
            counts = np.bincount(seq[mask], minlength=n_seq)
            sums = np.bincount(seq[mask], weights=lr[mask], minlength=n_seq)
            # One extra slot holding 0 for seq == -1 (inactive tokens).
            per_seq = np.append(sums / np.maximum(counts, 1), 0.0)
            lr = np.where(mask, per_seq[seq], 0.0)
        bound = opts.log_ratio_bound
        r = np.exp(lr if bound is None else np.clip(lr, -bound, bound))
        # Zero beyond the bound; a NaN log-ratio is not beyond it (its gradient stays NaN).
        dr = r if bound is None else np.where(np.abs(lr) > bound, 0.0, r)
        if opts.cispo:
            wc, high, low, capped = _cispo_weight(r, opts)
            pg, dpg = -adv * wc * w * logp, -adv * wc * w
        elif opts.sapo:
            pg, dpg = _sapo_terms(r, dr, adv, w, opts)
            high = low = capped = np.zeros(lead, bool)
        else:
            q, dq, high, low, capped = _clipped(r, adv, opts)
            # A clipped branch carries no gradient, selected: whatever A, w or dr hold
            # (an infinite one included), never 0 * inf.
            pg, dpg = -adv * q * w, np.where(dq == 0.0, 0.0, -adv * dr * w)
        if logp_ref is None:
            kl, dkl = np.zeros(lead), np.zeros(lead)
        else:
            ref = np.where(mask, np.asarray(logp_ref, np.float64), 0.0)
            kl, dkl = policy_kl_terms(ref - logp, opts.kl_code, r, dr, bound, opts.kl_clamp)
        ent = None if entropy is None else np.where(mask, np.asarray(entropy, np.float64), 0.0)
        # Each term weighed by its aggregation: loss_agg's (with loss_normalizer), or for the
        # KL / entropy term kl_agg's / entropy_agg's own (with kl_entropy_normalizer).
        main = aggregation_terms(mask, seq, n_seq, opts.loss_agg, loss_normalizer)

        def weights_of(agg):
            if agg is None:
                return main
            return aggregation_terms(mask, seq, n_seq, agg, kl_entropy_normalizer)

        (a, denom), (a_kl, d_kl), (a_h, d_h) = main, weights_of(opts.kl_agg), \
            weights_of(opts.entropy_agg)
        total = np.where(mask, a * pg / denom, 0.0)
        grad = a * dpg / denom
        if opts.kl_coef != 0.0:  # kl_coef = 0: the KL is only logged (0 * inf would be NaN)
            total = total + np.where(mask, opts.kl_coef * a_kl * kl / d_kl, 0.0)
            grad = grad + opts.kl_coef * a_kl * dkl / d_kl
        if opts.entropy_coef != 0.0:  # entropy_coef = 0: the entropy is only logged
            total = total - np.where(mask, opts.entropy_coef * a_h * ent / d_h, 0.0)
        grad = np.where(mask, grad, 0.0)
        dent = np.where(mask, -opts.entropy_coef * a_h / d_h, 0.0)
        n_tok = max(int(mask.sum()), 1)

        def mean(x):
            return float(np.where(mask, x, 0.0).sum() / n_tok)

        metrics = {
            "clip_fraction": mean(high | low),
            "clip_fraction_low": mean(low),
            "clip_fraction_high": mean(high),
            "dual_clip_fraction": mean(capped),
            "ratio_mean": mean(r),
            "kl_mean": mean(kl),
            "approx_kl": mean(old - logp),
        }
        if ent is not None:
            metrics["entropy_mean"] = mean(ent)
        metrics.update(rollout_metrics)  # the bindings' order: the rollout's last
        if opts.loss_agg == "none":  # a = 1 and D = 1 on active tokens: the per-token loss
            return total, grad, dent, metrics
        return float(total.sum()), grad, dent, metrics
