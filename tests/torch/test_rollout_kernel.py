"""The rollout correction's one-launch kernel (``_kernels.rollout``) on the interpreter.

``ratiokl.torch._triton.rollout_weights`` (the Triton backends' path) against the
float64 spec and against the framework ops the native backend runs
(``ratiokl.torch._rollout``): every mode, token and sequence level (row sums,
``seq_width = T``; packed segments, per-token sums), with and without
importance weights, an infinite ceiling, no bound, more rows than one block,
masks with no, some and all rows active, garbage in inactive rows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._kernels.loss_rows import ROWS_BLOCK  # noqa: E402
from ratiokl.torch import _checks, _rollout, _triton  # noqa: E402

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


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("correction, bounds", MODES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_iw", [False, True])
def test_one_launch_matches_spec_and_framework_ops(shape, density, correction, bounds, packed,
                                                   with_iw) -> None:
    mask, old, rollout, iw, segs = _inputs(shape, density, seed=shape[-1] + int(10 * density))
    bound = None if correction == "token-truncate" else 20.0
    inputs = _checks.token_inputs(shape, torch.tensor(old, dtype=torch.float32),
                                  torch.zeros(shape), torch.tensor(segs) if packed else None,
                                  torch.tensor(iw, dtype=torch.float32) if with_iw else None,
                                  None)
    t_mask, t_rollout = torch.tensor(mask), torch.tensor(rollout, dtype=torch.float32)
    opts = spec.rollout_options(correction, bounds, True)
    args = (t_mask.reshape(-1), shape, inputs, t_rollout, opts, bound)
    kernel_inputs, kernel_metrics = _rollout.correct(*args, _triton.rollout_weights)
    ops_inputs, ops_metrics = _rollout.correct(*args)  # no launch: the framework ops
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
            assert got.shape == shape and got.dtype == torch.float32
            assert_close(got, want, weight_tol, "weights")
            assert (got[~t_mask] == 0).all()
        assert list(got_metrics) == list(spec.ROLLOUT_METRIC_NAMES)
        for name, value in got_metrics.items():
            assert value.shape == () and value.dtype == torch.float32
            assert_close(value, want_metrics[name], metric_tol, name)
    if correction is not None:  # the same formulas: float32 rounding apart
        assert_close(kernel_inputs.importance_weights, ops_inputs.importance_weights,
                     spec.paths_tolerance(shape[-1], w_max), "weights: kernel vs ops")


def test_an_active_nan_stays_nan_in_the_kernel() -> None:
    mask, old, rollout, _, _ = _inputs((2, 6), 1.0, seed=3)
    rollout[1, 2] = np.nan
    inputs = _checks.token_inputs((2, 6), torch.tensor(old, dtype=torch.float32),
                                  torch.zeros(2, 6), None, None, None)
    for correction, nan_rows in (("token-mask", [(1, 2)]), ("sequence-truncate",
                                                            [(1, c) for c in range(6)])):
        got, metrics = _rollout.correct(torch.tensor(mask).reshape(-1), (2, 6), inputs,
                                        torch.tensor(rollout, dtype=torch.float32),
                                        spec.rollout_options(correction, (0.1, 10.0), True),
                                        20.0, _triton.rollout_weights)
        nan = torch.isnan(got.importance_weights)
        assert sorted(map(tuple, nan.nonzero().tolist())) == nan_rows
        assert torch.isnan(metrics["rollout_weight_mean"]) and torch.isnan(metrics["rollout_k3"])
