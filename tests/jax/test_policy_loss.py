"""``ratiokl.jax.loss.policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``).

What only JAX has: GSPO under ``jit``, ``vmap``, a traced ``loss_normalizer`` (the
behaviours both frameworks share: ``tests/test_policy_loss_spec.py``).
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402
from policy_runners import (  # noqa: E402
    POSITIONAL, assert_matches_spec, jax_inputs, jax_loss_fn, run_jax)
from policy_test_cases import B, T, make_inputs  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _run(x, options, *, dtype=jnp.float32, keys=(), transform=lambda f: f):
    return run_jax(x, options, dtype=jnp.dtype(dtype).name, keys=keys, transform=transform)


def test_gspo_packed_rows_under_jit():
    x = make_inputs(seed=15, active=0.9)
    options = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.2}
    assert_matches_spec(*_run(x, options, keys=("segment_ids",), transform=jax.jit))


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