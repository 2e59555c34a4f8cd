"""The rollout correction's spec (``ratiokl.spec.rollout``) and its rules in both frameworks.

Closed-form weights of every mode on a hand-made batch (token and sequence level,
rows and packed segments, the log-ratio bound), the weight multiplying the policy
term exactly as ``importance_weights`` does, option errors that name the argument
(both frameworks, the same messages), the metrics' keys, and an active NaN
``rollout_logps`` staying visible on its own rows only.
"""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest

from assertions import assert_close
from ratiokl import spec

#: One row of four tokens, the third inactive (NaN there, never read).
MASK = np.array([[True, True, False, True]])
OLD = np.array([[-1.0, -2.0, np.nan, -1.5]])
ROLLOUT = np.array([[-1.5, -1.0, np.nan, -1.5]])  # lw_t = 0.5, -1.0, -, 0.0
SEGMENTS = np.array([[0, 0, 7, 1]])  # packed: tokens {0, 1} and {3}


def _weights(correction, bounds, *, segments=None, bound=20.0):
    opts = spec.rollout_options(correction, bounds, True)
    return spec.rollout_weights(OLD, ROLLOUT, MASK, spec.sequence_index(MASK, segments), opts,
                                bound)


def test_the_option_table_is_the_literal() -> None:
    assert tuple(spec.ROLLOUT_CORRECTIONS) == get_args(spec.RolloutCorrection)
    assert sorted(spec.ROLLOUT_CORRECTIONS.values()) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("correction, bounds, segments, bound, weights, masked", [
    ("token-truncate", (0.0, 1.5), None, 20.0, [1.5, math.exp(-1.0), 0.0, 1.0], 0.0),
    ("token-mask", (0.5, 1.5), None, 20.0, [0.0, 0.0, 0.0, 1.0], 2 / 3),
    ("token-mask", (0.3, math.inf), None, 20.0, [math.exp(0.5), math.exp(-1.0), 0.0, 1.0], 0.0),
    ("token-truncate", (0.0, 5.0), None, 0.2, [math.exp(0.2), math.exp(-0.2), 0.0, 1.0], 0.0),
    ("sequence-truncate", (0.0, 0.5), None, 20.0, [0.5, 0.5, 0.0, 0.5], 0.0),
    ("sequence-mask", (0.7, 1.5), None, 20.0, [0.0, 0.0, 0.0, 0.0], 1.0),
    ("sequence-mask", (0.5, 1.5), None, 20.0, [math.exp(-0.5)] * 2 + [0.0, math.exp(-0.5)], 0.0),
    ("sequence-mask", (0.7, 1.5), SEGMENTS, 20.0, [0.0, 0.0, 0.0, 1.0], 2 / 3),
    ("sequence-truncate", (0.0, 2.0), SEGMENTS, 0.3, [math.exp(-0.3)] * 2 + [0.0, 1.0], 0.0),
    (None, (0.0, 2.0), None, 20.0, [1.0, 1.0, 0.0, 1.0], 0.0),
])
def test_closed_form_weights(correction, bounds, segments, bound, weights, masked) -> None:
    w, metrics = _weights(correction, bounds, segments=segments, bound=bound)
    # float64 on both sides: sums of at most 4 terms, then exp
    tol = spec.paths_tolerance(4, dtype="float64")
    assert_close(w, np.array([weights]), tol, "weights")
    active = np.array(weights)[[0, 1, 3]]
    assert_close(metrics["rollout_weight_mean"], active.mean(), tol, "rollout_weight_mean")
    assert_close(metrics["rollout_masked_fraction"], masked, tol, "rollout_masked_fraction")
    d = np.clip([0.5, -1.0, 0.0], -bound, bound)  # k3 of the token log-weights, bounded
    assert_close(metrics["rollout_k3"], np.mean(np.expm1(d) - d), tol, "rollout_k3")


def test_no_active_token_gives_zero_metrics() -> None:
    opts = spec.rollout_options("sequence-mask", (0.5, 2.0), True)
    none = np.zeros_like(MASK)
    w, metrics = spec.rollout_weights(OLD, ROLLOUT, none, spec.sequence_index(none), opts, 20.0)
    assert not w.any() and set(metrics.values()) == {0.0}


def _inputs(seed=0, lead=(3, 6), vocab=13):
    rng = np.random.default_rng(seed)
    mask = rng.random(lead) < 0.75
    logits = rng.normal(0.0, 2.0, (*lead, vocab))
    ids = rng.integers(0, vocab, lead)
    old = spec.selected_logprobs(logits, ids, mask) + rng.normal(0.0, 0.3, lead)
    return dict(policy_logits=logits, ref_logits=logits + rng.normal(0.0, 0.5, logits.shape),
                action_ids=ids, mask=mask, old_logps=np.where(mask, old, np.nan),
                advantages=rng.normal(size=lead[:-1]),
                rollout_logps=np.where(mask, old + rng.normal(0.0, 0.7, lead), np.nan),
                segment_ids=np.sort(rng.integers(0, 3, lead), axis=-1))


