"""``ratiokl.torch.loss.policy_loss`` with the rollout correction, against the float64 spec.

Every mode at token and sequence level, on rows and packed segments, with and
without importance weights and a KL term, on the native backend (framework ops)
and the interpreted Triton backend (the one-launch weights and the fused loss);
exact zero gradients where the weight is 0 and on inactive rows; NaN
``rollout_logps`` on inactive rows reaching nothing; ``torch.compile(fullgraph=True)``
with no recompile when only values change. Mirrors ``tests/jax/test_rollout.py``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402
from rollout_test_cases import (  # noqa: E402
    CASES, LOSS_TOL, B, T, V, grad_tolerance, make_inputs)

#: Two float32 paths (native, interpreted, compiled) of one loss or metric.
PATHS_TOL = spec.paths_tolerance(B * T)

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"))]
def _options(name, x):
    options = dict(CASES[name])
    if options.pop("packed", False):
        options["segment_ids"] = x["segment_ids"]
    if options.pop("importance", False):
        options["importance_weights"] = x["importance_weights"]
    return dict(options, rollout_logps=x["rollout_logps"])


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_spec(name, backend) -> None:
    x = make_inputs(seed=sorted(CASES).index(name))
    options = _options(name, x)
    value, metrics, grad = _run(x, options, backend)
    want, want_metrics, want_grad = _spec(x, options)
    assert_close(value, want, LOSS_TOL, "loss")
    assert list(metrics) == list(want_metrics)
    for key, expected in want_metrics.items():
        assert_close(metrics[key], expected, LOSS_TOL, key)
        assert metrics[key].dtype == torch.float32 and not metrics[key].requires_grad
    assert_close(grad, want_grad, grad_tolerance(want_grad), "grad")
    assert (grad[torch.from_numpy(~x["mask"])] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("correction", ["token-mask", "sequence-mask"])
def test_a_weight_of_zero_gives_exactly_zero_gradient(correction, backend) -> None:
    """Without a KL term, a masked token's (and an inactive one's) gradient is exactly 0,
    and it still counts in token-mean's denominator."""
    x = make_inputs(seed=21)
    options = dict(rollout_logps=x["rollout_logps"], rollout_correction=correction,
                   rollout_bounds=(0.8, 1.25))
    value, metrics, grad = _run(x, options, backend)
    opts = spec.rollout_options(correction, (0.8, 1.25), True)
    w, _ = spec.rollout_weights(x["old_logps"], x["rollout_logps"], x["mask"],
                                spec.sequence_index(x["mask"]), opts, 20.0)
    zero = ~x["mask"] | (w == 0)
    assert x["mask"][zero].any() and (~zero).any()
    assert (grad[torch.from_numpy(zero)] == 0).all()
    assert (grad[torch.from_numpy(~zero)] != 0).any(dim=-1).all()
    assert metrics["rollout_masked_fraction"].item() == pytest.approx(
        (x["mask"] & (w == 0)).sum() / x["mask"].sum())
    unweighted, _, _ = _run(x, dict(importance_weights=np.where(x["mask"], w, 0.0)), backend)
    assert value.item() == pytest.approx(unweighted.item(), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inactive_rollout_logps_reach_nothing(backend) -> None:
    """NaN, inf or huge values on inactive rows: the same bits out, zero gradient there."""
    x = make_inputs(seed=5)
    outs = []
    for fill in (np.nan, np.inf, -1e30):
        x["rollout_logps"] = np.where(x["mask"], x["rollout_logps"], fill)
        outs.append(_run(x, dict(rollout_logps=x["rollout_logps"], segment_ids=x["segment_ids"],
                                 rollout_correction="sequence-truncate"), backend))
    for value, metrics, grad in outs[1:]:
        assert value.item() == outs[0][0].item() and torch.isfinite(value)
        assert all(metrics[k].item() == outs[0][1][k].item() for k in metrics)
        assert torch.equal(grad, outs[0][2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_inactive_and_empty_batches(backend) -> None:
    for x in (make_inputs(seed=6, active=0.0), make_inputs(seed=7, lead=(0, T))):
        value, metrics, grad = _run(x, dict(rollout_logps=x["rollout_logps"],
                                            rollout_correction="sequence-mask"), backend)
        assert value.item() == 0.0 and not grad.any()
        assert all(metrics[k].item() == 0.0 for k in spec.ROLLOUT_METRIC_NAMES)


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
