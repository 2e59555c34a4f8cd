"""``policy_loss``'s validated scalar options, and what they imply for each path.

Built once per call by :func:`ratiokl.spec.policy_loss_options` (the checks:
:mod:`ratiokl.spec.option_checks`); every path below the public functions takes this
frozen object: the float64 spec, the framework-neutral core and the kernels' launches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ratiokl._codes import Denominator, Objective as ObjectiveCode
from ratiokl.spec.aggregation import AGGREGATIONS, aggregation_denominator
from ratiokl.spec.options import LOSS_AGGS, Coefficient, LossAgg

__all__ = ["PolicyLossOptions", "check_loss_normalizer", "check_term_normalizer"]

#: ``loss_agg`` names by code (``LOSS_AGGS`` inverted).
_LOSS_AGG_NAMES: Tuple[LossAgg, ...] = tuple(LOSS_AGGS)


@dataclass(frozen=True)
class PolicyLossOptions:
    """Validated scalar options of ``policy_loss`` (shared by both frameworks).

    ``ratio_low``, ``ratio_high``, ``kl_coef`` and ``entropy_coef`` are Python floats,
    or 0-d float arrays of the caller's framework when the caller passed its
    coefficients as such (not inspected: that would synchronise).
    """

    ratio_low: Coefficient  # 1 - clip_eps: floor of the ratio for A < 0
    ratio_high: Coefficient  # min(1 + clip_eps_high, ratio_cap): ceiling for A > 0
    neg_cap: Optional[float]  # min(dual_clip, ratio_cap): ceiling for A < 0, or None
    kl_coef: Coefficient
    kl_code: int  # POLICY_KL_ESTIMATORS
    agg_code: int  # LOSS_AGGS
    sequence_ratio: bool  # RATIO_LEVELS == "sequence"
    log_ratio_bound: Optional[float]  # None: no bound
    objective_code: int = 0  # OBJECTIVES
    entropy_coef: Coefficient = 0.0  # weight of -agg(entropy) in the loss (verl's entropy_coeff)
    kl_agg_code: Optional[int] = None  # TERM_AGGS: the KL term aggregated apart; None: loss_agg's
    entropy_agg_code: Optional[int] = None  # the same for the entropy term
    kl_clamp: Optional[float] = None  # the KL estimator's value clamped to [-c, c]; None: not
    sapo_tau: Tuple[float, float] = (1.0, 1.0)  # SAPO's temperatures (A > 0, A <= 0)

    @property
    def kl_agg(self) -> Optional[LossAgg]:
        """The KL term's own aggregation (``kl_agg``), or None: inside ``loss_agg``'s."""
        return None if self.kl_agg_code is None else _LOSS_AGG_NAMES[self.kl_agg_code]

    @property
    def entropy_agg(self) -> Optional[LossAgg]:
        """The entropy term's own aggregation (``entropy_agg``), or None: inside ``loss_agg``'s."""
        return None if self.entropy_agg_code is None else _LOSS_AGG_NAMES[self.entropy_agg_code]

    @property
    def split_terms(self) -> bool:
        """Whether the KL or the entropy term is aggregated apart from the policy term."""
        return self.kl_agg_code is not None or self.entropy_agg_code is not None

    @property
    def fuses(self) -> bool:
        """Whether the fused policy-loss kernels express these options: not with a term
        aggregated apart (the kernels weigh each row's whole loss by one weight) nor with
        ``kl_clamp``, nor SAPO's soft gate; those calls take the two-pass route (the
        backend's log-probs and entropies, then ``ratiokl._core.objective``)."""
        return not self.split_terms and self.kl_clamp is None and not self.sapo

    @property
    def cispo(self) -> bool:
        """Whether the policy term is CISPO's ``-sg(clip(r)) * A * logp``."""
        return self.objective_code == ObjectiveCode.CISPO

    @property
    def sapo(self) -> bool:
        """Whether the policy term is SAPO's ``-A * 4 / tau * sigmoid(tau * (r - 1))``."""
        return self.objective_code == ObjectiveCode.SAPO

    @property
    def uses_kl(self) -> bool:
        """Whether the KL term may weigh in: ``kl_coef`` is not the number 0 (a tensor may)."""
        return not (isinstance(self.kl_coef, float) and self.kl_coef == 0.0)

    @property
    def uses_entropy(self) -> bool:
        """Whether the entropy term may weigh in (and reach the gradient): ``entropy_coef``
        is not the number 0 (a tensor may be). The entropy is computed either way, for
        ``metrics["entropy_mean"]``."""
        return not (isinstance(self.entropy_coef, float) and self.entropy_coef == 0.0)

    @property
    def loss_agg(self) -> LossAgg:
        """The ``loss_agg`` name of ``agg_code`` (host code compares names; kernels, codes)."""
        return _LOSS_AGG_NAMES[self.agg_code]

    @property
    def seq_aggregation(self) -> bool:
        """Whether ``loss_agg`` averages over sequences (``seq-mean-token-{mean,sum}``)."""
        return AGGREGATIONS[self.loss_agg].needs_sequences

    @property
    def needs_segments(self) -> bool:
        """Whether any term's aggregation (or GSPO's ratio) needs the sequences."""
        aggs = (self.loss_agg, self.kl_agg, self.entropy_agg)
        return self.sequence_ratio or any(AGGREGATIONS[a].needs_sequences
                                          for a in aggs if a is not None)

    def uniform_weight(self, normalizer: object, width: int) -> Optional[Tuple[float, bool]]:
        """``(denom, count)`` of the aggregation weights ``w = where(mask, 1 / D, 0)`` where
        every active token weighs the same, else None.

        ``count`` True: ``D`` is the active count (``token-mean`` without a normaliser;
        ``denom`` unused), which ``token_weights_kernel`` counts on the device; False:
        ``D`` is the number ``denom``, one framework op. None: ``seq-mean-token-mean``
        weighs tokens by their sequence's length, sequence counts need segments, and a
        normaliser given as an array is device data; those take the framework's ops.
        ``normalizer``: ``loss_normalizer`` (None, a Python number or an array);
        ``width``: tokens per sequence ``T``.
        """
        if self.loss_agg == "none":  # each active token its own loss: weight 1
            return 1.0, False
        agg = AGGREGATIONS[self.loss_agg]
        if agg.per_sequence_length:
            return None
        if isinstance(normalizer, (int, float)) and not isinstance(normalizer, bool):
            return float(normalizer), False
        if normalizer is not None or agg.denominator == Denominator.SEQUENCES:
            return None
        if agg.denominator == Denominator.TOKENS:
            return 1.0, True
        return aggregation_denominator(self.loss_agg, None, None, width), False


def check_loss_normalizer(loss_agg: str, loss_normalizer: object) -> None:
    """``loss_normalizer`` replaces an aggregation's denominator: ``ValueError`` naming it
    with ``loss_agg="none"``, which aggregates nothing."""
    if loss_agg == "none" and loss_normalizer is not None:
        raise ValueError(
            '`loss_normalizer` has no meaning with loss_agg="none" (the per-token loss is '
            "returned unreduced); pass loss_normalizer=None and divide by it where you "
            "reduce the per-token loss"
        )


def check_term_normalizer(opts: PolicyLossOptions, kl_entropy_normalizer: object) -> None:
    """``kl_entropy_normalizer`` is the denominator of the terms ``kl_agg`` / ``entropy_agg``
    aggregate apart: ``ValueError`` naming it when neither is set."""
    if kl_entropy_normalizer is not None and not opts.split_terms:
        raise ValueError(
            "`kl_entropy_normalizer` is the denominator of the KL / entropy terms aggregated "
            "apart by `kl_agg` / `entropy_agg`, and neither is set; pass kl_agg= or "
            "entropy_agg= (e.g. \"token-mean\"), or kl_entropy_normalizer=None (the terms then "
            "follow loss_agg and loss_normalizer)"
        )
