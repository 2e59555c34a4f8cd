"""The fused policy loss's row-vector launches in JAX (``ratiokl.jax._launch``), interpreted.

The JAX Triton backends launch ``_kernels.loss_rows`` through their launch function,
here the interpreter's (``ratiokl.jax._interpret.triton_call``, ``backend="interpret"``).
The metrics against the core ops (``ratiokl._core.objective``, JAX adapter) they
replace: masks with no, some and all rows active, more rows than one block, NaN / inf in
inactive rows' values; ``vmap`` (which takes the ops, one problem at a time) and ``jit``,
for the metrics and the weights. The weights launch against the ops, on both bindings:
``tests/test_loss_rows.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("triton")
pytest.importorskip("torch")  # the interpreter runs the kernels on torch CPU tensors

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._kernels.loss_rows import METRIC_NAMES, ROWS_BLOCK  # noqa: E402
from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW  # noqa: E402
from ratiokl._core import objective as _objective  # noqa: E402
from ratiokl.jax import _checks, _interpret, _launch, _triton_loss  # noqa: E402
from ratiokl.jax._arrays import XP  # noqa: E402
from ratiokl.spec import POLICY_LOSS_DEFAULTS, policy_loss_options  # noqa: E402

#: [R, T] layouts: a few rows; more tokens than one block of the kernels' loops.
SHAPES = [(3, 5), (2, ROWS_BLOCK // 2 + 7)]
DENSITIES = [0.0, 0.6, 1.0]
#: The largest |value| :func:`_rows` draws (log-probs in (-5, 0]).
ROW_SCALE = 5.0


#: A weight of the kernel and of the ops: a count's conversion and up to two divisions each.
WEIGHT_TOL = spec.rounding_tolerance(2 * 3)


def _rows_tol(n: int, loss_rows=None):
    """The kernel's and the ops' sums over ``n`` rows: a mean of values up to ROW_SCALE, or
    the loss's total (its summands' absolute sum bounds the error)."""
    scale = ROW_SCALE if loss_rows is None else float(jnp.sum(jnp.abs(loss_rows)))
    return spec.paths_tolerance(n, scale)


#: The interpreter backend's launch function.
CALL = _interpret.triton_call


@pytest.fixture
def launches():
    """The launches staged during the test (each call when eager, once per ``jit``)."""
    with _interpret.recording() as staged:
        yield staged


def _kernels(launches) -> list:
    """The kernels' names, in order."""
    return [launch.kernel for launch in launches]


def _mask(shape, density: float, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random(shape) < density


def _rows(n: int, density: float):
    rng = np.random.default_rng(2)
    mask = _mask((n,), density, seed=3)
    logp = np.where(mask, -rng.random(n) * 5, 0.0).astype(np.float32)
    # Garbage where rows are inactive: it must stay out of every mean.
    ratio = np.where(mask, rng.random(n) * 2, np.inf).astype(np.float32)
    kl = np.where(mask, rng.random(n), 0.0).astype(np.float32)
    ent = np.where(mask, rng.random(n) * 3, np.nan).astype(np.float32)
    bits = np.where(mask, rng.integers(0, 8, n), 7).astype(np.int32)
    old = np.where(mask, -rng.random(n) * 5, np.nan).astype(np.float32)
    loss_rows = np.where(mask, rng.normal(size=n), 0.0).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (loss_rows, mask, logp, ratio, kl, ent, bits, old))


def _loss_and_metrics(loss_rows, mask, logp, ratio, kl, ent, bits, old):
    """``(loss, metrics)`` from the metrics launch that ends the fused loss."""
    means, total = _launch.metrics_op(CALL)(mask, logp, ratio, kl, ent, bits, old, loss_rows)
    return total, {name: means[i] for i, name in enumerate(METRIC_NAMES)}


def _objective_metrics(mask, logp, ratio, kl, ent, bits, old):
    return _objective.token_metrics(
        XP, mask, jnp.sum(mask), (bits & CLIP_LOW.value) != 0,
        (bits & CLIP_HIGH.value) != 0, (bits & CLIP_CAPPED.value) != 0, ratio, kl,
        jnp.where(mask, old, 0.0) - logp, ent,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", DENSITIES)
def test_metrics_and_loss_match_objective_ops(launches, shape, density):
    loss_rows, *rest = _rows(shape[0] * shape[1], density)
    total, got = jax.block_until_ready(_loss_and_metrics(loss_rows, *rest))
    assert _kernels(launches) == ["policy_metrics_kernel"]
    n = shape[0] * shape[1]
    assert_close(total, jnp.sum(loss_rows), _rows_tol(n, loss_rows), "loss")
    want = _objective_metrics(*rest)
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == () and np.isfinite(float(got[name])), name
        assert_close(got[name], want[name], _rows_tol(n), name)
    if density == 0.0:
        assert all(float(v) == 0.0 for v in got.values())


def test_vmap_takes_each_problem_on_its_own_and_jit_runs_one_launch_a_call(launches):
    a, b = _rows(40, 0.5), _rows(40, 0.9)
    stacked = [jnp.stack([x, y]) for x, y in zip(a, b)]
    totals, metrics = jax.block_until_ready(jax.vmap(_loss_and_metrics)(*stacked))
    assert _kernels(launches) == []  # mapped: the ops of _objective, each problem its own means
    for i, rows in enumerate((a, b)):
        want = _objective_metrics(*rows[1:])
        assert_close(totals[i], jnp.sum(rows[0]), _rows_tol(40, rows[0]), "loss")
        for name, value in want.items():
            assert_close(metrics[name][i], value, _rows_tol(40), name)
    masks = stacked[1].reshape(2, 4, 10)
    zeros = jnp.zeros((4, 10), jnp.float32)
    inputs = _checks.token_inputs((4, 10), zeros, zeros, None, None, None)
    opts = policy_loss_options(**{**POLICY_LOSS_DEFAULTS, "loss_agg": "token-mean"})
    w = jax.block_until_ready(jax.vmap(
        lambda m: _triton_loss.token_weights(CALL, m.reshape(-1), opts, None, 10))(masks))
    for i in range(2):
        want_w = _objective.aggregation_weights(XP, masks[i], inputs.segment_ids,
                                                inputs.loss_normalizer, opts)
        assert_close(w[i].reshape(4, 10), want_w, WEIGHT_TOL, "weights")
    assert _kernels(launches) == []
    jitted = jax.block_until_ready(jax.jit(_loss_and_metrics)(*a))
    assert _kernels(launches) == ["policy_metrics_kernel"]
    jax.block_until_ready(jax.jit(_loss_and_metrics)(*a))
    assert _kernels(launches) == ["policy_metrics_kernel"] * 2  # one compilation, a run a call
    assert_close(jitted[0], jnp.sum(a[0]), _rows_tol(40, a[0]), "loss")
