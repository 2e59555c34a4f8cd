r"""The PPO/GRPO objective on per-token log-probs, written once for both frameworks.

The math is ``ratiokl.spec.policy_loss``'s (its module docstring has every formula): per
active token the log-ratio :math:`\ell = \log p - \log p_\mathrm{old}` (GSPO: its
sequence's mean), the ratio :math:`r = e^{\mathrm{clip}(\ell, -b, b)}`, the policy term
(PPO's clipped surrogate or CISPO's detached clipped weight), the KL penalty and the
entropy bonus,

.. math::

    L_t = \mathrm{iw}_t\, \mathrm{pg}_t + c_\mathrm{KL}\, \mathrm{kl}_t - c_H H_t, \qquad
    \mathrm{loss} = \sum_t w_t L_t, \quad w_t = a_t / D

with the aggregation weights :math:`w_t` of ``loss_agg`` (:func:`aggregation_weights`);
with ``kl_agg`` (``entropy_agg``) the KL (entropy) term is instead aggregated apart, with
the weights of its own aggregation and ``kl_entropy_normalizer`` as its denominator, and
added to the aggregated loss;
``loss_agg="none"`` returns :math:`L_t` itself (0 on inactive tokens). Three callers
share it: both frameworks' two-pass ``policy_loss`` (the log-probs and entropies of a
backend's logits), their ``policy_objective`` (the trainer's own log-probs) and, for the
weights only, the fused kernels' ``policy_loss``.

Inactive tokens' inputs are replaced with neutral values (``where``, never a product)
*before* any arithmetic, and every intermediate stays finite on them, so a NaN or inf
there reaches no value and no gradient (an untaken ``where`` branch holding NaN would
give ``0 * NaN`` in the backward). ``xp`` is the framework's array adapter
(:mod:`ratiokl._core`); ``opts`` the validated ``ratiokl.spec.PolicyLossOptions``;
nothing synchronises with the host.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from ratiokl._codes import KL
from ratiokl._core.sequences import as_rows, segment_totals, segments
from ratiokl.spec import KL_VARIANTS, PolicyLossOptions, aggregation_denominator, estimator_value

__all__ = ["METRIC_NAMES", "aggregation_weights", "kernel_weights", "kl_value", "masked_means",
           "objective_rows", "policy_objective", "token_metrics", "token_ratio_kl"]

#: The objective's metrics, in the fused kernels' order (``_kernels.loss_rows``).
METRIC_NAMES = ("clip_fraction", "clip_fraction_low", "clip_fraction_high",
                "dual_clip_fraction", "ratio_mean", "kl_mean", "approx_kl", "entropy_mean")


def _bounded(xp, x, bound: Optional[float]):
    """``clip(x, -bound, bound)`` with gradient 1 inside ``[-bound, bound]``, 0 outside."""
    if bound is None:
        return x
    return xp.where(x > bound, bound, xp.where(x < -bound, -bound, x))


def _straight_through(xp, grad_like, value):
    """The value of ``value`` with the gradient of ``grad_like``."""
    return grad_like - xp.stop_gradient(grad_like) + xp.stop_gradient(value)


def kl_value(xp, d, code: int, ratio, bound: Optional[float], clamp: Optional[float] = None):
    """KL variant ``code`` (``ratiokl.spec.KL_VARIANTS``) on ``d = logp_ref - logp``.

    Only the terms the variant uses are computed (``ratio`` is read by ``k3-is`` only);
    autodiff takes the gradient (straight-through: the gradient estimator's).
    ``clamp`` (``kl_clamp``): the value clipped to ``[-clamp, clamp]``, with gradient 1
    inside (bounds included, as ``torch.clamp``) and 0 beyond; the straight-through ``k1+`` /
    ``k3+`` clamp their detached value only (their gradient stays k2's).
    """
    variant = KL_VARIANTS[code]
    value = _estimator(xp, d, variant.value, bound)
    if variant.ratio_weighted:
        value = ratio * value
    if not variant.straight_through:
        return _bounded(xp, value, clamp)
    return _straight_through(xp, _estimator(xp, d, variant.gradient, bound),
                             _bounded(xp, value, clamp))


def _estimator(xp, d, code: int, bound: Optional[float]):
    """``ratiokl.spec.estimator_value``; k3 reads ``d`` clipped to ``bound``."""
    return estimator_value(xp, _bounded(xp, d, bound) if code == KL.K3 else d, code)


def token_ratio_kl(xp, logp, logp_ref, old_logps, mask, kl_code: int) -> Tuple[Any, Any]:
    """``ratio_kl``'s ``(ratio, kl)``, float32 ``[N]``, from ``[N]`` log-probs and a bool mask.

    Differentiable through ``logp`` only (the caller passes the others detached).
    Inactive rows: ``ratio = 1``, ``kl = 0``, zero gradient.
    """
    logp = xp.where(mask, xp.as_float(logp), 0.0)
    logp_ref = xp.where(mask, xp.as_float(logp_ref), 0.0)
    old = xp.where(mask, xp.as_float(old_logps), 0.0)
    ratio = xp.exp(logp - old)
    kl = kl_value(xp, logp_ref - logp, kl_code, ratio, None)
    return xp.where(mask, ratio, 1.0), xp.where(mask, kl, 0.0)


def _clipped_ratio(xp, ratio, adv, opts: PolicyLossOptions):
    """The ratio the surrogate uses, and the low / high / dual-clip indicators."""
    high = (adv > 0) & (ratio > opts.ratio_high)
    low = (adv < 0) & (ratio < opts.ratio_low)
    capped = xp.zeros_like(high)
    q = xp.where(high, opts.ratio_high, xp.where(low, opts.ratio_low, ratio))
    if opts.neg_cap is not None:
        capped = (adv < 0) & (ratio > opts.neg_cap)
        q = xp.where(capped, opts.neg_cap, q)
    return q, low, high, capped


def _cispo_weight(xp, ratio, opts: PolicyLossOptions):
    """CISPO's weight ``sg(clip(ratio, ratio_low, ratio_high))`` (every advantage) and its
    low / high / (never) dual-clip indicators."""
    high, low = ratio > opts.ratio_high, ratio < opts.ratio_low
    weight = xp.where(high, opts.ratio_high, xp.where(low, opts.ratio_low, ratio))
    return xp.stop_gradient(weight), low, high, xp.zeros_like(high)


def _sapo_gate(xp, ratio, adv, opts: PolicyLossOptions):
    """SAPO's soft gate ``4 / tau * sigmoid(tau * (r - 1))`` (``tau`` by the sign of ``A``;
    its slope in ``r`` is 1 at ``r = 1``), and its (never) clip indicators."""
    tau = xp.where(adv > 0, opts.sapo_tau[0], opts.sapo_tau[1])
    # r >= 0, so the exponent is at most tau: no overflow.
    gate = 4.0 / tau / (1.0 + xp.exp(tau * (1.0 - ratio)))
    never = xp.zeros_like(adv > 0)
    return gate, never, never, never


def _with(xp, total, coef, term, uses: bool):
    """``total + coef * term``; a coefficient that is the number 0 adds nothing (``uses``
    False: the term is only logged, and ``0 * inf`` would be NaN), an array one that holds
    0 selects ``total``."""
    if not uses:
        return total
    weighted = total + coef * term
    return weighted if isinstance(coef, float) else xp.where(coef != 0.0, weighted, total)


def _denominator(xp, agg: str, n_tok, n_seq, width: int, normalizer):
    """``D`` of ``sum(a * loss) / D`` for the aggregation ``agg``
    (``ratiokl.spec.AGGREGATIONS``); ``"none"``: 1 (it takes no normaliser)."""
    if normalizer is not None and agg != "none":
        return normalizer
    return aggregation_denominator(agg, n_tok, n_seq, width, xp.maximum)


def _aggregate(xp, x, mask, agg: str, counts, n_tok, n_seq, normalizer):
    """``sum_t a_t x_t / D`` of the aggregation ``agg`` (a 0-d array); ``counts``: each
    token's sequence length (read by ``seq-mean-token-mean`` only), ``n_seq`` the number of
    sequences (read by the ``seq-mean-*`` ones)."""
    if agg == "seq-mean-token-mean":
        x = x / counts
    denom = _denominator(xp, agg, n_tok, n_seq, mask.shape[-1], normalizer)
    return xp.sum(xp.where(mask, x, 0.0)) / denom


def aggregation_weights(xp, mask, segment_ids, normalizer, opts: PolicyLossOptions):
    """Per-token weights ``w = a / D`` with ``loss = sum_t w_t * loss_t``: float32 ``[R, T]``.

    Depends only on the mask, the segment ids and the normaliser (never on log-probs), so
    the fused kernels take it precomputed; 0 on inactive tokens (``"none"``: 1 on active
    ones, each token its own loss).
    """
    weights = xp.as_float(xp.ones_like(mask))
    n_seq = None
    if opts.seq_aggregation:
        seq = segments(xp, mask, segment_ids)
        n_seq = xp.count(seq.starts)
        if opts.loss_agg == "seq-mean-token-mean":
            weights = 1.0 / xp.maximum(segment_totals(xp, xp.as_float(mask), seq), 1.0)
    denom = _denominator(xp, opts.loss_agg, xp.count(mask), n_seq, mask.shape[-1], normalizer)
    return xp.as_float(xp.where(mask, weights / denom, 0.0))


def kernel_weights(xp, token_weights: Callable, mask, lead: Tuple[int, ...], inputs,
                   opts: PolicyLossOptions):
    """The fused kernels' per-row aggregation weights ``w`` (float32 ``[N]``) for the
    flattened bool ``mask [N]``: the backend's one launch (``token_weights``) where every
    active token weighs the same, else :func:`aggregation_weights`."""
    mask_rows = as_rows(mask, lead)
    weights = token_weights(mask, opts, inputs.loss_normalizer, mask_rows.shape[-1])
    if weights is None:
        weights = aggregation_weights(
            xp, mask_rows, inputs.segment_ids, inputs.loss_normalizer, opts).reshape(-1)
    return weights


def policy_objective(xp, logp, logp_ref: Optional[Any], mask, inputs,
                     opts: PolicyLossOptions, entropy: Optional[Any]) -> Tuple[Any, Dict[str, Any]]:
    """``(loss, metrics)`` from per-token inputs laid out ``[R, T]``.

    Args:
      logp: float32 ``[R, T]``, differentiable.
      logp_ref: float32 ``[R, T]`` without gradient, or None (then the KL is 0).
      mask: bool ``[R, T]``.
      inputs: the other per-token inputs, ``[R, T]`` without gradient (a framework's
        ``_checks.TokenInputs``: ``old_logps`` (None: on-policy, ``old = sg(logp)``),
        ``advantages``, ``segment_ids``, ``importance_weights``, ``loss_normalizer``,
        ``kl_entropy_normalizer``).
      opts: the validated options.
      entropy: float32 ``[R, T]``, differentiable, or None (only where ``entropy_coef`` is
        the number 0). ``- entropy_coef * H`` joins each token's loss where the coefficient
        may be non-zero; else it is only averaged into ``entropy_mean``.

    Returns:
      The float32 0-d loss (``loss_agg="none"``: the per-token loss ``[R, T]``, 0 on
      inactive tokens) and :func:`token_metrics` (without ``entropy_mean`` when
      ``entropy`` is None).
    """
    logp = xp.where(mask, logp, 0.0)
    # On-policy (no old_logps): old = sg(logp), r = 1 with the gradient of logp.
    old = xp.stop_gradient(logp) if inputs.old_logps is None else xp.where(
        mask, inputs.old_logps, 0.0)
    adv = xp.where(mask, inputs.advantages, 0.0)
    need_segments = opts.needs_segments
    if need_segments:
        seq = segments(xp, mask, inputs.segment_ids)
        counts = xp.maximum(segment_totals(xp, xp.as_float(mask), seq), 1.0)
    log_ratio = logp - old
    if opts.sequence_ratio:
        seq_mean = segment_totals(xp, xp.stop_gradient(log_ratio), seq) / counts
        # GSPO-token form (verl): value sg(s_i), gradient on the token's own logp. An
        # infinite logp (its action masked out with -inf) adds 0, not inf - inf = NaN: the
        # value stays s_i (then beyond the bound: no gradient), as in the spec.
        own = xp.where(xp.isinf(logp), 0.0, logp - xp.stop_gradient(logp))
        log_ratio = xp.where(mask, seq_mean + own, 0.0)
    ratio = xp.exp(_bounded(xp, log_ratio, opts.log_ratio_bound))
    if opts.cispo:  # the gradient goes through logp only, on every active token
        q, low, high, capped = _cispo_weight(xp, ratio, opts)
        per_token = -adv * q * logp
    elif opts.sapo:  # a smooth gate in place of the clip: every token keeps a gradient
        q, low, high, capped = _sapo_gate(xp, ratio, adv, opts)
        per_token = -adv * q
    else:
        q, low, high, capped = _clipped_ratio(xp, ratio, adv, opts)
        per_token = -adv * q
    if inputs.importance_weights is not None:
        per_token = per_token * xp.where(mask, inputs.importance_weights, 0.0)
    n_tok = xp.count(mask)
    counts, n_seq = (counts, xp.count(seq.starts)) if need_segments else (None, None)

    # A term with an aggregation of its own (kl_agg / entropy_agg) is aggregated apart and
    # added to the aggregated loss; the others join each token's loss.
    apart = []
    kl = xp.zeros_like(logp)
    if logp_ref is not None:
        d = xp.where(mask, logp_ref, 0.0) - logp
        kl = kl_value(xp, d, opts.kl_code, ratio, opts.log_ratio_bound, opts.kl_clamp)
        if opts.kl_agg is None:
            per_token = _with(xp, per_token, opts.kl_coef, kl, opts.uses_kl)
        else:
            apart.append((opts.kl_coef, kl, opts.kl_agg, opts.uses_kl))
    if entropy is not None:
        entropy = xp.where(mask, entropy, 0.0)
        if opts.entropy_agg is None:
            per_token = _with(xp, per_token, -opts.entropy_coef, entropy, opts.uses_entropy)
        else:
            apart.append((-opts.entropy_coef, entropy, opts.entropy_agg, opts.uses_entropy))
    metrics = token_metrics(xp, mask, n_tok, low, high, capped, ratio, kl, old - logp,
                            xp.zeros_like(kl) if entropy is None else entropy)
    if entropy is None:
        del metrics["entropy_mean"]
    if opts.loss_agg == "none":
        return xp.as_float(xp.where(mask, per_token, 0.0)), metrics
    loss = _aggregate(xp, per_token, mask, opts.loss_agg, counts, n_tok, n_seq,
                      inputs.loss_normalizer)
    for coef, term, agg, uses in apart:
        term = _aggregate(xp, term, mask, agg, counts, n_tok, n_seq, inputs.kl_entropy_normalizer)
        loss = _with(xp, loss, coef, term, uses)
    return xp.as_float(loss), metrics


def objective_rows(xp, logp, logp_ref: Optional[Any], mask, lead: Tuple[int, ...], inputs,
                   opts: PolicyLossOptions, entropy) -> Tuple[Any, Dict[str, Any]]:
    """The two-pass loss from a backend's ``[N]`` log-probs (``logp``, ``logp_ref`` or None,
    ``entropy``) and bool ``mask``: :func:`policy_objective` on their ``[R, T]`` layout, the
    loss as returned (``loss_agg="none"``: per token in the leading shape, else 0-d)."""
    loss, metrics = policy_objective(
        xp, as_rows(logp, lead), None if logp_ref is None else as_rows(logp_ref, lead),
        as_rows(mask, lead), inputs, opts, as_rows(entropy, lead))
    return (loss.reshape(lead) if opts.loss_agg == "none" else loss), metrics


def masked_means(xp, mask, parts, n_tok=None):
    """Detached means over active tokens (0 when there is none) of each of ``parts``
    (arrays of ``mask``'s shape, or broadcasting to it), one stacked reduction: float32
    ``[len(parts)]``."""
    count = xp.as_float(xp.maximum(xp.count(mask) if n_tok is None else n_tok, 1))
    stacked = xp.stop_gradient(xp.stack([xp.as_float(xp.broadcast_to(x, mask.shape))
                                         for x in parts]))
    sums = xp.sum(xp.where(mask, stacked, 0.0).reshape(len(parts), -1), axis=1)
    return sums / count


def token_metrics(xp, mask, n_tok, low, high, capped, ratio, kl, approx_kl,
                  entropy) -> Dict[str, Any]:
    """:data:`METRIC_NAMES`, detached float32 0-d means over active tokens (0 when there is
    none), from per-token values of any one shape (one stacked reduction: a handful of
    launches, not one chain per metric)."""
    means = masked_means(xp, mask, (low | high, low, high, capped, ratio, kl, approx_kl,
                                    entropy), n_tok)
    return {name: means[i] for i, name in enumerate(METRIC_NAMES)}
