"""The operator table: how each public function is called, checked and referenced.

One :class:`Op` per public function under test. The fixture generator uses
``reference``/``reference_grad`` (the float64 spec) to write expected values;
the runner uses the argument lists to call ``loss.<name>`` of either
framework and the output names to compare. Adding an operator (e.g.
``policy_loss``) means adding one entry to :data:`OPS` and its cases to
``conformance/generate.py``; nothing else changes shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import numpy as np

from ratiokl import spec
from ratiokl.spec.tolerances import Tolerance

__all__ = ["OPS", "Op", "default_tolerances"]

Arrays = Mapping[str, Any]


def default_tolerances(op: "Op", dtype: str, logit_scale: float, grad_scale: float) -> Dict[str, Tolerance]:
    """Forward tolerance for every output and the gradient tolerance, from ``ratiokl.spec``."""
    fwd = spec.forward_tolerance(logit_scale)
    tols = {out: fwd for out in op.outputs}
    tols["grad"] = spec.grad_tolerance(dtype, logit_scale, grad_scale)
    return tols


@dataclass(frozen=True)
class Op:
    """How one public function is called and checked.

    Attributes:
        name: the function's name in ``ratiokl.<framework>.loss``.
        positional: argument names passed positionally, in order; a name
            missing from the case is passed as ``None``.
        keywords: argument names passed by keyword when the case has them
            (as an array, or as a scalar in the case's options).
        logit_args: arguments cast to the case's logits dtype.
        differentiate: the argument whose gradient is compared.
        outputs: output names, in the order ``unpack`` returns them.
        cotangents: outputs that receive an upstream cotangent
            (``cotangent_<name>`` in the case) for the gradient.
        neutral: per-row outputs and the exact value inactive rows must hold.
        unpack: maps the function's return value to ``{output: array}``.
        reference: float64 spec forward, ``(arguments) -> {output: array}``.
        reference_grad: float64 spec gradient w.r.t. ``differentiate``,
            ``(arguments, {output: cotangent}) -> array``.
        row_mask: name of the argument holding the row mask (``None``: all rows active).
        tolerances: ``(op, dtype, logit_scale, grad_scale) -> {output|"grad": Tolerance}``.
        fixed: keyword arguments every call of this entry passes (``return_entropy``).
        also_differentiate: further arguments whose gradients are compared (the ops from
            hidden states: ``weight``, ``bias``); ``reference_grad`` then returns
            ``{argument: gradient}`` for ``differentiate`` and these, the case stores
            ``expected_grad_<argument>`` beside ``expected_grad`` and its tolerances
            ``grad_<argument>``. An argument absent from a case (no ``bias``) is skipped.
        case_tolerances: ``(arguments, cotangents, dtype) -> {output|"grad"|"grad_<arg>":
            Tolerance}``, replacing ``tolerances`` where the bounds need the inputs (the ops
            from hidden states: their gradients are GEMM sums).
        vocab_arg: the argument whose first axis is the vocabulary (``weight``); None: the
            last axis of ``differentiate``.
        token_values: ``differentiate`` holds one value per token ``[...]`` (the log-probs
            of ``policy_objective``): the leading shape is its whole shape, there is no
            vocabulary (0), and the gradients of it and of ``also_differentiate`` must be
            exactly 0 on inactive tokens.
        takes_backend: whether the function takes ``backend=`` (``policy_objective``, which
            runs framework ops only, does not: every target runs it the same way).
        per_token_neutral: outputs that are per token in some calls only (the loss with
            ``loss_agg="none"``, ``[...]``; else 0-d) and the exact value inactive tokens
            hold then.
    """

    name: str
    positional: Tuple[str, ...]
    keywords: Tuple[str, ...]
    logit_args: Tuple[str, ...]
    differentiate: str
    outputs: Tuple[str, ...]
    cotangents: Tuple[str, ...]
    neutral: Mapping[str, float]
    unpack: Callable[[Any], Dict[str, Any]]
    reference: Callable[[Arrays], Dict[str, np.ndarray]]
    reference_grad: Callable[[Arrays, Arrays], np.ndarray]
    row_mask: Optional[str] = "mask"
    tolerances: Callable[["Op", str, float, float], Dict[str, Tolerance]] = field(
        default=default_tolerances
    )
    fixed: Mapping[str, Any] = field(default_factory=dict)
    also_differentiate: Tuple[str, ...] = ()
    case_tolerances: Optional[Callable[[Arrays, Arrays, str], Dict[str, Tolerance]]] = None
    vocab_arg: Optional[str] = None
    token_values: bool = False
    takes_backend: bool = True
    per_token_neutral: Mapping[str, float] = field(default_factory=dict)

    @property
    def arguments(self) -> Tuple[str, ...]:
        return self.positional + self.keywords


def _spec_args(args: Arrays, names: Tuple[str, ...]) -> Dict[str, Any]:
    return {k: args[k] for k in names if k in args}


_RATIO_KL_KW = ("ref_logps", "kl_estimator", "temperature")


def _ratio_kl_reference(args: Arrays) -> Dict[str, np.ndarray]:
    ratio, kl = spec.ratio_kl(
        args["policy_logits"], args.get("ref_logits"), args["action_ids"], args["mask"],
        args["old_logps"], **_spec_args(args, _RATIO_KL_KW),
    )
    return {"ratio": ratio, "kl": kl}


def _ratio_kl_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return spec.ratio_kl_grad(
        args["policy_logits"], args.get("ref_logits"), args["action_ids"], args["mask"],
        args["old_logps"], cot["ratio"], cot["kl"], **_spec_args(args, _RATIO_KL_KW),
    )


def _selected_reference(args: Arrays) -> Dict[str, np.ndarray]:
    logp = spec.selected_logprobs(
        args["logits"], args["action_ids"], args.get("mask"), **_spec_args(args, ("temperature",))
    )
    return {"logp": logp}


def _selected_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return spec.selected_logprobs_grad(
        args["logits"], args["action_ids"], args.get("mask"), cot["logp"],
        **_spec_args(args, ("temperature",)),
    )


_POLICY_POSITIONAL = (
    "policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages",
)
_POLICY_KW = (
    "ref_logps", "clip_eps", "clip_eps_high", "dual_clip", "ratio_cap", "kl_coef",
    "kl_estimator", "loss_agg", "loss_normalizer", "ratio_level", "segment_ids",
    "importance_weights", "log_ratio_bound", "temperature", "objective", "entropy_coef",
    "kl_agg", "entropy_agg", "kl_entropy_normalizer", "kl_clamp",
)
_POLICY_METRICS = (
    "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
    "ratio_mean", "kl_mean", "approx_kl", "entropy_mean",
)
#: ``policy_loss`` with the rollout correction: its arguments and metrics on top.
_ROLLOUT_KW = _POLICY_KW + ("rollout_logps", "rollout_correction", "rollout_bounds")


def _entropy_reference(args: Arrays) -> Dict[str, np.ndarray]:
    return {**_selected_reference(args),
            "entropy": spec.entropy(args["logits"], args.get("mask"),
                                    **_spec_args(args, ("temperature",)))}


def _entropy_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return _selected_grad(args, cot) + spec.entropy_grad(
        args["logits"], args.get("mask"), cot["entropy"], **_spec_args(args, ("temperature",)))


def _policy_reference(args: Arrays) -> Dict[str, np.ndarray]:
    positional = [args.get(k) for k in _POLICY_POSITIONAL]
    value, metrics = spec.policy_loss(*positional, **_spec_args(args, _ROLLOUT_KW))
    return {"loss": np.asarray(value, np.float64),
            **{k: np.float64(v) for k, v in metrics.items()}}


def _policy_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    positional = [args.get(k) for k in _POLICY_POSITIONAL]
    kw = _spec_args(args, _ROLLOUT_KW)
    if np.ndim(cot["loss"]):  # loss_agg="none": one upstream value per token
        return spec.policy_loss_grad(*positional, loss_cotangent=cot["loss"], **kw)
    return float(cot["loss"]) * spec.policy_loss_grad(*positional, **kw)


_OBJECTIVE_POSITIONAL = ("logps", "old_logps", "advantages", "mask")
_OBJECTIVE_KW = ("ref_logps", "entropy") + tuple(
    k for k in _ROLLOUT_KW if k not in ("ref_logps", "temperature"))


def _objective_args(args: Arrays):
    return [args.get(k) for k in _OBJECTIVE_POSITIONAL], _spec_args(args, _OBJECTIVE_KW)


def _objective_reference(args: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _objective_args(args)
    value, metrics = spec.policy_objective(*positional, **kw)
    return {"loss": np.asarray(value, np.float64),
            **{k: np.float64(v) for k, v in metrics.items()}}


def _objective_grad(args: Arrays, cot: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _objective_args(args)
    dlogps, dentropy = spec.policy_objective_grad(*positional, loss_cotangent=cot["loss"], **kw)
    return {"logps": dlogps, "entropy": dentropy}


def _objective_tolerances(args: Arrays, cot: Arrays, dtype: str) -> Dict[str, Tolerance]:
    """:func:`default_tolerances` with the log-probs' magnitude as the scale: the float32
    forward loses a few ulps of the largest active ``|logp|`` (of the policy, the behaviour
    policy, the reference and the engine), and the gradients are stored in ``dtype``."""
    mask = np.asarray(args["mask"], bool)
    scale = 0.0
    for key in ("logps", "old_logps", "ref_logps", "rollout_logps", "entropy"):
        if args.get(key) is not None:
            values = np.abs(np.asarray(args[key], np.float64)[mask])
            scale = max(scale, float(values[np.isfinite(values)].max(initial=0.0)))
    grads = _objective_grad(args, cot)
    tols = {out: spec.forward_tolerance(scale) for out in _OBJECTIVE_OUTPUTS}
    for key, grad in (("grad", grads["logps"]), ("grad_entropy", grads["entropy"])):
        finite = np.abs(grad[np.isfinite(grad)])
        tols[key] = spec.grad_tolerance(dtype, scale, float(finite.max(initial=0.0)))
    return tols


_LINEAR_KW = ("bias", "temperature", "logit_scale", "logit_softcap")


def _linear_args(args: Arrays):
    return ((args["hidden"], args["weight"], args["action_ids"], args.get("mask")),
            _spec_args(args, _LINEAR_KW))


def _linear_reference(args: Arrays, entropy: bool) -> Dict[str, np.ndarray]:
    positional, kw = _linear_args(args)
    out = spec.linear_selected_logprobs(*positional, return_entropy=entropy, **kw)
    return {"logp": out[0], "entropy": out[1]} if entropy else {"logp": out}


def _linear_grad(args: Arrays, cot: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _linear_args(args)
    grads = spec.linear_selected_logprobs_grad(*positional, cot["logp"], cot.get("entropy"),
                                               **kw)
    return {k: g for k, g in zip(("hidden", "weight", "bias"), grads) if g is not None}


def _linear_tolerances(args: Arrays, cot: Arrays, dtype: str) -> Dict[str, Tolerance]:
    """``ratiokl.spec.linear_forward_tolerance`` / ``linear_grad_tolerance``: the logits are
    the case's GEMM, rounded to ``dtype`` in the chunk, and the gradients GEMM sums."""
    positional, kw = _linear_args(args)
    mask = np.ones(np.shape(args["hidden"])[:-1], bool) if args.get("mask") is None \
        else np.asarray(args["mask"], bool)
    logits = spec.linear_logits(np.where(mask[..., None], args["hidden"], 0.0), args["weight"],
                                kw.get("bias"), logit_scale=kw.get("logit_scale", 1.0),
                                logit_softcap=kw.get("logit_softcap"))
    temp = np.broadcast_to(np.asarray(kw.get("temperature", 1.0), np.float64), mask.shape)
    with np.errstate(invalid="ignore"):
        z = np.abs(logits[mask] / temp[mask][:, None])
    scale = float(z[np.isfinite(z)].max(initial=0.0))
    vocab = np.shape(args["weight"])[0]
    tols = {"logp": spec.linear_forward_tolerance(dtype, scale, vocab),
            "entropy": spec.linear_forward_tolerance(dtype, scale, vocab, entropy=True)}
    magnitudes = spec.linear_grad_magnitudes(*positional, cot["logp"], cot.get("entropy"),
                                             **kw)
    for key, magnitude in zip(("grad", "grad_weight", "grad_bias"), magnitudes):
        if magnitude is not None:
            tols[key] = spec.linear_grad_tolerance(dtype, scale, magnitude)
    return tols


_SELECTED_LOGPROBS = Op(
    name="selected_logprobs",
    positional=("logits", "action_ids", "mask"),
    keywords=("temperature",),
    logit_args=("logits",),
    differentiate="logits",
    outputs=("logp",),
    cotangents=("logp",),
    neutral={"logp": 0.0},
    unpack=lambda result: {"logp": result},
    reference=_selected_reference,
    reference_grad=_selected_grad,
)


_POLICY_LOSS = Op(
    name="policy_loss",
    positional=_POLICY_POSITIONAL,
    keywords=_POLICY_KW,
    logit_args=("policy_logits", "ref_logits"),
    differentiate="policy_logits",
    outputs=("loss",) + _POLICY_METRICS,
    cotangents=("loss",),
    neutral={},
    unpack=lambda result: {"loss": result[0], **result[1]},
    reference=_policy_reference,
    reference_grad=_policy_grad,
    per_token_neutral={"loss": 0.0},
)


_OBJECTIVE_OUTPUTS = ("loss",) + _POLICY_METRICS + spec.ROLLOUT_METRIC_NAMES

_POLICY_OBJECTIVE = Op(
    name="policy_objective",
    positional=_OBJECTIVE_POSITIONAL,
    keywords=_OBJECTIVE_KW,
    logit_args=("logps", "entropy"),
    differentiate="logps",
    outputs=("loss",) + _POLICY_METRICS,
    cotangents=("loss",),
    neutral={},
    unpack=lambda result: {"loss": result[0], **result[1]},
    reference=_objective_reference,
    reference_grad=_objective_grad,
    also_differentiate=("entropy",),
    case_tolerances=_objective_tolerances,
    token_values=True,
    takes_backend=False,
    per_token_neutral={"loss": 0.0},
)


_LINEAR = Op(
    name="linear_selected_logprobs",
    positional=("hidden", "weight", "action_ids", "mask"),
    keywords=_LINEAR_KW + ("chunk_rows",),
    logit_args=("hidden", "weight", "bias"),
    differentiate="hidden",
    outputs=("logp",),
    cotangents=("logp",),
    neutral={"logp": 0.0},
    unpack=lambda result: {"logp": result},
    reference=lambda args: _linear_reference(args, False),
    reference_grad=_linear_grad,
    also_differentiate=("weight", "bias"),
    case_tolerances=_linear_tolerances,
    vocab_arg="weight",
)


OPS: Dict[str, Op] = {
    "ratio_kl": Op(
        name="ratio_kl",
        positional=("policy_logits", "ref_logits", "action_ids", "mask", "old_logps"),
        keywords=_RATIO_KL_KW,
        logit_args=("policy_logits", "ref_logits"),
        differentiate="policy_logits",
        outputs=("ratio", "kl"),
        cotangents=("ratio", "kl"),
        neutral={"ratio": 1.0, "kl": 0.0},
        unpack=lambda result: {"ratio": result[0], "kl": result[1]},
        reference=_ratio_kl_reference,
        reference_grad=_ratio_kl_grad,
    ),
    "selected_logprobs": _SELECTED_LOGPROBS,
    # The same call with ``return_entropy=True``: the entropy as a second output.
    "selected_logprobs_entropy": replace(
        _SELECTED_LOGPROBS, outputs=("logp", "entropy"), cotangents=("logp", "entropy"),
        neutral={"logp": 0.0, "entropy": 0.0},
        unpack=lambda result: {"logp": result[0], "entropy": result[1]},
        reference=_entropy_reference, reference_grad=_entropy_grad,
        fixed={"return_entropy": True}),
    "policy_loss": _POLICY_LOSS,
    # From hidden states and the lm_head: gradients to hidden, weight and bias.
    "linear_selected_logprobs": _LINEAR,
    "linear_selected_logprobs_entropy": replace(
        _LINEAR, outputs=("logp", "entropy"), cotangents=("logp", "entropy"),
        neutral={"logp": 0.0, "entropy": 0.0},
        unpack=lambda result: {"logp": result[0], "entropy": result[1]},
        reference=lambda args: _linear_reference(args, True),
        fixed={"return_entropy": True}),
    # The same call with the rollout correction: its arguments and metrics on top.
    "policy_loss_rollout": replace(
        _POLICY_LOSS, keywords=_ROLLOUT_KW,
        outputs=_POLICY_LOSS.outputs + spec.ROLLOUT_METRIC_NAMES),
    # On the trainer's own per-token log-probs and entropies: gradients to both.
    "policy_objective": _POLICY_OBJECTIVE,
    "policy_objective_rollout": replace(
        _POLICY_OBJECTIVE, outputs=_POLICY_OBJECTIVE.outputs + spec.ROLLOUT_METRIC_NAMES),
}
