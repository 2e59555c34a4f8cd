r"""Float64 NumPy reference of the PPO/GRPO policy loss: the numeric spec.

Built on the per-token log-probs of :mod:`ratiokl.spec.reference`. Per active
token :math:`t` (inactive tokens contribute nothing and get a zero gradient), with
:math:`\ell` the log-ratio ``logp - old_logp`` (``ratio_level="token"``; without
``old_logps``, on-policy: ``old_logp = sg(logp)``, so :math:`r = 1`,
:math:`dr/d\log p = 1`), or its mean over :math:`t`'s sequence
(``ratio_level="sequence"``, GSPO), :math:`b` = ``log_ratio_bound`` (None: no bound),
:math:`w` = ``importance_weights`` (default 1), :math:`\mathrm{kl}` one of
``POLICY_KL_ESTIMATORS`` on :math:`d = \log p_\mathrm{ref} - \log p`:

.. math::

    r = \exp\big(\mathrm{clip}(\ell, -b, b)\big), \qquad
    q = \begin{cases} \min(r, r_\mathrm{high}) & A \ge 0 \\
        \min\big(\max(r, 1 - \epsilon), c_\mathrm{neg}\big) & A < 0 \end{cases}

    \mathrm{pg} = -A\, q\, w, \qquad
    \mathrm{loss} = \mathrm{pg} + c_\mathrm{KL}\, \mathrm{kl}

with :math:`r_\mathrm{high} = \min(1 + \epsilon_h, \mathrm{ratio\_cap})`,
:math:`c_\mathrm{neg} = \min(\mathrm{dual\_clip}, \mathrm{ratio\_cap})`,
:math:`\epsilon, \epsilon_h, c_\mathrm{KL}` = ``clip_eps``, ``clip_eps_high``,
``kl_coef``.

With ``rollout_logps`` the rollout correction's detached weight
(:mod:`ratiokl.spec.rollout`) multiplies ``w``.

With ``objective="cispo"`` (MiniMax-M1's CISPO) the policy term is instead, with the
weight :math:`w_c` detached, for every advantage:

.. math::

    w_c = \mathrm{clip}(r, 1 - \epsilon, r_\mathrm{high}), \qquad
    \mathrm{pg} = -A\, w_c\, w \log p, \qquad
    \frac{d\, \mathrm{pg}}{d \log p} = -A\, w_c\, w

so every active token carries a gradient, its size set by the clipped weight;
``clip_fraction_low`` / ``_high`` count ``r < 1 - clip_eps`` / ``r > ratio_high``
whatever the sign of ``A``. ``dual_clip`` is rejected (the weight is bounded
already); with ``ratio_level="sequence"`` ``r`` is the sequence ratio ``s_i``
(a sequence-level truncated importance weight on each token's log-prob).

The PPO term equals ``max(-A*r, -A*clip(r, 1-eps, 1+eps_high))`` with the dual clip
``min(., -A*c)`` for ``A < 0`` (PPO, DAPO clip-higher, dual-clip PPO,
INTELLECT-2's delta). Gradient with respect to ``logp`` (a clipped or capped
branch, and a log-ratio outside the bound, carry none; GSPO: through the token's own
``logp`` only, i.e. ``sg(s_i) * pi_t / sg(pi_t)`` as in verl; a NaN log-ratio is not
beyond the bound, so its gradient stays NaN; a clipped token's gradient is selected, exactly
0 whatever ``A``, ``w`` and ``dr`` hold):

.. math::

    \frac{dr}{d \log p} = \begin{cases} r & |\ell| \le b \\ 0 & \text{otherwise}
                          \end{cases}, \qquad
    \frac{dq}{dr} = \begin{cases} 1 & \text{on the unclipped branch} \\
                    0 & \text{otherwise} \end{cases}

With ``entropy_coef`` (:math:`c_H`, verl's ``entropy_coeff``) the per-token loss gains
an entropy bonus aggregated with the very weights of the policy term
(:func:`ratiokl.spec.entropy`; :math:`z` the logits, a ``-inf`` logit has
:math:`p_v = 0` and adds 0):

.. math::

    H_t = -\sum_v p_v \log p_v, \quad p = \mathrm{softmax}(z_t / T), \qquad
    \mathrm{loss}_t = \mathrm{pg} + c_\mathrm{KL}\, \mathrm{kl} - c_H H_t, \qquad
    \frac{\partial H_t}{\partial z_v} = -\frac{p_v (\log p_v + H_t)}{T}

i.e. ``agg(pg + kl_coef * kl) - c_H * agg(H)``.

(``c_H > 0`` rewards entropy, ``c_H < 0`` penalises it). ``entropy_mean``, the mean of
``H_t`` over active tokens, is always reported, whatever ``c_H``.

The aggregation is ``sum_t a_t * loss_t / D`` (``a_t = 1`` except
``seq-mean-token-mean``: ``1 / |active tokens of t's sequence|``; ``D``: active
tokens, 1, sequences with an active token, or the padded length ``T`` for
``seq-mean-token-sum-norm``; ``loss_normalizer`` replaces ``D``). A count of 0
gives loss 0, never NaN. ``loss_agg="none"`` aggregates nothing: the loss is the
per-token :math:`\mathrm{loss}_t` ``[...]`` above (0 on inactive tokens; GSPO: with the
sequence ratio, the very term the other modes weigh), so that every mode's loss is
``sum(loss_none * w)`` with its weights ``w_t = a_t / D``, and its gradient is per
token (an upstream ``g_t`` scales token :math:`t`'s own gradient only: GSPO's value
``sg(s_i)`` carries no gradient across tokens). ``loss_normalizer`` is refused with it.
``kl_agg`` / ``entropy_agg`` (None: the term joins ``loss_t`` above) aggregate the KL /
entropy term apart, by their own ``(a', D')`` (``D'`` = ``kl_entropy_normalizer`` when
given), so that ``loss = sum_t a_t w pg_t / D + c_KL sum_t a'_t kl_t / D'_KL - c_H sum_t
a''_t H_t / D'_H`` (OpenRLHF's token-mean KL and entropy under a sequence-level policy
loss; TRL's token-mean entropy bonus); refused with ``loss_agg="none"``. ``kl_clamp``
(:math:`c`) replaces the KL value by :math:`\mathrm{clip}(\mathrm{kl}, -c, c)`, its gradient
by 0 where :math:`|\mathrm{kl}| > c` (kept at :math:`|\mathrm{kl}| = c`, as ``torch.clamp``),
except for ``k1+`` / ``k3+``, whose gradient stays k2's (the clamp acts on the detached value).
Sequences are the rows of the leading shape
``[..., T]``; with ``segment_ids`` a new sequence starts at every active token
whose id differs from the previous active token's in the same row.

References:
    Schulman et al., "Proximal Policy Optimization Algorithms" (2017); Ye et al.,
    "Mastering Complex Control in MOBA Games" (2019, dual-clip); Yu et al., "DAPO"
    (2025, clip-higher, token-mean); Liu et al., "Understanding R1-Zero-Like
    Training" (2025, Dr. GRPO); Zheng et al., "Group Sequence Policy Optimization"
    (2025); Prime Intellect, "INTELLECT-2" (2025, delta); Schulman, "Approximating
    KL Divergence" (2020); DeepSeek-AI, "DeepSeek-V3.2" (2025, ratio-weighted KL).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ratiokl._codes import KL
from ratiokl.spec.aggregation import AGGREGATIONS, aggregation_denominator
from ratiokl.spec.kl import KL_VARIANTS, estimator_dlogp, estimator_value
from ratiokl.spec.options import (
    DEFAULT_LOG_RATIO_BOUND,
    PolicyLossOptions,
    check_loss_normalizer,
    check_term_normalizer,
    policy_loss_options,
)
from ratiokl.spec.reference import (
    ArrayLike,
    entropy,
    entropy_grad,
    selected_logprobs,
    selected_logprobs_grad,
)
from ratiokl.spec.rollout import DEFAULT_ROLLOUT_BOUNDS, rollout_options, rollout_weights

__all__ = [
    "POLICY_LOSS_DEFAULTS",
    "policy_loss",
    "policy_loss_from_logps",
    "policy_loss_grad",
    "sequence_index",
]

#: ``policy_loss``'s scalar options and their defaults (as in both frameworks' signatures).
POLICY_LOSS_DEFAULTS = dict(
    clip_eps=0.2, clip_eps_high=None, dual_clip=None, ratio_cap=None, kl_coef=0.0,
    kl_estimator="k3", loss_agg="token-mean", ratio_level="token",
    log_ratio_bound=DEFAULT_LOG_RATIO_BOUND, objective="ppo", entropy_coef=0.0,
    kl_agg=None, entropy_agg=None, kl_clamp=None,
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


def _kl_terms(d, kind: int, r, dr, bound, clamp=None):
    """KL value and its derivative w.r.t. ``logp`` (``dd/dlogp = -1``) per variant.

    ``clamp`` (``kl_clamp``): the value clipped to ``[-c, c]``; the gradient is 0 where the
    value lies beyond (at ``|value| = c`` it is kept, as ``torch.clamp``'s), except for the
    straight-through ``k1+`` / ``k3+``, whose k2 gradient the detached value never touches.
    """
    value, grad = _kl_unclamped(d, kind, r, dr, bound)
    if clamp is None:
        return value, grad
    straight = KL_VARIANTS[kind].straight_through
    beyond = np.abs(value) > clamp  # a NaN value is not beyond: its gradient stays NaN
    return np.clip(value, -clamp, clamp), np.where(beyond & ~straight, 0.0, grad)


def _kl_unclamped(d, kind: int, r, dr, bound):
    """The variant's value and gradient (``ratiokl.spec.KL_VARIANTS``) before ``kl_clamp``;
    k3 reads ``d`` clipped to the bound and has no gradient beyond it."""
    variant = KL_VARIANTS[kind]
    # A NaN d is not beyond the bound: its gradient stays NaN (never a silent 0).
    inside = np.ones_like(d, dtype=bool) if bound is None else ~(np.abs(d) > bound)
    d_b = d if bound is None else np.clip(d, -bound, bound)
    value = estimator_value(np, d_b if variant.value == KL.K3 else d, variant.value)
    grad = estimator_dlogp(np, d, variant.gradient)
    if variant.gradient == KL.K3:
        grad = np.where(inside, grad, 0.0)
    if variant.ratio_weighted:
        value, grad = r * value, dr * value + r * grad
    return value, grad


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


def _aggregation(mask, seq, n_seq, agg: str, loss_normalizer):
    """Per-token weights ``a`` and the denominator ``D`` of ``sum(a * loss) / D`` of the
    aggregation ``agg`` (a ``loss_agg`` name)."""
    weights = np.where(mask, 1.0, 0.0)
    if AGGREGATIONS[agg].per_sequence_length:
        counts = np.bincount(seq[mask], minlength=n_seq).astype(np.float64)
        weights[mask] = 1.0 / counts[seq[mask]]
    if loss_normalizer is not None:
        return weights, float(loss_normalizer)
    width = mask.shape[-1] if mask.shape else 1
    return weights, float(aggregation_denominator(agg, int(mask.sum()), n_seq, width))


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
    ``rollout_logps`` ``ratiokl.spec.rollout.ROLLOUT_METRIC_NAMES``.
    """
    loss, dlogp, _, metrics = _policy_terms(
        logp, logp_ref, old_logps, advantages, mask, entropy, loss_normalizer=loss_normalizer,
        segment_ids=segment_ids, importance_weights=importance_weights,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds, kl_entropy_normalizer=kl_entropy_normalizer, **options)
    return loss, dlogp, metrics


def _policy_terms(logp, logp_ref, old_logps, advantages, mask, entropy, *, loss_normalizer,
                  segment_ids, importance_weights, rollout_logps=None, rollout_correction=None,
                  rollout_bounds=DEFAULT_ROLLOUT_BOUNDS, kl_entropy_normalizer=None, **options):
    """``(loss, dloss/dlogp, dloss/dentropy, metrics)`` (:func:`policy_loss_from_logps`)."""
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
        else:
            q, dq, high, low, capped = _clipped(r, adv, opts)
            # A clipped branch carries no gradient, selected: whatever A, w or dr hold
            # (an infinite one included), never 0 * inf.
            pg, dpg = -adv * q * w, np.where(dq == 0.0, 0.0, -adv * dr * w)
        if logp_ref is None:
            kl, dkl = np.zeros(lead), np.zeros(lead)
        else:
            ref = np.where(mask, np.asarray(logp_ref, np.float64), 0.0)
            kl, dkl = _kl_terms(ref - logp, opts.kl_code, r, dr, bound, opts.kl_clamp)
        ent = None if entropy is None else np.where(mask, np.asarray(entropy, np.float64), 0.0)
        # Each term weighed by its aggregation: loss_agg's (with loss_normalizer), or for the
        # KL / entropy term kl_agg's / entropy_agg's own (with kl_entropy_normalizer).
        main = _aggregation(mask, seq, n_seq, opts.loss_agg, loss_normalizer)

        def weights_of(agg):
            if agg is None:
                return main
            return _aggregation(mask, seq, n_seq, agg, kl_entropy_normalizer)

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


def _reference_logps(ref_logits, ref_logps, action_ids, mask, temperature):
    if ref_logps is not None:
        return np.where(mask, np.asarray(ref_logps, dtype=np.float64), 0.0)
    if ref_logits is None:
        return None
    return selected_logprobs(ref_logits, action_ids, mask, temperature=temperature)


def _from_logits(policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
                 ref_logps, temperature, options):
    """``_policy_terms`` of logits: the log-probs and entropies of ``policy_logits``."""
    mask = np.asarray(mask, dtype=bool)
    logp = selected_logprobs(policy_logits, action_ids, mask, temperature=temperature)
    logp_ref = _reference_logps(ref_logits, ref_logps, action_ids, mask, temperature)
    ent = entropy(policy_logits, mask, temperature=temperature)
    arrays = {k: options.pop(k, None)
              for k in ("loss_normalizer", "segment_ids", "importance_weights",
                        "kl_entropy_normalizer")}
    return _policy_terms(logp, logp_ref, old_logps, advantages, mask, ent, **arrays, **options)


def policy_loss(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike, *,
    ref_logps: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0, **options,
) -> Tuple[float, Dict[str, float]]:
    """Float64 ``(loss, metrics)`` of ``policy_loss`` (same arguments as the frameworks').

    ``metrics`` has ``entropy_mean`` besides :func:`policy_loss_from_logps`'s.
    """
    loss, _, _, metrics = _from_logits(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        ref_logps, temperature, dict(options),
    )
    return loss, metrics


def policy_loss_grad(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike, *,
    ref_logps: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0,
    loss_cotangent: Optional[np.ndarray] = None, **options,
) -> np.ndarray:
    """Gradient of the loss w.r.t. ``policy_logits``: float64 ``[..., V]``, 0 on inactive rows.

    Through ``logp`` (``selected_logprobs_grad``) and, with ``entropy_coef``, through the
    entropy (``entropy_grad``: ``-c_H a_t / D`` times ``dH_t/dz``). ``loss_cotangent``: the
    upstream gradient of a ``loss_agg="none"`` loss, ``[...]`` (None: 1; never read on
    inactive rows).
    """
    _, dlogp, dent, _ = _from_logits(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        ref_logps, temperature, dict(options),
    )
    if loss_cotangent is not None:
        dlogp, dent = (_scaled(x, loss_cotangent, mask) for x in (dlogp, dent))
    grad = selected_logprobs_grad(policy_logits, action_ids, mask, dlogp,
                                  temperature=temperature)
    if np.any(dent != 0.0):
        grad = grad + entropy_grad(policy_logits, mask, dent, temperature=temperature)
    return grad


def _scaled(per_token: np.ndarray, cotangent: ArrayLike, mask: np.ndarray) -> np.ndarray:
    """``per_token * cotangent`` on active tokens, 0 on the others (whatever the cotangent
    holds there)."""
    mask = np.asarray(mask, dtype=bool)
    cot = np.where(mask, np.broadcast_to(np.asarray(cotangent, np.float64), mask.shape), 0.0)
    return np.where(mask, per_token * cot, 0.0)
