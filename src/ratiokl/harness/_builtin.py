"""ratiokl's own (framework, backend) targets, written in the check-target protocol."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ratiokl.harness._frameworks import TARGETS, Outcome, call_target
from ratiokl.harness._protocol import TargetCall, TargetResult

__all__ = ["BuiltinTarget", "builtin_target", "result_of"]


@dataclass(frozen=True)
class BuiltinTarget:
    """``ratiokl.<framework>.loss`` on one backend (``"torch-native"`` ...) as a
    :class:`~ratiokl.harness.CheckTarget`: it supports every case, checks the output
    and gradient dtypes, and with ``strided`` (PyTorch only) passes the main logits as a
    strided view whose unused slots must get no gradient."""

    target: str
    strided: bool = False

    @property
    def name(self) -> str:
        return self.target

    def supports(self, call: TargetCall) -> Optional[str]:
        return None

    def __call__(self, call: TargetCall) -> TargetResult:
        return result_of(call, call_target(call, self.target, strided=self.strided))


def builtin_target(name: str, *, strided: bool = False) -> BuiltinTarget:
    """The built-in target ``name`` (one of ``TARGETS``); ``ValueError`` naming the choices."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
    if strided and TARGETS[name].framework != "torch":
        raise ValueError(f"`strided` needs a PyTorch target; {name!r} is not one "
                         "(JAX arrays carry no strides)")
    return BuiltinTarget(name, strided)


def result_of(call: TargetCall, outcome: Outcome) -> TargetResult:
    """An :class:`Outcome` of ``call_target`` as the protocol's result (dtypes kept)."""
    main, *extra = call.grads
    return TargetResult(
        outputs=outcome.outputs,
        grads={main: outcome.grad, **{k: outcome.extra_grads[k] for k in extra
                                      if k in outcome.extra_grads}},
        output_dtypes=outcome.output_dtypes,
        grad_dtypes={main: outcome.grad_dtype, **outcome.extra_grad_dtypes},
        stride_gap_grad=outcome.stride_gap_grad,
    )
