"""``ratiokl.jax.loss.policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``).

All-inactive and empty batches, inactive garbage, ``ref_logps``, argument errors,
``jit``, ``vmap`` and ``checkify`` (each option, packed rows, per-token advantages and
16-bit logits against the spec, for both frameworks: ``tests/test_policy_loss_spec.py``).
Mirrors ``tests/torch/test_policy_loss.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402
from policy_runners import (  # noqa: E402
    POSITIONAL, assert_matches_spec, jax_inputs, jax_loss_fn, run_jax)
from policy_test_cases import B, T, V, make_inputs  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _run(x, options, *, dtype=jnp.float32, keys=(), transform=lambda f: f):
    return run_jax(x, options, dtype=jnp.dtype(dtype).name, keys=keys, transform=transform)


def test_gspo_packed_rows_under_jit():
    x = make_inputs(seed=15, active=0.9)
    options = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.2}
    assert_matches_spec(*_run(x, options, keys=("segment_ids",), transform=jax.jit))


def test_ref_logps_instead_of_ref_logits():
    j = jax_inputs(make_inputs(seed=4))
    ref_logps = loss.selected_logprobs(j["ref_logits"], j["action_ids"], j["mask"],
                                       check_ids=False)
    rest = [j[k] for k in POSITIONAL[2:]]
    with_logits = loss.policy_loss(j["policy_logits"], j["ref_logits"], *rest, kl_coef=0.2)[0]
    with_logps = loss.policy_loss(j["policy_logits"], None, *rest, ref_logps=ref_logps,
                                  kl_coef=0.2)[0]
    assert float(with_logits) == float(with_logps)


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
    fn = jax_loss_fn(("segment_ids",),
                     {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"})
    batched = jax.vmap(lambda logits, arrays: fn(logits, arrays)[0])(
        stacked["policy_logits"], stacked)
    for i, x in enumerate(xs):
        j = jax_inputs(x)
        assert_close(batched[i], fn(j["policy_logits"], j)[0], spec.paths_tolerance(B * T),
                     "loss")


def test_loss_normalizer_traced_equals_float():
    j = jax_inputs(make_inputs(seed=10))
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
    j = jax_inputs(make_inputs(seed=11))
    options = dict(options)
    ref = None if options.pop("no_ref", False) else j["ref_logits"]
    adv = jnp.asarray(options.pop("advantages", j["advantages"]))
    if "segment_ids" in options:
        options["segment_ids"] = jnp.asarray(options["segment_ids"])
    with pytest.raises(error, match=match):
        loss.policy_loss(j["policy_logits"], ref, j["action_ids"], j["mask"], j["old_logps"],
                         adv, **options)
