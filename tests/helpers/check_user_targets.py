"""A user's own check targets for ``tests/test_check_target.py`` (imported by ``--target
check_user_targets:NAME`` as a user's module would be): the example port, a deliberately
wrong one and one that refuses an option."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import numpy as np

from ratiokl.harness import TargetCall, TargetResult

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: examples/
from examples import check_target_port as port  # noqa: E402

__all__ = ["NOT_A_TARGET", "NoPerRowTemperature", "SignFlippedK3", "TARGET", "make_target",
           "needs_arguments", "port"]


class SignFlippedK3(port.TorchRatioKL):
    """k3 computed on ``-d``: the estimator's value and gradient are wrong wherever d != 0."""

    name = "sign-flipped-k3"

    def __call__(self, call: TargetCall) -> TargetResult:
        if call.option("kl_estimator", "k3") != "k3":
            return super().__call__(call)
        k1 = super().__call__(TargetCall(**{**call.__dict__, "arguments": {
            **call.arguments, "kl_estimator": "k1"}}))
        d = -np.asarray(k1.outputs["kl"], np.float64)  # k1 = -d
        wrong = np.expm1(-d) + d  # k3 of -d
        return TargetResult(outputs={**k1.outputs, "kl": wrong.astype(np.float32)},
                            grads=k1.grads)


class NoPerRowTemperature(port.TorchRatioKL):
    """A port that takes a scalar temperature only, and says so."""

    name = "scalar-temperature"

    def supports(self, call: TargetCall) -> Optional[str]:
        if np.ndim(call.option("temperature", 1.0)):
            return "per-row temperature [...] is not supported (a scalar only)"
        return super().supports(call)


NOT_A_TARGET = {"name": "a dict"}


#: An instance, and a factory returning one: both are what ``--target`` may name.
TARGET = port.TorchRatioKL()


def make_target() -> port.TorchRatioKL:
    return port.TorchRatioKL()


def needs_arguments(scale: float) -> port.TorchRatioKL:
    """Not a zero-argument factory: ``--target`` refuses it."""
    return port.TorchRatioKL()
