"""``policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``), one body per
behaviour run for both frameworks (native backend).

Each option's loss, metrics and policy-logit gradient on inputs whose inactive rows hold NaN
logits, NaN old log-probs / advantages / weights and out-of-range ids; packed rows;
per-token advantages; float16 / bfloat16 logits (the gradient in their dtype); all-inactive
and empty batches, inactive rows' garbage changing nothing, ``ref_logps``, argument errors,
the interpreter against native.
The framework-only behaviours stay in ``tests/torch/test_policy_loss.py`` and
``tests/jax/test_policy_loss.py``.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from assertions import as_float64, assert_close
from policy_runners import (
    POSITIONAL, assert_matches_spec, jax_inputs, run_jax, run_torch, torch_inputs,
)
from policy_test_cases import B, T, V, OPTIONS, PACKED, make_inputs

from ratiokl import spec

FRAMEWORKS = ["torch", "jax"]


def _run(framework, x, options, **kw):
    pytest.importorskip(framework)
    return (run_torch if framework == "torch" else run_jax)(x, options, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_matches_spec(framework, name):
    x = make_inputs(seed=len(name))
    keys = ("importance_weights",) if name == "ppo_default" else ()
    assert_matches_spec(*_run(framework, x, OPTIONS[name], keys=keys))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_rows_match_spec(framework, name):
    x = make_inputs(seed=5, active=0.9)
    assert_matches_spec(*_run(framework, x, PACKED[name], keys=("segment_ids",)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_per_token_advantages_with_nan_on_inactive_rows(framework):
    x = make_inputs(seed=3, per_token_adv=True)
    options = {"dual_clip": 2.0, "kl_coef": 0.1}
    assert_matches_spec(*_run(framework, x, options, keys=("importance_weights",)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_logits(framework, dtype):
    x = make_inputs(seed=6)
    assert_matches_spec(*_run(framework, x, {"kl_coef": 0.1}, dtype=dtype), dtype)


def _api(framework):
    """``(framework's loss module, NumPy dict -> its arrays, NumPy array -> its array)``."""
    pytest.importorskip(framework)
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    if framework == "torch":
        import torch

        return loss, torch_inputs, torch.from_numpy
    import jax.numpy as jnp

    return loss, jax_inputs, jnp.asarray


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_ref_logps_instead_of_ref_logits(framework):
    loss, inputs, _ = _api(framework)
    a = inputs(make_inputs(seed=4))
    ref_logps = loss.selected_logprobs(a["ref_logits"], a["action_ids"], a["mask"],
                                       check_ids=False)
    rest = [a[k] for k in POSITIONAL[2:]]
    with_logits = loss.policy_loss(a["policy_logits"], a["ref_logits"], *rest, kl_coef=0.2)[0]
    with_logps = loss.policy_loss(a["policy_logits"], None, *rest, ref_logps=ref_logps,
                                  kl_coef=0.2)[0]
    assert float(with_logits) == float(with_logps)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("agg", sorted(set(spec.LOSS_AGGS) - {"none"}))  # none: its own file
@pytest.mark.parametrize("level", sorted(spec.RATIO_LEVELS))
def test_all_inactive_gives_zero_loss_and_zero_grad(framework, agg, level):
    x = make_inputs(seed=7, active=0.0)
    (value, metrics, grad), _ = _run(framework, x, {"loss_agg": agg, "ratio_level": level,
                                                    "kl_coef": 0.5},
                                     keys=("segment_ids", "importance_weights"))
    assert float(value) == 0.0
    assert all(float(m) == 0.0 for m in metrics.values())
    np.testing.assert_array_equal(as_float64(grad), 0.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_empty_batch(framework):
    x = make_inputs(seed=8, lead=(0, T))
    (value, _, grad), _ = _run(framework, x, {"loss_agg": "seq-mean-token-mean"})
    assert float(value) == 0.0 and tuple(grad.shape) == (0, T, V)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_inactive_rows_get_exactly_zero_grad_and_do_not_change_the_loss(framework):
    x = make_inputs(seed=9, per_token_adv=True)
    opts = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.3}
    keys = ("segment_ids", "importance_weights")
    (value, _, grad), _ = _run(framework, x, opts, keys=keys)
    np.testing.assert_array_equal(as_float64(grad)[~x["mask"]], 0.0)
    clean = dict(x)
    for key in ("policy_logits", "old_logps", "advantages", "importance_weights"):
        clean[key] = np.where(x["mask"].reshape(x["mask"].shape + (1,) * (x[key].ndim - 2)),
                              x[key], 0.25).astype(np.float32)
    clean["action_ids"] = np.where(x["mask"], x["action_ids"], 0)
    (value2, _, grad2), _ = _run(framework, clean, opts, keys=keys)
    assert float(value) == float(value2)
    np.testing.assert_array_equal(as_float64(grad), as_float64(grad2))


@pytest.mark.parametrize("framework", FRAMEWORKS)
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
def test_bad_arguments_name_the_argument(framework, options, error, match):
    loss, inputs, as_array = _api(framework)
    a = inputs(make_inputs(seed=11))
    options = dict(options)
    ref = None if options.pop("no_ref", False) else a["ref_logits"]
    adv = options.pop("advantages", None)
    adv = a["advantages"] if adv is None else as_array(adv)
    if "segment_ids" in options:
        options["segment_ids"] = as_array(options["segment_ids"])
    with pytest.raises(error, match=match):
        loss.policy_loss(a["policy_logits"], ref, a["action_ids"], a["mask"], a["old_logps"],
                         adv, **options)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_interpret_backend_matches_native(framework):
    pytest.importorskip("triton")
    x = make_inputs(seed=12)
    native, _ = _run(framework, x, {"kl_coef": 0.2})
    interpret, _ = _run(framework, x, {"kl_coef": 0.2}, backend="interpret")
    assert_close(interpret[0], native[0], spec.paths_tolerance(B * T), "loss")
    for name, value in native[1].items():
        assert_close(interpret[1][name], value, spec.paths_tolerance(B * T), name)
    g_max = float(np.abs(as_float64(native[2])).max())
    assert_close(interpret[2], native[2], spec.paths_tolerance(V, g_max), "grad")
