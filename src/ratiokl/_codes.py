"""The integer codes of the string options, defined once.

The spec's option tables (``ratiokl.spec.options``) map the user's strings to
these codes; the kernels receive them as ``tl.constexpr`` (``ratiokl._kernels.codes``
holds their constexpr twins) and both frameworks' native paths branch on them. Imports
only the standard library, so the spec (NumPy only) and the kernel package (Triton
only) can both depend on it.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["Denominator", "KL", "Objective"]


class KL(IntEnum):
    """KL estimators on ``d = logp_ref - logp``: ``ratio_kl``'s three (``kl_estimator``),
    then ``policy_loss``'s variants (their value and the gradient they carry)."""

    NONE = 0  # no KL term (no reference): the kernels skip it
    K1 = 1  # -d
    K2 = 2  # d^2 / 2
    K3 = 3  # exp(d) - d - 1
    K1_PLUS = 4  # the value of k1, the gradient of k2 (verl's "k1+")
    K3_PLUS = 5  # the value of k3, the gradient of k2 (verl's "k3+")
    K3_IS = 6  # r * k3, differentiated through both ("k3-is")


class Objective(IntEnum):
    """The per-token policy term of ``policy_loss(objective=...)``."""

    PPO = 0  # the clipped surrogate -A * clip(r) * iw
    CISPO = 1  # -sg(clip(r)) * A * iw * logp (MiniMax-M1)
    SAPO = 2  # -A * iw * 4 / tau * sigmoid(tau * (r - 1)) (Qwen's soft gate)


class Denominator(IntEnum):
    """What ``loss_agg`` divides the weighted sum of per-token losses by (the ``D`` of
    ``ratiokl.spec.AGGREGATIONS``); a count of 0 counts as 1."""

    ONE = 0  # 1: a sum (token-sum, and "none", which aggregates nothing)
    TOKENS = 1  # the active tokens (token-mean; the kernels' ``token_weights_kernel``)
    SEQUENCES = 2  # the sequences with an active token (seq-mean-*)
    WIDTH = 3  # the padded length T of a sequence (seq-mean-token-sum-norm)
