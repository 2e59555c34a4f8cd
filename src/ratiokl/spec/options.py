"""String options and the integer codes kernels receive: one table each.

The validated option object is :mod:`ratiokl.spec.loss_options`; the checks that build
it, :mod:`ratiokl.spec.option_checks`.

Kernels take small integer codes as ``tl.constexpr`` (never strings, never
Python floats); every framework maps user strings through these tables, so
an unknown option is rejected with the same message everywhere.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Union, get_args

from ratiokl._codes import KL, Objective as ObjectiveCode

__all__ = [
    "BACKENDS",
    "BackendName",
    "Coefficient",
    "KLEstimator",
    "LossAgg",
    "Objective",
    "PolicyKLEstimator",
    "RatioLevel",
    "RolloutCorrection",
    "TermAgg",
    "DEFAULT_LOG_RATIO_BOUND",
    "DEFAULT_SAPO_TEMPERATURES",
    "KL_ESTIMATORS",
    "LOGIT_DTYPE_NAMES",
    "LOSS_AGGS",
    "OBJECTIVES",
    "POLICY_KL_ESTIMATORS",
    "RATIO_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "TERM_AGGS",
    "kl_estimator_code",
    "option_code",
]

#: The logit (and hidden-state / lm_head) dtypes every backend of both frameworks accepts,
#: by name; the math runs in float32 whatever the input.
LOGIT_DTYPE_NAMES = ("float32", "float16", "bfloat16")

#: The string options of the public functions, as types (the tables below give their codes).
BackendName = Literal["auto", "native", "triton", "interpret"]
KLEstimator = Literal["k1", "k2", "k3"]
PolicyKLEstimator = Literal["k1", "k2", "k3", "k1+", "k3+", "k3-is"]
LossAgg = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm", "none"]
RatioLevel = Literal["token", "sequence"]
Objective = Literal["ppo", "cispo", "sapo"]
#: ``kl_agg`` / ``entropy_agg``: an aggregation of its own for the KL or entropy term
#: (every ``LossAgg`` but ``"none"``).
TermAgg = Literal["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
RolloutCorrection = Literal["token-truncate", "token-mask", "sequence-truncate", "sequence-mask",
                            "token-clip", "sequence-geomean-mask"]

#: Schulman's estimators of KL(pi || pi_ref) from ``d = logp_ref - logp``.
KL_ESTIMATORS: Mapping[str, int] = {"k1": KL.K1, "k2": KL.K2, "k3": KL.K3}

#: Backends a caller may name; which ones run where is decided per framework.
BACKENDS = get_args(BackendName)


def option_code(name: str, value: str, table: Mapping[str, int]) -> int:
    """Integer code of ``value`` in ``table`` (a plain ``int``, as kernels take their
    constexprs); ``ValueError`` naming ``name`` otherwise."""
    try:
        return int(table[value])
    except (KeyError, TypeError):
        choices = ", ".join(repr(k) for k in table)
        raise ValueError(f"`{name}` must be one of {choices}; got {value!r}") from None


def kl_estimator_code(kl_estimator: str) -> int:
    """Integer code of a KL estimator name (``"k1"``, ``"k2"``, ``"k3"``)."""
    return option_code("kl_estimator", kl_estimator, KL_ESTIMATORS)


# --------------------------------------------------------------------------
# policy_loss options
# --------------------------------------------------------------------------

#: KL variants of ``policy_loss``: the estimator's value and the gradient it
#: carries. ``k1+``/``k3+`` take the value of k1/k3 and the gradient of k2
#: (verl's straight-through estimators); ``k3-is`` is k3 multiplied by the
#: importance ratio, differentiated through both (TRL/Liger
#: ``use_bias_correction_kl``, DeepSeek-V3.2's unbiased KL estimate).
POLICY_KL_ESTIMATORS: Mapping[str, int] = {
    **KL_ESTIMATORS, "k1+": KL.K1_PLUS, "k3+": KL.K3_PLUS, "k3-is": KL.K3_IS,
}

#: How per-token losses become one number (see docs/policy_loss.md for verl/TRL names);
#: ``"none"``: they do not (the per-token loss ``[...]``, for a trainer's own aggregation).
LOSS_AGGS: Mapping[str, int] = {name: code for code, name in enumerate(get_args(LossAgg))}

#: ``kl_agg`` / ``entropy_agg`` names and their codes (those of ``LOSS_AGGS``).
TERM_AGGS: Mapping[str, int] = {name: LOSS_AGGS[name] for name in get_args(TermAgg)}

#: Importance-ratio level: per token (PPO/GRPO) or per sequence (GSPO).
RATIO_LEVELS: Mapping[str, int] = {name: code for code, name in enumerate(get_args(RatioLevel))}

#: The per-token policy term: PPO's clipped surrogate, CISPO's clipped, detached
#: importance weight times the log-prob (MiniMax-M1), or SAPO's soft gate on the ratio.
OBJECTIVES: Mapping[str, int] = {"ppo": ObjectiveCode.PPO, "cispo": ObjectiveCode.CISPO,
                                 "sapo": ObjectiveCode.SAPO}
#: SAPO's default temperatures ``(tau for A > 0, tau for A <= 0)`` (the paper's, TRL's).
DEFAULT_SAPO_TEMPERATURES = (1.0, 1.05)

#: Rollout correction (``ratiokl.spec.rollout``): the log-weight's level (token or sequence)
#: and what the bounds do (truncate from above: TIS; clip to both bounds: TIS with a floor;
#: mask outside: rejection, IcePop; the geometric-mean sequence gate).
#: Code 0 is no correction (``rollout_correction=None``: metrics only).
ROLLOUT_CORRECTIONS: Mapping[str, int] = {
    name: code for code, name in enumerate(get_args(RolloutCorrection), 1)
}

#: Default bound on ``|log ratio|`` (and on ``|d|`` before k3's ``exp``): verl's
#: +-20. ``exp(20) ~ 4.9e8`` keeps ``A * ratio`` finite in float32 for any
#: sane advantage, while a ratio that far from 1 is clipped anyway.
DEFAULT_LOG_RATIO_BOUND = 20.0


#: A coefficient a trainer may change every step: a Python number, or a 0-d floating
#: tensor / array (traced under ``jax.jit`` / ``torch.compile``: no recompile per value).
Coefficient = Union[float, Any]
