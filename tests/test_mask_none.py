"""``mask=None`` is one rule for every public op of both frameworks: every row active, the
same outputs as an all-True mask (and a documented ``Optional`` in the signature)."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest

B, T, V, H = 2, 3, 7, 4


def _inputs(to):
    rng = np.random.default_rng(1)
    f = lambda *shape: to(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    return dict(x=f(B, T, V), ref=f(B, T, V), ids=to(rng.integers(0, V, (B, T))),
                old=f(B, T) - 2.0, adv=f(B, T), logps=f(B, T) - 2.0, h=f(B, T, H), w=f(V, H))


CALLS = {
    "selected_logprobs": lambda L, a, m: L.selected_logprobs(a["x"], a["ids"], m),
    "ratio_kl": lambda L, a, m: L.ratio_kl(a["x"], a["ref"], a["ids"], m, a["old"]),
    "policy_loss": lambda L, a, m: L.policy_loss(a["x"], a["ref"], a["ids"], m, a["old"],
                                                 a["adv"], kl_coef=0.1),
    "policy_objective": lambda L, a, m: L.policy_objective(a["logps"], a["old"], a["adv"], m),
    "linear_selected_logprobs": lambda L, a, m: L.linear_selected_logprobs(a["h"], a["w"],
                                                                           a["ids"], m),
    "linear_policy_loss": lambda L, a, m: L.linear_policy_loss(a["h"], a["w"], a["ids"], m,
                                                               a["old"], a["adv"]),
}


def _leaves(out):
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    if isinstance(out, (tuple, list)):
        return [leaf for item in out for leaf in _leaves(item)]
    return [out]


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("op", list(CALLS))
def test_mask_none_is_every_row_active(framework, op):
    fw = pytest.importorskip(framework)
    loss = __import__(f"ratiokl.{framework}.loss", fromlist=["loss"])
    to = fw.from_numpy if framework == "torch" else fw.numpy.asarray
    a = _inputs(to)
    ones = to(np.ones((B, T), dtype=bool))
    none, full = _leaves(CALLS[op](loss, a, None)), _leaves(CALLS[op](loss, a, ones))
    assert len(none) == len(full)
    for got, want in zip(none, full):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    mask = inspect.signature(getattr(loss, op)).parameters["mask"]
    hints = typing.get_type_hints(getattr(loss, op))
    assert type(None) in typing.get_args(hints["mask"]), (op, mask)
    assert "None: all active" in getattr(loss, op).__doc__
