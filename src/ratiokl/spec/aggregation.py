r"""How ``loss_agg`` turns per-token losses into one number: one table.

Every aggregation is a weighted sum over active tokens divided by a denominator,

.. math::

    \mathrm{loss} = \frac{1}{D} \sum_t a_t\, \mathrm{loss}_t

with :math:`a_t = 1 / |\text{active tokens of } t\text{'s sequence}|` where the row of
:data:`AGGREGATIONS` says ``per_sequence_length`` (else 1) and :math:`D` its
``denominator`` (:class:`ratiokl._codes.Denominator`: 1, the active tokens, the sequences
with an active token, or the padded length ``T``; a count of 0 counts as 1, its numerator
being 0). ``loss_normalizer`` (``kl_entropy_normalizer`` for a term aggregated apart)
replaces :math:`D`; ``"none"`` aggregates nothing (each token its own loss, weight 1).

The float64 spec (``ratiokl.spec.policy_loss``), the framework-neutral core
(``ratiokl._core.objective``) and the host's choice of the one-launch weights kernel
(:meth:`ratiokl.spec.PolicyLossOptions.uniform_weight`; the kernel counts
``Denominator.TOKENS`` on the device) all read this table.
"""

from __future__ import annotations

from typing import Callable, Mapping, NamedTuple

import numpy as np

from ratiokl._codes import Denominator

__all__ = ["AGGREGATIONS", "Aggregation", "aggregation_denominator", "aggregation_terms"]


class Aggregation(NamedTuple):
    """One ``loss_agg``: each token's weight ``a_t`` and the denominator ``D``."""

    per_sequence_length: bool  # a_t = 1 / (active tokens of t's sequence); False: 1
    denominator: Denominator

    @property
    def needs_sequences(self) -> bool:
        """Whether ``a_t`` or ``D`` needs the sequences (``segment_ids``, rows)."""
        return self.per_sequence_length or self.denominator == Denominator.SEQUENCES


#: ``loss_agg`` name -> its :class:`Aggregation` (verl's / TRL's names: docs/policy_loss.md).
AGGREGATIONS: Mapping[str, Aggregation] = {
    "token-mean": Aggregation(False, Denominator.TOKENS),
    "token-sum": Aggregation(False, Denominator.ONE),
    "seq-mean-token-mean": Aggregation(True, Denominator.SEQUENCES),
    "seq-mean-token-sum": Aggregation(False, Denominator.SEQUENCES),
    "seq-mean-token-sum-norm": Aggregation(False, Denominator.WIDTH),
    "none": Aggregation(False, Denominator.ONE),
}


def aggregation_denominator(agg: str, n_tok, n_seq, width: int,
                            maximum: Callable = max):
    """``D`` of ``loss_agg=agg`` (without a normaliser): ``maximum(n_tok, 1)``,
    ``maximum(n_seq, 1)``, ``float(width)`` or ``1.0``.

    ``n_tok`` / ``n_seq``: the active tokens / sequences (Python ints, or a framework's
    0-d integer arrays with its elementwise ``maximum``); only the one ``D`` names is
    read. ``width``: the padded length ``T``.
    """
    kind = AGGREGATIONS[agg].denominator
    if kind == Denominator.TOKENS:
        return maximum(n_tok, 1)
    if kind == Denominator.SEQUENCES:
        return maximum(n_seq, 1)
    return float(width) if kind == Denominator.WIDTH else 1.0


def aggregation_terms(mask, seq, n_seq: int, agg: str, loss_normalizer):
    """Float64 per-token weights ``a`` ``[...]`` and the denominator ``D`` (a float) of
    ``sum(a * loss) / D`` of the aggregation ``agg`` (a ``loss_agg`` name); ``seq`` /
    ``n_seq``: :func:`ratiokl.spec.sequence_index` of ``mask``; ``loss_normalizer``
    (None, or a number) replaces ``D``."""
    weights = np.where(mask, 1.0, 0.0)
    if AGGREGATIONS[agg].per_sequence_length:
        counts = np.bincount(seq[mask], minlength=n_seq).astype(np.float64)
        weights[mask] = 1.0 / counts[seq[mask]]
    if loss_normalizer is not None:
        return weights, float(loss_normalizer)
    width = mask.shape[-1] if mask.shape else 1
    return weights, float(aggregation_denominator(agg, int(mask.sum()), n_seq, width))
