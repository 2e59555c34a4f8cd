"""``ratiokl.torch.loss.policy_loss`` with the rollout correction: what only PyTorch has.

The interpreted Triton backend against native with a strided ``rollout_logps`` view, the
fused path's metrics without a gradient, ``torch.compile(fullgraph=True)`` with no
recompile when only values change. Every mode against the spec, zero-weight and inactive
rows, all-inactive and empty batches on both frameworks: ``tests/test_rollout_loss.py``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402
from rollout_test_cases import LOSS_TOL, B, T, V, make_inputs  # noqa: E402

#: Two float32 paths (native, interpreted, compiled) of one loss or metric.
PATHS_TOL = spec.paths_tolerance(B * T)

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"))]


def _tensor(v):
    return torch.tensor(v.astype(np.float32) if v.dtype.kind == "f" else v)


def _run(x, options, backend="native"):
    """``(loss, metrics, grad)`` of the torch call (float32)."""
    logits = _tensor(x["policy_logits"]).requires_grad_(True)
    rest = [_tensor(x[k]) for k in ("ref_logits", "action_ids", "mask", "old_logps",
                                    "advantages")]
    kw = {k: _tensor(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    value, metrics = loss.policy_loss(logits, *rest, backend=backend, **kw)
    (grad,) = torch.autograd.grad(value, logits)
    return value.detach(), metrics, grad


def _spec(x, options):
    args = [x[k] for k in ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps",
                           "advantages")]
    value, metrics = spec.policy_loss(*args, **options)
    return value, metrics, spec.policy_loss_grad(*args, **options)


def test_interpret_matches_native_and_a_strided_rollout_view() -> None:
    pytest.importorskip("triton")
    x = make_inputs(seed=8)
    wide = torch.full((B, 2 * T), float("nan"))
    wide[:, ::2] = _tensor(x["rollout_logps"])
    options = dict(rollout_correction="token-mask", rollout_bounds=(0.6, 1.6))
    native = _run(x, dict(options, rollout_logps=x["rollout_logps"]))
    interpreted = _run(x, dict(options, rollout_logps=wide[:, ::2]), "interpret")
    assert_close(interpreted[0], native[0], PATHS_TOL, "loss")
    for key in spec.ROLLOUT_METRIC_NAMES:
        assert_close(interpreted[1][key], native[1][key], PATHS_TOL, key)
    grad_tol = spec.paths_tolerance(V, float(native[2].abs().max()))
    assert_close(interpreted[2], native[2], grad_tol, "grad")


def test_the_fused_path_computes_the_metrics_without_a_gradient() -> None:
    pytest.importorskip("triton")
    x = make_inputs(seed=9)
    options = dict(rollout_logps=x["rollout_logps"], rollout_correction="token-truncate")
    with torch.no_grad():
        value, metrics = loss.policy_loss(
            *[_tensor(x[k]) for k in ("policy_logits", "ref_logits", "action_ids", "mask",
                                      "old_logps", "advantages")],
            backend="interpret", rollout_logps=_tensor(x["rollout_logps"]),
            rollout_correction="token-truncate")
    want, want_metrics, _ = _spec(x, options)
    assert_close(value, want, LOSS_TOL, "loss")
    assert_close(metrics["rollout_weight_mean"], want_metrics["rollout_weight_mean"], LOSS_TOL,
                 "rollout_weight_mean")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_compile_fullgraph_no_recompile_when_values_change(backend) -> None:
    """Compiled (the gradient traced too) equals eager; new values, same shapes: one graph."""
    torch._dynamo.reset()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(logits, ids, mask, old, adv, rollout, segs):
        value, metrics = loss.policy_loss(
            logits, None, ids, mask, old, adv, segment_ids=segs, rollout_logps=rollout,
            rollout_correction="sequence-mask", rollout_bounds=(0.5, 1.8),
            loss_agg="seq-mean-token-mean", backend=backend, check_ids=False)
        return value, metrics["rollout_weight_mean"], metrics["rollout_k3"]

    compiled = torch.compile(step, fullgraph=True, backend=counting)
    for seed in (10, 11, 12):
        x = make_inputs(seed=seed)
        args = [_tensor(x[k]) for k in ("policy_logits", "action_ids", "mask", "old_logps",
                                        "advantages", "rollout_logps", "segment_ids")]
        args[0].requires_grad_(True)
        got = compiled(*args)
        (got_grad,) = torch.autograd.grad(got[0], args[0])
        want = step(*args)
        (want_grad,) = torch.autograd.grad(want[0], args[0])
        for what, a, b in zip(("loss", "rollout_weight_mean", "rollout_k3"), got, want):
            assert_close(a, b, PATHS_TOL, what)
        grad_tol = spec.paths_tolerance(V, float(want_grad.abs().max()))
        assert_close(got_grad, want_grad, grad_tol, "grad")
    assert len(graphs) == 1, f"{len(graphs)} graphs for three batches of one shape"
