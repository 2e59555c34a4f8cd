"""String options and the integer codes kernels receive: one table each.

Kernels take small integer codes as ``tl.constexpr`` (never strings, never
Python floats); every framework maps user strings through these tables, so
an unknown option is rejected with the same message everywhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Tuple, Union, get_args

from ratiokl._codes import KL, Denominator, Objective as ObjectiveCode
from ratiokl.spec.aggregation import AGGREGATIONS, aggregation_denominator

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
    "KL_ESTIMATORS",
    "LOGIT_DTYPE_NAMES",
    "LOSS_AGGS",
    "OBJECTIVES",
    "POLICY_KL_ESTIMATORS",
    "PolicyLossOptions",
    "RATIO_LEVELS",
    "ROLLOUT_CORRECTIONS",
    "TERM_AGGS",
    "check_term_normalizer",
    "check_loss_normalizer",
    "kl_estimator_code",
    "option_code",
    "policy_loss_options",
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
Objective = Literal["ppo", "cispo"]
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
#: ``loss_agg`` names by code (``LOSS_AGGS`` inverted).
_LOSS_AGG_NAMES: Tuple[LossAgg, ...] = get_args(LossAgg)

#: ``kl_agg`` / ``entropy_agg`` names and their codes (those of ``LOSS_AGGS``).
TERM_AGGS: Mapping[str, int] = {name: LOSS_AGGS[name] for name in get_args(TermAgg)}

#: Importance-ratio level: per token (PPO/GRPO) or per sequence (GSPO).
RATIO_LEVELS: Mapping[str, int] = {name: code for code, name in enumerate(get_args(RatioLevel))}

#: The per-token policy term: PPO's clipped surrogate, or CISPO's clipped, detached
#: importance weight times the log-prob (MiniMax-M1).
OBJECTIVES: Mapping[str, int] = {"ppo": ObjectiveCode.PPO, "cispo": ObjectiveCode.CISPO}

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
        ``kl_clamp``; those calls take the two-pass route (the backend's log-probs and
        entropies, then ``ratiokl._core.objective``)."""
        return not self.split_terms and self.kl_clamp is None

    @property
    def cispo(self) -> bool:
        """Whether the policy term is CISPO's ``-sg(clip(r)) * A * logp``."""
        return self.objective_code == ObjectiveCode.CISPO

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
    cached: bool = True,
) -> PolicyLossOptions:
    """Check ``policy_loss``'s scalar options; errors name the argument and the fix.

    ``clip_eps``, ``clip_eps_high``, ``kl_coef`` and ``entropy_coef`` may be 0-d
    floating arrays (their values are then the caller's responsibility: reading them would
    synchronise). ``kl_agg`` / ``entropy_agg`` (``TERM_AGGS`` names or None) aggregate
    the KL / entropy term apart (not with ``loss_agg="none"``); ``kl_clamp`` (a number > 0
    or None) clamps the KL value. With ``cached``, calls with Python values only are
    cached: a step pays the checks once per distinct option set (a tracer such as
    ``torch.compile``, which sees through caches, passes False).
    """
    args = (clip_eps, clip_eps_high, dual_clip, ratio_cap, kl_coef, kl_estimator, loss_agg,
            ratio_level, log_ratio_bound, objective, entropy_coef, kl_agg, entropy_agg, kl_clamp)
    # Python values only (their exact types: a subclass takes the checks every call):
    # the cache. One C-level pass, no Python call per value (host time per call).
    if cached and all(map(_SCALAR_TYPES.__contains__, map(type, args))):
        return _cached_policy_loss_options(*args)
    return _policy_loss_options(*args)


def _policy_loss_options(clip_eps, clip_eps_high, dual_clip, ratio_cap, kl_coef,
                         kl_estimator, loss_agg, ratio_level,
                         log_ratio_bound, objective, entropy_coef, kl_agg=None,
                         entropy_agg=None, kl_clamp=None) -> PolicyLossOptions:
    objective_code = option_code("objective", objective, OBJECTIVES)
    cispo = objective_code == ObjectiveCode.CISPO
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
    )


#: Python-valued option sets, checked once each (typed: ``True`` is not ``1``).
_cached_policy_loss_options = functools.lru_cache(maxsize=256, typed=True)(_policy_loss_options)
