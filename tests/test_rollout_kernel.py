"""The rollout correction's one-launch kernel (``_kernels.rollout``) on the interpreter,
one body run on both bindings (``torch-interpret``, ``jax-interpret``).

The backend's ``rollout_weights`` (the Triton backends' path, through
``ratiokl._core.route.rollout_step``) against the float64 spec and against the framework ops
the native backend runs (the same step without a launch): every mode, token and
sequence level (row sums, ``seq_width = T``; packed segments, per-token sums), with and
without importance weights, an infinite ceiling, no bound, more rows than one block, masks
with no, some and all rows active, garbage in inactive rows. JAX's launch under ``vmap``:
``tests/jax/test_rollout.py``.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest

pytest.importorskip("triton")

from assertions import as_float64, assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._core import checks  # noqa: E402
from ratiokl._core.route import rollout_step  # noqa: E402
from ratiokl._kernels.loss_rows import ROWS_BLOCK  # noqa: E402

#: [R, T]: a few tokens; more tokens than one block of the kernel's loop, several rows.
SHAPES = [(3, 5), (3, ROWS_BLOCK // 2 + 7)]
MODES = [(None, (0.0, 2.0)), ("token-truncate", (0.0, 1.3)), ("token-mask", (0.7, 1.4)),
         ("token-mask", (0.8, math.inf)), ("sequence-truncate", (0.0, 1.1)),
         ("sequence-mask", (0.5, 1.6))]


def _inputs(shape, density, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random(shape) < density
    old = rng.normal(-3.0, 1.0, shape)
    # Sequence sums of T ~ 2000 tokens need a small per-token gap to stay near 1.
    noise = 0.3 if shape[-1] < 100 else 0.01
    rollout = old + rng.normal(0.0, noise, shape)
    iw = rng.uniform(0.5, 1.5, shape)
    segs = np.sort(rng.integers(0, 4, shape), axis=-1)
    for x, fill in ((old, np.nan), (rollout, np.inf), (iw, np.nan)):
        x[~mask] = fill
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731 - what torch gets
    return mask, f32(old), f32(rollout), f32(iw), segs


class _Binding:
    """One framework's array adapter, its interpret backend's launch and array maker."""

    def __init__(self, target: str):
        self.framework = target.split("-")[0]
        self.xp = importlib.import_module(f"ratiokl.{self.framework}._arrays").XP
        route = importlib.import_module(f"ratiokl.{self.framework}._route")
        if self.framework == "torch":
            import torch

            self.launch = route.resolve("interpret", torch.device("cpu")).rollout_weights
            self.array = lambda x, dtype=None: torch.tensor(  # noqa: E731
                x, dtype=None if dtype is None else getattr(torch, dtype))
        else:
            import jax.numpy as jnp

            self.launch = route.resolve("interpret").rollout_weights
            self.array = lambda x, dtype=None: jnp.asarray(  # noqa: E731
                x, None if dtype is None else getattr(jnp, dtype))

    def token_inputs(self, shape, old, rollout, iw=None, segs=None):
        zeros = self.array(np.zeros(shape), "float32")
        return checks.token_inputs(
            self.xp, shape, self.array(old, "float32"), zeros,
            None if segs is None else self.array(segs, "int32"),
            None if iw is None else self.array(iw, "float32"), None,
            rollout_logps=self.array(rollout, "float32"))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("correction, bounds", MODES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_iw", [False, True])
def test_one_launch_matches_spec_and_framework_ops(interpret_target, shape, density, correction,
                                                   bounds, packed, with_iw) -> None:
    fw = _Binding(interpret_target)
    mask, old, rollout, iw, segs = _inputs(shape, density, seed=shape[-1] + int(10 * density))
    bound = None if correction == "token-truncate" else 20.0
    inputs = fw.token_inputs(shape, old, rollout, iw if with_iw else None,
                             segs if packed else None)
    opts = spec.rollout_options(correction, bounds, True)
    args = (fw.xp, fw.array(mask).reshape(-1), shape, inputs, opts, bound)
    kernel_inputs, kernel_metrics = rollout_step(*args, fw.launch)
    ops_inputs, ops_metrics = rollout_step(*args)  # no launch: the framework ops
    w, want_metrics = spec.rollout_weights(old, rollout, mask,
                                           spec.sequence_index(mask, segs if packed else None),
                                           opts, bound)
    want = w * np.where(mask, iw, 0.0) if with_iw else w
    # A weight exponentiates a sum of up to T log-weights (a sequence's); metrics: means of
    # all R*T tokens.
    w_max = float(np.abs(want).max()) if want.size else 0.0
    weight_tol = spec.reduction_tolerance(shape[-1], w_max)
    metric_tol = spec.reduction_tolerance(shape[0] * shape[1])
    for got_inputs, got_metrics in ((kernel_inputs, kernel_metrics), (ops_inputs, ops_metrics)):
        got = got_inputs.importance_weights
        if correction is None:  # metrics only: the inputs are left as they were
            assert got is inputs.importance_weights
        else:
            assert tuple(got.shape) == shape and str(got.dtype).endswith("float32")
            assert_close(got, want, weight_tol, "weights")
            assert (as_float64(got)[~mask] == 0).all()
        assert list(got_metrics) == list(spec.ROLLOUT_METRIC_NAMES)
        for name, value in got_metrics.items():
            assert value.shape == () and str(value.dtype).endswith("float32")
            assert_close(value, want_metrics[name], metric_tol, name)
    if correction is not None:  # the same formulas: float32 rounding apart
        assert_close(kernel_inputs.importance_weights, ops_inputs.importance_weights,
                     spec.paths_tolerance(shape[-1], w_max), "weights: kernel vs ops")


def test_an_active_nan_stays_nan_in_the_kernel(interpret_target) -> None:
    fw = _Binding(interpret_target)
    mask, old, rollout, _, _ = _inputs((2, 6), 1.0, seed=3)
    rollout[1, 2] = np.nan
    inputs = fw.token_inputs((2, 6), old, rollout)
    for correction, nan_rows in (("token-mask", [(1, 2)]), ("sequence-truncate",
                                                            [(1, c) for c in range(6)])):
        got, metrics = rollout_step(
            fw.xp, fw.array(mask).reshape(-1), (2, 6), inputs,
            spec.rollout_options(correction, (0.1, 10.0), True), 20.0, fw.launch)
        nan = np.isnan(as_float64(got.importance_weights))
        assert sorted(map(tuple, np.argwhere(nan).tolist())) == nan_rows
        assert np.isnan(as_float64(metrics["rollout_weight_mean"]))
        assert np.isnan(as_float64(metrics["rollout_k3"]))