def _spec_call(x, fn=spec.policy_loss, **options):
    args = [x[k] for k in ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps",
                           "advantages")]
    return fn(*args, **options)


@pytest.mark.parametrize("correction", sorted(spec.ROLLOUT_CORRECTIONS))
def test_the_weight_is_an_importance_weight_on_the_policy_term_only(correction) -> None:
    """With a KL term, correcting equals passing the weight as ``importance_weights``
    (which the KL term never sees); the weight of a masked token is 0, not a removal."""
    x = _inputs(seed=1)
    options = dict(kl_coef=0.3, loss_agg="seq-mean-token-mean", segment_ids=x["segment_ids"])
    opts = spec.rollout_options(correction, (0.6, 1.6), True)
    w, _ = spec.rollout_weights(x["old_logps"], x["rollout_logps"], x["mask"],
                                spec.sequence_index(x["mask"], x["segment_ids"]), opts, 20.0)
    rollout = dict(rollout_logps=x["rollout_logps"], rollout_correction=correction,
                   rollout_bounds=(0.6, 1.6))
    value, metrics = _spec_call(x, **options, **rollout)
    weighted, weighted_metrics = _spec_call(x, **options, importance_weights=w)
    # float64 on both sides: sums over the 3 x 6 tokens or the 13 vocabulary entries
    assert_close(value, weighted, spec.paths_tolerance(18, dtype="float64"), "loss")
    grad = _spec_call(x, spec.policy_loss_grad, **options, importance_weights=w)
    assert_close(_spec_call(x, spec.policy_loss_grad, **options, **rollout), grad,
                 spec.paths_tolerance(13, float(np.abs(grad).max()), "float64"), "grad")
    assert {k: metrics[k] for k in weighted_metrics} == weighted_metrics
    assert set(metrics) - set(weighted_metrics) == set(spec.ROLLOUT_METRIC_NAMES
                                                        + spec.ROLLOUT_PARITY_NAMES)


def test_metrics_only_leaves_the_loss_alone() -> None:
    x = _inputs(seed=2)
    value, metrics = _spec_call(x, kl_coef=0.1, rollout_logps=x["rollout_logps"])
    plain, plain_metrics = _spec_call(x, kl_coef=0.1)
    assert value == plain and metrics["rollout_weight_mean"] == 1.0
    assert metrics["rollout_k3"] > 0 and metrics["rollout_masked_fraction"] == 0.0


def test_the_options_are_checked_once_per_set() -> None:
    a = spec.rollout_options("token-mask", (0.5, 5.0), True)
    assert spec.rollout_options("token-mask", [0.5, 5.0], True) is a
    assert spec.rollout_options("token-mask", (0.5, 5.0), True, cached=False) == a
    assert spec.rollout_options(None, (0.0, 2.0), False) is None


# --- both frameworks: the same errors, the same metric keys, NaN on its own rows ------------

FRAMEWORKS = ["torch", "jax"]


