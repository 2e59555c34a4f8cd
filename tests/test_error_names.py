"""Each public op's errors name its own arguments, in both frameworks: for each argument
an op validates, a bad value raises an error whose first backticked name is that argument
and whose every backticked name that is some op's argument is one of this op's."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

B, T, V, H = 2, 3, 5, 4
# Each op's positional arguments, good: logits-like [B, T, V], hidden [B, T, H].
GOOD = {
    "selected_logprobs": ("logits", "action_ids", "mask"),
    "ratio_kl": ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps"),
    "policy_loss": ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps",
                    "advantages"),
    "linear_selected_logprobs": ("hidden", "weight", "action_ids", "mask"),
    "linear_policy_loss": ("hidden", "weight", "action_ids", "mask", "old_logps",
                           "advantages"),
}
LOGITS = {"logits", "policy_logits", "ref_logits"}


def _good(name: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    if name in LOGITS:
        return rng.standard_normal((B, T, V), dtype=np.float32)
    if name == "hidden":
        return rng.standard_normal((B, T, H), dtype=np.float32)
    if name == "weight":
        return rng.standard_normal((V, H), dtype=np.float32)
    if name == "action_ids":
        return rng.integers(0, V, (B, T))
    if name == "mask":
        return np.ones((B, T), dtype=bool)
    return rng.standard_normal((B, T), dtype=np.float32)


def _bad(name: str) -> np.ndarray:
    """A wrong dtype for the float inputs that take several, a wrong shape otherwise."""
    if name in LOGITS | {"hidden", "weight"}:
        return _good(name).astype(np.int32)
    return _good(name)[:, :2]


def _names(message: str) -> list:
    return [re.match(r"\w+", m).group(0) for m in re.findall(r"`([A-Za-z_]\w*)", message)]


def _cases():
    for op, args in GOOD.items():
        for i, arg in enumerate(args):
            yield pytest.param(op, i, id=f"{op}-{arg}")


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("op, position", list(_cases()))
def test_errors_name_the_ops_own_argument(framework, op, position):
    fw = pytest.importorskip(framework)
    loss = __import__(f"ratiokl.{framework}.loss", fromlist=["loss"])
    to = (lambda a: fw.from_numpy(a)) if framework == "torch" else fw.numpy.asarray
    fn = getattr(loss, op)
    args = [to(_good(name)) for name in GOOD[op]]
    args[position] = to(_bad(GOOD[op][position]))
    with pytest.raises((TypeError, ValueError)) as caught:
        fn(*args, backend="native")
    names = _names(str(caught.value))
    own = set(inspect.signature(fn).parameters)
    every = {p for name in loss.__all__ for p in inspect.signature(getattr(loss, name)).parameters}
    assert names and names[0] == GOOD[op][position], str(caught.value)
    assert not [n for n in names if n in every - own], str(caught.value)
