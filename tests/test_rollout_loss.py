"""``policy_loss`` with the rollout correction against the float64 spec, one body per
behaviour on every CPU target (``torch-native``, ``torch-interpret``, ``jax-native``,
``jax-interpret``).

Every mode at token and sequence level, on rows and packed segments, with and without
importance weights and a KL term (JAX under ``jit``); exact zero gradients where the weight
is 0 and on inactive rows; NaN ``rollout_logps`` on inactive rows reaching nothing;
all-inactive and empty batches. What only one framework has stays in ``tests/torch`` and
``tests/jax`` ``test_rollout.py`` (the cases: ``tests/helpers/rollout_test_cases.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import as_float64, assert_close
from rollout_test_cases import CASES, LOSS_TOL, T, grad_tolerance, make_inputs

from ratiokl import harness, spec

POSITIONAL = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")
#: Inactive rows hold data the kernels never use; the interpreter's numpy warns on it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _split(name, x):
    """``(array keyword arguments, static options)`` of a case."""
    options = dict(CASES[name])
    arrays = {"rollout_logps": x["rollout_logps"]}
    if options.pop("packed", False):
        arrays["segment_ids"] = x["segment_ids"]
    if options.pop("importance", False):
        arrays["importance_weights"] = x["importance_weights"]
    return arrays, options


def _f32(v):
    return v.astype(np.float32) if v.dtype.kind == "f" else v


def _run(target, x, arrays, static):
    """``(loss, metrics, policy-logit gradient)`` as NumPy; each metric a float32 0-d value
    that carries no gradient."""
    t = harness.TARGETS[target]
    if t.framework == "torch":
        import torch

        from ratiokl.torch import loss

        logits = torch.from_numpy(_f32(x["policy_logits"])).requires_grad_(True)
        rest = [torch.from_numpy(_f32(x[k])) for k in POSITIONAL[1:]]
        kw = {k: torch.from_numpy(_f32(v)) for k, v in arrays.items()}
        value, metrics = loss.policy_loss(logits, *rest, backend=t.backend, **kw, **static)
        (grad,) = torch.autograd.grad(value, logits)
        for m in metrics.values():
            assert m.dtype == torch.float32 and m.dim() == 0 and not m.requires_grad
        return (value.detach().numpy(), {k: m.numpy() for k, m in metrics.items()},
                grad.numpy())
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    def fn(logits, rest, kw):
        return loss.policy_loss(logits, *rest, backend=t.backend, check_ids=False, **kw,
                                **static)

    (value, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(
        jnp.asarray(_f32(x["policy_logits"])), [jnp.asarray(_f32(x[k])) for k in POSITIONAL[1:]],
        {k: jnp.asarray(_f32(v)) for k, v in arrays.items()})
    for m in metrics.values():
        assert m.dtype == jnp.float32 and m.ndim == 0
    return np.asarray(value), {k: np.asarray(m) for k, m in metrics.items()}, np.asarray(grad)


def _spec(x, options):
    args = [x[k] for k in POSITIONAL]
    value, metrics = spec.policy_loss(*args, **options)
    return value, metrics, spec.policy_loss_grad(*args, **options)


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_spec(cpu_target, name) -> None:
    x = make_inputs(seed=sorted(CASES).index(name))
    arrays, static = _split(name, x)
    value, metrics, grad = _run(cpu_target, x, arrays, static)
    want, want_metrics, want_grad = _spec(x, {**arrays, **static})
    assert_close(value, want, LOSS_TOL, "loss")
    assert sorted(metrics) == sorted(want_metrics)  # jit returns a dict's keys sorted
    for key, expected in want_metrics.items():
        assert_close(metrics[key], expected, LOSS_TOL, key)
    assert_close(grad, want_grad, grad_tolerance(want_grad), "grad")
    assert not grad[~x["mask"]].any()


@pytest.mark.parametrize("correction", ["token-mask", "sequence-mask"])
def test_a_weight_of_zero_gives_exactly_zero_gradient(cpu_target, correction) -> None:
    """Without a KL term, a masked token's (and an inactive one's) gradient is exactly 0,
    and it still counts in token-mean's denominator."""
    x = make_inputs(seed=21)
    static = dict(rollout_correction=correction, rollout_bounds=(0.8, 1.25))
    value, metrics, grad = _run(cpu_target, x, {"rollout_logps": x["rollout_logps"]}, static)
    opts = spec.rollout_options(correction, (0.8, 1.25), True)
    w, _ = spec.rollout_weights(x["old_logps"], x["rollout_logps"], x["mask"],
                                spec.sequence_index(x["mask"]), opts, 20.0)
    zero = ~x["mask"] | (w == 0)
    assert x["mask"][zero].any() and (~zero).any()
    assert not grad[zero].any() and grad[~zero].any(axis=-1).all()
    masked = (x["mask"] & (w == 0)).sum() / x["mask"].sum()
    assert_close(metrics["rollout_masked_fraction"], masked, spec.rounding_tolerance(1),
                 "rollout_masked_fraction")
    unweighted, _, _ = _run(cpu_target, x, {"importance_weights": np.where(x["mask"], w, 0.0)}, {})
    assert_close(value, as_float64(unweighted), spec.paths_tolerance(int(x["mask"].sum())),
                 "loss")