def _framework_call(framework, x, **kwargs):
    """``loss.policy_loss`` of ``framework`` on ``x`` (float32, native backend)."""
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from ratiokl.torch import loss

        def conv(v):
            return torch.tensor(v.astype(np.float32) if v.dtype.kind == "f" else v)
    else:
        jnp = pytest.importorskip("jax.numpy")
        from ratiokl.jax import loss

        def conv(v):
            return jnp.asarray(v.astype(np.float32) if v.dtype.kind == "f" else v)
    kwargs = {k: conv(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    args = [conv(x[k]) for k in ("policy_logits", "ref_logits", "action_ids", "mask",
                                 "old_logps", "advantages")]
    return loss.policy_loss(*args, backend="native", **kwargs)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(rollout_correction="token-truncate"), ValueError, "needs `rollout_logps`"),
    (dict(rollout_correction="token_truncate", rollout_logps=True), ValueError,
     "`rollout_correction` must be one of"),
    (dict(rollout_correction="token-mask", rollout_bounds=(2.0, 1.0), rollout_logps=True),
     ValueError, "`rollout_bounds` must be \\(lo, hi\\) with 0 <= lo <= hi"),
    (dict(rollout_bounds=(-0.1, 1.0), rollout_logps=True), ValueError, "0 <= lo <= hi"),
    (dict(rollout_bounds=(float("nan"), 1.0), rollout_logps=True), ValueError, "0 <= lo"),
    (dict(rollout_correction="sequence-truncate", rollout_bounds=(0.0, math.inf),
          rollout_logps=True), ValueError, "must be finite"),
    (dict(rollout_bounds=(0.0, 1.0, 2.0), rollout_logps=True), TypeError,
     "`rollout_bounds` must be a pair"),
    (dict(rollout_bounds=(0, True), rollout_logps=True), TypeError, "`rollout_bounds`"),
    (dict(rollout_bounds=2.0, rollout_logps=True), TypeError, "`rollout_bounds` must be a pair"),
    (dict(rollout_logps="shape"), ValueError, "`rollout_logps` must have the logits' leading"),
    (dict(rollout_logps="int"), TypeError, "`rollout_logps` must be a floating"),
])
def test_bad_rollout_arguments_name_the_argument(framework, kwargs, error, match) -> None:
    x, kwargs = _inputs(), dict(kwargs)
    given = {"True": x["rollout_logps"], "shape": x["rollout_logps"][:, :-1],
             "int": x["action_ids"]}
    if "rollout_logps" in kwargs:
        kwargs["rollout_logps"] = given[str(kwargs["rollout_logps"])]
    with pytest.raises(error, match=match):
        _framework_call(framework, x, **kwargs)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_infinite_ceiling_masks_below_only(framework) -> None:
    x = _inputs(seed=3)
    options = dict(rollout_logps=x["rollout_logps"], rollout_correction="token-mask",
                   rollout_bounds=(0.7, math.inf))
    value, metrics = _framework_call(framework, x, **options)
    expected, expected_metrics = _spec_call(x, **options)
    # A float32 mean over the tokens of terms up to max |A| * max ratio.
    logp = spec.selected_logprobs(x["policy_logits"], x["action_ids"], x["mask"])
    ratio = np.exp(np.abs(logp - x["old_logps"])[x["mask"]]).max()
    magnitude = float(np.abs(x["advantages"]).max() * ratio)
    assert_close(value, expected, spec.reduction_tolerance(x["mask"].size, magnitude), "loss")
    assert_close(metrics["rollout_masked_fraction"], expected_metrics["rollout_masked_fraction"],
                 spec.rounding_tolerance(2), "rollout_masked_fraction")  # a ratio of counts
    assert 0 < expected_metrics["rollout_masked_fraction"] < 1


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_rollout_metrics_appear_only_with_rollout_logps(framework) -> None:
    x = _inputs()
    _, plain = _framework_call(framework, x)
    _, with_logps = _framework_call(framework, x, rollout_logps=x["rollout_logps"])
    rollout_names = spec.ROLLOUT_METRIC_NAMES + spec.ROLLOUT_PARITY_NAMES
    assert not set(plain) & set(rollout_names)
    assert list(with_logps) == list(plain) + list(rollout_names)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("correction", sorted(spec.ROLLOUT_CORRECTIONS))
def test_an_active_nan_rollout_logp_poisons_its_weight_only(framework, correction) -> None:
    """NaN is visible (the loss is NaN) and reaches the gradient of the tokens whose weight
    it is: the token itself, or every token of its sequence (no token is clipped here: a
    clipped token carries no gradient whatever its weight)."""
    x = _inputs(seed=4)
    row, col = np.argwhere(x["mask"])[2]
    x["rollout_logps"][row, col] = np.nan
    options = dict(rollout_logps=x["rollout_logps"], rollout_correction=correction,
                   rollout_bounds=(0.2, 5.0), clip_eps=0.99, clip_eps_high=100.0)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from ratiokl.torch import loss

        logits = torch.tensor(x["policy_logits"], dtype=torch.float32, requires_grad=True)
        rest = [torch.tensor(x[k].astype(np.float32) if x[k].dtype.kind == "f" else x[k])
                for k in ("action_ids", "mask", "old_logps", "advantages")]
        value, _ = loss.policy_loss(logits, None, *rest, **{
            **options, "rollout_logps": torch.tensor(x["rollout_logps"], dtype=torch.float32)})
        value.backward()
        value, grad = value.detach(), logits.grad.numpy()
    else:
        jax = pytest.importorskip("jax")
        from ratiokl.jax import loss

        rest = [jax.numpy.asarray(x[k].astype(np.float32) if x[k].dtype.kind == "f" else x[k])
                for k in ("action_ids", "mask", "old_logps", "advantages")]
        rollout = jax.numpy.asarray(x["rollout_logps"], jax.numpy.float32)

        def fn(z):
            return loss.policy_loss(z, None, *rest, **{**options, "rollout_logps": rollout})

        (value, _), grad = jax.value_and_grad(fn, has_aux=True)(
            jax.numpy.asarray(x["policy_logits"], jax.numpy.float32))
        grad = np.asarray(grad)
    assert np.isnan(float(value))
    poisoned = np.zeros(x["mask"].shape, bool)
    if correction.startswith("token"):
        poisoned[row, col] = True
    else:
        seq, _ = spec.sequence_index(x["mask"])
        poisoned = seq == seq[row, col]
    assert np.array_equal(np.isnan(grad).any(axis=-1), poisoned)
    assert not grad[~x["mask"]].any()
