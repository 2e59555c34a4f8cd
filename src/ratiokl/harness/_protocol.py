"""The check-target protocol: how ``ratiokl check --target`` calls any implementation.

A target is an object with a ``name``, a ``supports(call)`` method and a ``__call__(call)``
method (:class:`CheckTarget`). For every fixture case the runner builds a
:class:`TargetCall` (the case's inputs as NumPy arrays, its scalar options and its upstream
gradients, without its expectations) and asks ``supports(call)``: ``None`` runs the case,
a string skips it and is reported as the reason. A run returns a :class:`TargetResult`:
the outputs it computed and the gradients :attr:`TargetCall.grads` names, NumPy arrays (any
float dtype; compared in float64). ratiokl's own six targets are written in this protocol
(``ratiokl.harness.builtin_target``), and so are the trainers' own loss codes in
``ratiokl.harness.targets``.

``load_target("package.module:object")`` imports a target the way ``--target`` does.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

from ratiokl.harness._cases import Case
from ratiokl.harness._ops import OPS, Op

__all__ = ["CheckTarget", "TargetCall", "TargetResult", "load_target"]


@dataclass(frozen=True)
class TargetCall:
    """One fixture case as a target sees it: what to compute, never the expected answer.

    Attributes:
        case: the case's name (``vocab_2_fp32``); ``group``: its group (``vocab_2``).
        op: the ratiokl function the case calls (``OPS``' keys: ``"ratio_kl"``,
            ``"policy_loss"``, ``"policy_objective"``, ...); ``*_entropy`` ops also return
            the entropy, ``*_rollout`` ones take the rollout correction.
        dtype: the dtype of the logits (or log-probs, hidden states) arguments:
            ``"float32"``, ``"float16"`` or ``"bfloat16"``. Those arrays arrive as float32
            holding values exactly representable in ``dtype``: cast them to it, or to their
            own dtype where ``input_dtypes`` names one (:meth:`dtype_of`).
        arguments: the function's arguments present in the case, by name: NumPy arrays
            (``mask`` boolean ``[...]``; ids integer; others float32) and scalar options
            (``kl_estimator="k3"``, ``clip_eps=0.2``; ``rollout_bounds`` a tuple). An option
            absent here takes ratiokl's default (``ratiokl.spec.policy_loss.POLICY_LOSS_DEFAULTS``).
        cotangents: the upstream gradient of each differentiated output (``{"loss": 1.0}``,
            ``{"ratio": [...], "kl": [...]}``); the gradients to return are those of
            ``sum(output * cotangent)`` over these outputs.
        outputs: every output the case has an expectation for (``"loss"`` and the metrics,
            ``"ratio"``, ``"logp"``, ...); a target may omit the metrics it has no
            equivalent of (they are listed as unchecked), not the differentiated outputs.
        grads: the arguments whose gradients are compared, first the main one
            (``"policy_logits"``, ``"logps"``, ``"hidden"``), then e.g. ``"entropy"``.
        row_mask: the argument holding the active-row mask (``"mask"``) or None. Inactive
            rows must hold the neutral outputs (ratio 1, KL / log-prob / entropy 0) and an
            exactly-zero gradient, whatever their inputs hold (NaN, inf, bad ids).
        expect_error: an exception type name (``"ValueError"``) the call must raise instead,
            its message naming the bad argument; None for an ordinary case.
        input_dtypes: the arguments whose dtype is not ``dtype`` (``{"weight": "float32"}``
            beside bfloat16 hidden states); each gradient has its argument's dtype.
    """

    case: str
    group: str
    op: str
    dtype: str
    arguments: Mapping[str, Any]
    cotangents: Mapping[str, np.ndarray]
    outputs: Tuple[str, ...]
    grads: Tuple[str, ...]
    row_mask: Optional[str]
    expect_error: Optional[str] = None
    description: str = ""
    input_dtypes: Mapping[str, str] = field(default_factory=dict)
    #: The case's operator-table entry when it is not ``OPS[op]`` (a test's variant).
    _spec: Optional[Op] = field(default=None, repr=False, compare=False)

    @classmethod
    def of(cls, case: Case) -> "TargetCall":
        """The call of a loaded :class:`~ratiokl.harness.Case`."""
        op = case.spec
        return cls(case=case.name, group=case.group, op=case.op, dtype=case.dtype,
                   arguments=case.arguments(),
                   cotangents={o: case.arrays[f"cotangent_{o}"] for o in op.cotangents
                               if f"cotangent_{o}" in case.arrays},  # none: expect_error
                   outputs=op.outputs, grads=(op.differentiate, *case.also_differentiated),
                   row_mask=op.row_mask, expect_error=case.expect_error,
                   description=case.description, input_dtypes=dict(case.input_dtypes),
                   _spec=None if op is OPS.get(case.op) else op)

    @property
    def spec(self) -> Op:
        """The operator table's entry for :attr:`op` (argument lists, outputs)."""
        return OPS[self.op] if self._spec is None else self._spec

    def dtype_of(self, argument: str) -> str:
        """The dtype to cast a logits (hidden-state, weight) argument to."""
        return self.input_dtypes.get(argument, self.dtype)

    def option(self, name: str, default: Any = None) -> Any:
        """A scalar option or array argument of the case, or ``default`` when absent."""
        return self.arguments.get(name, default)