def test_inactive_rollout_logps_reach_nothing(cpu_target) -> None:
    """NaN, inf or huge values on inactive rows: the same bits out, zero gradient there."""
    x = make_inputs(seed=5)
    outs = []
    for fill in (np.nan, np.inf, -1e30):
        x["rollout_logps"] = np.where(x["mask"], x["rollout_logps"], fill)
        outs.append(_run(cpu_target, x, {"rollout_logps": x["rollout_logps"],
                                     "segment_ids": x["segment_ids"]},
                         dict(rollout_correction="sequence-truncate")))
    for value, metrics, grad in outs[1:]:
        assert value == outs[0][0] and np.isfinite(value)
        assert all(metrics[k] == outs[0][1][k] for k in metrics)
        np.testing.assert_array_equal(grad, outs[0][2])


def test_all_inactive_and_empty_batches(cpu_target) -> None:
    for x in (make_inputs(seed=6, active=0.0), make_inputs(seed=7, lead=(0, T))):
        value, metrics, grad = _run(cpu_target, x, {"rollout_logps": x["rollout_logps"]},
                                    dict(rollout_correction="sequence-mask"))
        assert value == 0.0 and not grad.any()
        assert all(metrics[k] == 0.0 for k in spec.ROLLOUT_METRIC_NAMES)


def test_parity_fractions_compare_the_calls_logp_with_the_engines(cpu_target) -> None:
    """``rollout_logp_off_{1,5}pct_fraction`` count active tokens whose exp(logp -
    rollout_logp) leaves [0.99, 1.01] / [0.95, 1.05]: against the call's own log-probs (not
    ``old_logps``, set far off here), a NaN engine log-prob counting as off."""
    x = make_inputs(seed=11)
    mask = x["mask"]
    logp = spec.selected_logprobs(x["policy_logits"].astype(np.float32), x["action_ids"], mask)
    # Per active token in turn: within 1 %, between 1 % and 5 %, beyond 5 %, NaN.
    shifts = np.resize([0.002, -0.003, 0.03, -0.02, 0.2, -0.5, np.nan], mask.shape)
    x["rollout_logps"] = np.where(mask, logp - shifts, np.nan)
    x["old_logps"] = np.where(mask, logp - 3.0, np.nan)
    _, metrics, _ = _run(cpu_target, x, {"rollout_logps": x["rollout_logps"]}, {})
    kinds = shifts[mask]
    n = kinds.size
    off_5 = np.sum(np.isnan(kinds) | (np.abs(np.nan_to_num(kinds)) > 0.1)) / n
    off_1 = off_5 + np.sum(np.isin(kinds, (0.03, -0.02))) / n
    assert 0.0 < off_5 < off_1 < 1.0
    tol = spec.rounding_tolerance(1)
    assert_close(metrics["rollout_logp_off_1pct_fraction"], off_1, tol, "off 1 %")
    assert_close(metrics["rollout_logp_off_5pct_fraction"], off_5, tol, "off 5 %")
