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
from ratiokl.harness import _references as _refs
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
        logit_args: arguments cast to the case's logits dtype (or to their own, where the
            case's ``input_dtypes`` names one).
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
        case_tolerances: ``(arguments, cotangents, dtypes) -> {output|"grad"|"grad_<arg>":
            Tolerance}`` (``dtypes``: each of ``logit_args``' dtype in the case), replacing
            ``tolerances`` where the bounds need the inputs (the ops from hidden states:
            their gradients are GEMM sums).
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
    case_tolerances: Optional[Callable[[Arrays, Arrays, Mapping[str, str]],
                                       Dict[str, Tolerance]]] = None
    vocab_arg: Optional[str] = None
    token_values: bool = False
    takes_backend: bool = True
    per_token_neutral: Mapping[str, float] = field(default_factory=dict)

    @property
    def arguments(self) -> Tuple[str, ...]:
        return self.positional + self.keywords


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
    reference=_refs.selected_reference,
    reference_grad=_refs.selected_grad,
)


_POLICY_LOSS = Op(
    name="policy_loss",
    positional=_refs.POLICY_POSITIONAL,
    keywords=_refs.POLICY_KW,
    logit_args=("policy_logits", "ref_logits"),
    differentiate="policy_logits",
    outputs=("loss",) + _refs.POLICY_METRICS,
    cotangents=("loss",),
    neutral={},
    unpack=lambda result: {"loss": result[0], **result[1]},
    reference=_refs.policy_reference,
    reference_grad=_refs.policy_grad,
    per_token_neutral={"loss": 0.0},
)


# ``policy_loss``'s outputs, from the trainer's own per-token log-probs and entropies.
_POLICY_OBJECTIVE = replace(
    _POLICY_LOSS,
    name="policy_objective",
    positional=_refs.OBJECTIVE_POSITIONAL,
    keywords=_refs.OBJECTIVE_KW,
    logit_args=("logps", "entropy"),
    differentiate="logps",
    reference=_refs.objective_reference,
    reference_grad=_refs.objective_grad,
    also_differentiate=("entropy",),
    case_tolerances=_refs.objective_tolerances,
    token_values=True,
    takes_backend=False,
)


_LINEAR = Op(
    name="linear_selected_logprobs",
    positional=("hidden", "weight", "action_ids", "mask"),
    keywords=_refs.LINEAR_KW + ("chunk_rows",),
    logit_args=("hidden", "weight", "bias"),
    differentiate="hidden",
    outputs=("logp",),
    cotangents=("logp",),
    neutral={"logp": 0.0},
    unpack=lambda result: {"logp": result},
    reference=lambda args: _refs.linear_reference(args, False),
    reference_grad=_refs.linear_grad,
    also_differentiate=("weight", "bias"),
    case_tolerances=_refs.linear_tolerances,
    vocab_arg="weight",
)


OPS: Dict[str, Op] = {
    "ratio_kl": Op(
        name="ratio_kl",
        positional=("policy_logits", "ref_logits", "action_ids", "mask", "old_logps"),
        keywords=_refs.RATIO_KL_KW,
        logit_args=("policy_logits", "ref_logits"),
        differentiate="policy_logits",
        outputs=("ratio", "kl"),
        cotangents=("ratio", "kl"),
        neutral={"ratio": 1.0, "kl": 0.0},
        unpack=lambda result: {"ratio": result[0], "kl": result[1]},
        reference=_refs.ratio_kl_reference,
        reference_grad=_refs.ratio_kl_grad,
    ),
    "selected_logprobs": _SELECTED_LOGPROBS,
    # The same call with ``return_entropy=True``: the entropy as a second output.
    "selected_logprobs_entropy": replace(
        _SELECTED_LOGPROBS, outputs=("logp", "entropy"), cotangents=("logp", "entropy"),
        neutral={"logp": 0.0, "entropy": 0.0},
        unpack=lambda result: {"logp": result[0], "entropy": result[1]},
        reference=_refs.entropy_reference, reference_grad=_refs.entropy_grad,
        fixed={"return_entropy": True}),
    "policy_loss": _POLICY_LOSS,
    # From hidden states and the lm_head: gradients to hidden, weight and bias.
    "linear_selected_logprobs": _LINEAR,
    "linear_selected_logprobs_entropy": replace(
        _LINEAR, outputs=("logp", "entropy"), cotangents=("logp", "entropy"),
        neutral={"logp": 0.0, "entropy": 0.0},
        unpack=lambda result: {"logp": result[0], "entropy": result[1]},
        reference=lambda args: _refs.linear_reference(args, True),
        fixed={"return_entropy": True}),
    # The same call with the rollout correction: its arguments and metrics on top.
    "policy_loss_rollout": replace(
        _POLICY_LOSS, keywords=_refs.ROLLOUT_KW,
        outputs=_POLICY_LOSS.outputs + spec.ROLLOUT_METRIC_NAMES + spec.ROLLOUT_PARITY_NAMES),
    # On the trainer's own per-token log-probs and entropies: gradients to both.
    "policy_objective": _POLICY_OBJECTIVE,
    "policy_objective_rollout": replace(
        _POLICY_OBJECTIVE,
        outputs=_POLICY_OBJECTIVE.outputs + spec.ROLLOUT_METRIC_NAMES + spec.ROLLOUT_PARITY_NAMES),
}
