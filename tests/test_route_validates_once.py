"""Validation runs once per call: ``linear_policy_loss`` on the native backend builds every
row's logits and hands them, with the rows and options it already validated, to the
policy-loss step -- it does not enter the public ``policy_loss`` route a second time.

Counted by wrapping two of the route's validators (the per-token inputs and the mask) for
one call, on both frameworks; the same call through ``policy_loss`` counts the same.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

B, T, H, V = 2, 5, 8, 11
OPTIONS = dict(kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
VALIDATORS = ("token_inputs", "check_mask")


def _data():
    rng = np.random.default_rng(0)
    return dict(
        hidden=rng.standard_normal((B, T, H)).astype(np.float32),
        weight=(rng.standard_normal((V, H)) * 0.3).astype(np.float32),
        ids=rng.integers(0, V, (B, T)), mask=rng.random((B, T)) > 0.3,
        old=(rng.standard_normal((B, T)) * 0.1 - 2.0).astype(np.float32),
        ref=(rng.standard_normal((B, T)) * 0.1 - 2.0).astype(np.float32),
        adv=rng.standard_normal(B).astype(np.float32),
    )


def _counting(monkeypatch, framework: str) -> dict:
    """Wrap the validators (the mask's in ``ratiokl.<framework>._checks``, the per-token
    inputs' in ``ratiokl._core.checks``, which takes the call's compute dtype); their call
    counts."""
    counts = dict.fromkeys(VALIDATORS, 0)
    for name in VALIDATORS:
        checks = importlib.import_module("ratiokl._core.checks" if name == "token_inputs"
                                         else f"ratiokl.{framework}._checks")
        real = getattr(checks, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(checks, name, counted)
    return counts


@pytest.mark.parametrize("op", ["linear_policy_loss", "policy_loss"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_native_validates_once(monkeypatch, framework, op):
    arrays = pytest.importorskip("torch" if framework == "torch" else "jax.numpy")
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    to_array = arrays.as_tensor if framework == "torch" else arrays.asarray

    x = {k: to_array(v) for k, v in _data().items()}
    counts = _counting(monkeypatch, framework)
    rest = (x["ids"], x["mask"], x["old"], x["adv"])
    if op == "linear_policy_loss":
        loss.linear_policy_loss(x["hidden"], x["weight"], *rest, ref_logps=x["ref"],
                                backend="native", **OPTIONS)
    else:
        loss.policy_loss(x["hidden"] @ x["weight"].T, None, *rest, ref_logps=x["ref"],
                         backend="native", **OPTIONS)
    assert counts == dict.fromkeys(VALIDATORS, 1)
