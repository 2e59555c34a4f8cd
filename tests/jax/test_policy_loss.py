"""``ratiokl.jax.loss.policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``).

Each option's loss, metrics and policy-logit gradient (``jax.grad``) on
inputs whose inactive rows hold NaN logits, NaN old log-probs / advantages /
weights and out-of-range ids; all-inactive and empty batches; dtypes;
argument errors; ``jit``, ``vmap`` and ``checkify``. Mirrors
``tests/torch/test_policy_loss.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402
from policy_test_cases import (  # noqa: E402
    LOSS_TOL, OPTIONS, PACKED, B, T, V, make_inputs, per_token_upstream)

jax.config.update("jax_enable_x64", False)

POSITIONAL = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")


def _jax(x, dtype=jnp.float32):
    out = {k: jnp.asarray(v) for k, v in x.items()}
    out["policy_logits"] = out["policy_logits"].astype(dtype)
    out["ref_logits"] = out["ref_logits"].astype(dtype)
    return out


def _loss_fn(keys, options, backend="native"):
    """``(logits, other arrays) -> (loss, metrics)`` with the options closed over."""

    def fn(logits, arrays):
        rest = [arrays[k] for k in POSITIONAL[1:]]
        extra = {k: arrays[k] for k in keys}
        return loss.policy_loss(logits, *rest, backend=backend, **extra, **options)

    return fn


def _run(x, options, *, dtype=jnp.float32, keys=(), transform=lambda f: f):
    """``(loss, metrics, grad)`` of the JAX call and ``(loss, metrics, grad)`` of the spec."""
    j = _jax(x, dtype)
    upstream = per_token_upstream(x["mask"]) if options.get("loss_agg") == "none" else None

    def value_and_grad(logits, arrays):  # the per-token loss: a non-unit upstream per token
        (value, metrics), vjp = jax.vjp(lambda z: _loss_fn(keys, options)(z, arrays), logits)
        g = jnp.ones(()) if upstream is None else jnp.asarray(upstream)
        return (value, metrics), vjp((g, jax.tree_util.tree_map(jnp.zeros_like, metrics)))[0]

    (value, metrics), grad = transform(value_and_grad)(j["policy_logits"], j)
    args = dict(x, policy_logits=np.asarray(j["policy_logits"].astype(jnp.float32)),
                ref_logits=np.asarray(j["ref_logits"].astype(jnp.float32)))
    positional = [args[k] for k in POSITIONAL]
    kw = {**{k: x[k] for k in keys}, **options}
    exp_loss, exp_metrics = spec.policy_loss(*positional, **kw)
    exp_grad = spec.policy_loss_grad(*positional, loss_cotangent=upstream, **kw)
    return (value, metrics, grad), (exp_loss, exp_metrics, exp_grad)


def _assert_matches(actual, expected, dtype="float32"):
    (value, metrics, grad), (exp_loss, exp_metrics, exp_grad) = actual, expected
    assert value.dtype == jnp.float32 and value.shape == np.shape(exp_loss)
    assert_close(value, exp_loss, LOSS_TOL, "loss")
    assert set(metrics) == set(exp_metrics)
    for name, m in metrics.items():
        assert m.dtype == jnp.float32 and m.ndim == 0
        assert_close(m, exp_metrics[name], LOSS_TOL, name)
    assert np.all(np.isfinite(exp_grad))
    tol = spec.grad_tolerance(dtype, 8.0, float(np.abs(exp_grad).max()))
    assert_close(grad, exp_grad, tol, "grad")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_matches_spec(name):
    x = make_inputs(seed=len(name))
    keys = ("importance_weights",) if name == "ppo_default" else ()
    _assert_matches(*_run(x, OPTIONS[name], keys=keys))


@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_rows_match_spec(name):
    x = make_inputs(seed=5, active=0.9)
    _assert_matches(*_run(x, PACKED[name], keys=("segment_ids",)))


def test_gspo_packed_rows_under_jit():
    x = make_inputs(seed=15, active=0.9)
    options = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.2}
    _assert_matches(*_run(x, options, keys=("segment_ids",), transform=jax.jit))


def test_per_token_advantages_with_nan_on_inactive_rows():
    x = make_inputs(seed=3, per_token_adv=True)
    _assert_matches(*_run(x, {"dual_clip": 2.0, "kl_coef": 0.1}, keys=("importance_weights",)))


def test_ref_logps_instead_of_ref_logits():
    j = _jax(make_inputs(seed=4))
    ref_logps = loss.selected_logprobs(j["ref_logits"], j["action_ids"], j["mask"],
                                       check_ids=False)
    rest = [j[k] for k in POSITIONAL[2:]]
    with_logits = loss.policy_loss(j["policy_logits"], j["ref_logits"], *rest, kl_coef=0.2)[0]
    with_logps = loss.policy_loss(j["policy_logits"], None, *rest, ref_logps=ref_logps,
                                  kl_coef=0.2)[0]
    assert float(with_logits) == float(with_logps)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_logits(dtype):
    x = make_inputs(seed=6)
    actual, expected = _run(x, {"kl_coef": 0.1}, dtype=jnp.dtype(dtype))
    assert actual[2].dtype == jnp.dtype(dtype)
    _assert_matches(actual, expected, dtype)


@pytest.mark.parametrize("agg", sorted(set(spec.LOSS_AGGS) - {"none"}))  # none: its own file
@pytest.mark.parametrize("level", sorted(spec.RATIO_LEVELS))
def test_all_inactive_gives_zero_loss_and_zero_grad(agg, level):
    x = make_inputs(seed=7, active=0.0)
    (value, metrics, grad), _ = _run(x, {"loss_agg": agg, "ratio_level": level, "kl_coef": 0.5},
                                     keys=("segment_ids", "importance_weights"))
    assert not np.any(np.asarray(value))
    assert all(float(m) == 0.0 for m in metrics.values())
    assert np.array_equal(np.asarray(grad), np.zeros(grad.shape))


def test_empty_batch():
    x = make_inputs(seed=8, lead=(0, T))
    (value, _, grad), _ = _run(x, {"loss_agg": "seq-mean-token-mean"})
    assert float(value) == 0.0 and grad.shape == (0, T, V)


def test_inactive_rows_get_exactly_zero_grad_and_do_not_change_the_loss():
    x = make_inputs(seed=9, per_token_adv=True)
    opts = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.3}
    keys = ("segment_ids", "importance_weights")
    (value, _, grad), _ = _run(x, opts, keys=keys)
    assert np.array_equal(np.asarray(grad)[~x["mask"]], np.zeros((int((~x["mask"]).sum()), V)))
    clean = dict(x)
    for key in ("policy_logits", "old_logps", "advantages", "importance_weights"):
        clean[key] = np.where(x["mask"].reshape(x["mask"].shape + (1,) * (x[key].ndim - 2)),
                              x[key], 0.25).astype(np.float32)
    clean["action_ids"] = np.where(x["mask"], x["action_ids"], 0)
    (value2, _, grad2), _ = _run(clean, opts, keys=keys)
    assert float(value) == float(value2) and np.array_equal(np.asarray(grad), np.asarray(grad2))


def test_vmap_over_a_batch_axis_matches_separate_calls():
    xs = [make_inputs(seed=s) for s in (13, 14)]
    stacked = {k: jnp.stack([jnp.asarray(x[k]) for x in xs]) for k in xs[0]}
    fn = _loss_fn(("segment_ids",), {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"})
    batched = jax.vmap(lambda logits, arrays: fn(logits, arrays)[0])(
        stacked["policy_logits"], stacked)
    for i, x in enumerate(xs):
        j = _jax(x)
        assert_close(batched[i], fn(j["policy_logits"], j)[0], spec.paths_tolerance(B * T),
                     "loss")


def test_loss_normalizer_traced_equals_float():
    j = _jax(make_inputs(seed=10))
    rest = [j[k] for k in POSITIONAL[1:]]
    a = loss.policy_loss(j["policy_logits"], *rest, loss_normalizer=12.0)[0]
    b = jax.jit(lambda n, *args: loss.policy_loss(*args, loss_normalizer=n)[0])(
        jnp.float32(12.0), j["policy_logits"], *rest)
    assert_close(a, b, spec.paths_tolerance(B * T), "loss")


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"kl_coef": 0.1, "no_ref": True}, ValueError, "ref_logits"),
        ({"loss_agg": "mean"}, ValueError, "loss_agg"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator"),
        ({"ratio_level": "seq"}, ValueError, "ratio_level"),
        ({"dual_clip": 0.9}, ValueError, "dual_clip"),
        ({"clip_eps": 1.5}, ValueError, "clip_eps"),
        ({"entropy_coef": float("nan")}, ValueError, "`entropy_coef` must be finite"),
        ({"entropy_coef": "0.01"}, TypeError, "`entropy_coef` must be a Python number"),
        ({"loss_normalizer": 0.0}, ValueError, "loss_normalizer"),
        ({"advantages": np.zeros(T, np.float32)}, ValueError, "advantages"),
        ({"segment_ids": np.zeros((B, T), np.float32)}, TypeError, "segment_ids"),
    ],
)
def test_bad_arguments_name_the_argument(options, error, match):
    j = _jax(make_inputs(seed=11))
    options = dict(options)
    ref = None if options.pop("no_ref", False) else j["ref_logits"]
    adv = jnp.asarray(options.pop("advantages", j["advantages"]))
    if "segment_ids" in options:
        options["segment_ids"] = jnp.asarray(options["segment_ids"])
    with pytest.raises(error, match=match):
        loss.policy_loss(j["policy_logits"], ref, j["action_ids"], j["mask"], j["old_logps"],
                         adv, **options)