@dataclass
class TargetResult:
    """What a target computed for one :class:`TargetCall`.

    Attributes:
        outputs: NumPy arrays by output name, in the shapes the case expects (a 0-d loss, a
            ``[...]`` ratio). Omitted metrics are listed as unchecked, not failed.
        grads: NumPy arrays by argument name, each of that argument's shape.
        output_dtypes / grad_dtypes: the framework dtypes (``"float32"``, ``"bfloat16"``)
            where the target wants them checked (ratiokl's own targets: outputs float32,
            gradients in the case's dtype); absent names are not checked.
        stride_gap_grad: for a target that ran on a strided view of the main argument, the
            gradient that reached the view's unused slots (must be all zero); else None.
    """

    outputs: Mapping[str, np.ndarray]
    grads: Mapping[str, np.ndarray]
    output_dtypes: Mapping[str, str] = field(default_factory=dict)
    grad_dtypes: Mapping[str, str] = field(default_factory=dict)
    stride_gap_grad: Optional[np.ndarray] = None


@runtime_checkable
class CheckTarget(Protocol):
    """An implementation ``ratiokl check`` can run the fixtures on.

    ``supports(call)`` returns None to run the case or the reason it cannot (an op or
    option the implementation lacks, a documented semantic difference); ``__call__``
    computes it. An exception from ``__call__`` is a reported failure of that case (or its
    pass, for an ``expect_error`` case whose message names the argument).
    """

    name: str

    def supports(self, call: TargetCall) -> Optional[str]:
        ...

    def __call__(self, call: TargetCall) -> TargetResult:
        ...


_FORM = "'package.module:object' (e.g. 'my_losses.check:TARGET')"


def load_target(spec: str, *, argument: str = "--target") -> CheckTarget:
    """Import the target ``spec`` names: ``"package.module:object"``, ``object`` a
    :class:`CheckTarget` instance, or a class / function that returns one when called with
    no arguments. ``ValueError`` naming ``argument`` and the fix otherwise."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"{argument} {spec!r} is not of the form {_FORM}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"{argument} {spec!r}: cannot import {module_name!r} "
                         f"({type(error).__name__}: {error}); put its package on PYTHONPATH "
                         "or install it") from error
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{argument} {spec!r}: {module_name!r} has no attribute "
                             f"{attribute!r}; name an object defined in that module")
        obj = getattr(obj, part)
    if inspect.isclass(obj) or (inspect.isfunction(obj) and not _takes_arguments(obj)):
        obj = obj()
    if not isinstance(obj, CheckTarget):
        raise ValueError(f"{argument} {spec!r} is a {type(obj).__name__}, not a check target: "
                         "it needs a `name`, `supports(call)` and `__call__(call)` (see "
                         "ratiokl.harness.CheckTarget and docs/check.md)")
    return obj


def _takes_arguments(factory: Any) -> bool:
    """Whether ``factory`` needs arguments (then it is not a zero-argument factory)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD,
                                                   p.KEYWORD_ONLY) for p in parameters)
