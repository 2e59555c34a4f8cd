"""``ratiokl.jax.loss.policy_loss`` with the rollout correction, against the float64 spec.

Every mode at token and sequence level, on rows and packed segments, with and
without importance weights and a KL term, under ``jax.jit`` and ``jax.grad``;
exact zero gradients where the weight is 0 and on inactive rows; NaN
``rollout_logps`` on inactive rows reaching nothing; one trace when only values
change; ``vmap``. Mirrors ``tests/torch/test_rollout.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402
from rollout_test_cases import CASES, LOSS_TOL, T, grad_tolerance, make_inputs  # noqa: E402

POSITIONAL = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")


def _split(name, x):
    """``(array keyword arguments, static options)`` of a case."""
    options = dict(CASES[name])
    arrays = {"rollout_logps": x["rollout_logps"]}
    if options.pop("packed", False):
        arrays["segment_ids"] = x["segment_ids"]
    if options.pop("importance", False):
        arrays["importance_weights"] = x["importance_weights"]
    return arrays, options


def _array(v):
    return jnp.asarray(v.astype(np.float32) if v.dtype.kind == "f" else v)


def _value_and_grad(static, backend="native"):
    """A jitted ``(logits, positional rest, array kwargs) -> ((loss, metrics), grad)``."""

    def fn(logits, rest, arrays):
        return loss.policy_loss(logits, *rest, backend=backend, check_ids=False, **arrays,
                                **static)

    return jax.jit(jax.value_and_grad(fn, has_aux=True))


def _run(x, arrays, static):
    rest = [_array(x[k]) for k in POSITIONAL[1:]]
    (value, metrics), grad = _value_and_grad(static)(
        _array(x["policy_logits"]), rest, {k: _array(v) for k, v in arrays.items()})
    return value, metrics, np.asarray(grad)


def _spec(x, options):
    args = [x[k] for k in POSITIONAL]
    value, metrics = spec.policy_loss(*args, **options)
    return value, metrics, spec.policy_loss_grad(*args, **options)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_spec_under_jit(name) -> None:
    x = make_inputs(seed=sorted(CASES).index(name))
    arrays, static = _split(name, x)
    value, metrics, grad = _run(x, arrays, static)
    want, want_metrics, want_grad = _spec(x, {**arrays, **static})
    assert_close(value, want, LOSS_TOL, "loss")
    assert sorted(metrics) == sorted(want_metrics)  # jit returns a dict's keys sorted
    for key, expected in want_metrics.items():
        assert_close(metrics[key], expected, LOSS_TOL, key)
        assert metrics[key].dtype == jnp.float32 and metrics[key].ndim == 0
    assert_close(grad, want_grad, grad_tolerance(want_grad), "grad")
    assert not grad[~x["mask"]].any()


@pytest.mark.parametrize("correction", ["token-mask", "sequence-mask"])
def test_a_weight_of_zero_gives_exactly_zero_gradient(correction) -> None:
    x = make_inputs(seed=21)
    static = dict(rollout_correction=correction, rollout_bounds=(0.8, 1.25))
    value, metrics, grad = _run(x, {"rollout_logps": x["rollout_logps"]}, static)
    opts = spec.rollout_options(correction, (0.8, 1.25), True)
    w, _ = spec.rollout_weights(x["old_logps"], x["rollout_logps"], x["mask"],
                                spec.sequence_index(x["mask"]), opts, 20.0)
    zero = ~x["mask"] | (w == 0)
    assert x["mask"][zero].any() and (~zero).any()
    assert not grad[zero].any() and grad[~zero].any(axis=-1).all()
    unweighted, _, _ = _run(x, {"importance_weights": np.where(x["mask"], w, 0.0)}, {})
    assert float(value) == pytest.approx(float(unweighted), rel=1e-6)


def test_inactive_rollout_logps_reach_nothing() -> None:
    x = make_inputs(seed=5)
    outs = []
    for fill in (np.nan, np.inf, -1e30):
        x["rollout_logps"] = np.where(x["mask"], x["rollout_logps"], fill)
        outs.append(_run(x, {"rollout_logps": x["rollout_logps"],
                             "segment_ids": x["segment_ids"]},
                         dict(rollout_correction="sequence-truncate")))
    for value, metrics, grad in outs[1:]:
        assert float(value) == float(outs[0][0]) and np.isfinite(float(value))
        assert all(float(metrics[k]) == float(outs[0][1][k]) for k in metrics)
        assert np.array_equal(grad, outs[0][2])


def test_all_inactive_and_empty_batches() -> None:
    for x in (make_inputs(seed=6, active=0.0), make_inputs(seed=7, lead=(0, T))):
        value, metrics, grad = _run(x, {"rollout_logps": x["rollout_logps"]},
                                    dict(rollout_correction="sequence-mask"))
        assert float(value) == 0.0 and not grad.any()
        assert all(float(metrics[k]) == 0.0 for k in spec.ROLLOUT_METRIC_NAMES)


def test_one_trace_when_only_values_change() -> None:
    traces = []

    def fn(logits, rest, rollout):
        traces.append(1)
        return loss.policy_loss(logits, *rest, rollout_logps=rollout, check_ids=False,
                                rollout_correction="token-mask", rollout_bounds=(0.5, 5.0))[0]

    step = jax.jit(jax.grad(fn))
    for seed in (30, 31, 32):
        x = make_inputs(seed=seed)
        step(_array(x["policy_logits"]), [_array(x[k]) for k in POSITIONAL[1:]],
             _array(x["rollout_logps"]))
    assert len(traces) == 1


def test_vmap_over_a_batch_axis_matches_separate_calls() -> None:
    xs = [make_inputs(seed=40 + i) for i in range(2)]
    static = dict(rollout_correction="sequence-truncate", rollout_bounds=(0.0, 1.3))

    def fn(logits, ref, ids, mask, old, adv, rollout):
        return loss.policy_loss(logits, ref, ids, mask, old, adv, rollout_logps=rollout,
                                check_ids=False, **static)

    stacked = [jnp.stack([_array(x[k]) for x in xs])
               for k in POSITIONAL + ("rollout_logps",)]
    values, metrics = jax.vmap(fn)(*stacked)
    for i, x in enumerate(xs):
        value, single = fn(*[_array(x[k]) for k in POSITIONAL + ("rollout_logps",)])
        assert float(values[i]) == pytest.approx(float(value), rel=1e-6)
        assert float(metrics["rollout_k3"][i]) == pytest.approx(float(single["rollout_k3"]),
                                                                rel=1e-6)
