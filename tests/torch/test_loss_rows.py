"""The fused policy loss's metrics kernel (``_kernels.loss_rows``) on the interpreter.

The metrics kernel that ends the fused launch, against the PyTorch ops of
``ratiokl._core.objective`` (PyTorch adapter) it replaces: masks with no, some and all
rows active, more rows than one block, and NaN / inf in inactive rows' values. The
weights launch, on both bindings: ``tests/test_loss_rows.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import numpy as np  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._kernels import interpreted  # noqa: E402
from ratiokl._kernels.loss_rows import (  # noqa: E402
    METRIC_NAMES,
    ROWS_BLOCK,
    ROWS_WARPS,
    parity_constexprs,
    policy_metrics_kernel,
)
from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW  # noqa: E402
from ratiokl._core import objective as _objective  # noqa: E402
from ratiokl.torch._arrays import XP  # noqa: E402

#: [R, T] layouts: a few rows; more tokens than one block of the kernels' loops.
SHAPES = [(3, 5), (2, ROWS_BLOCK // 2 + 7)]
DENSITIES = [0.0, 0.6, 1.0]
#: The largest |value| the metrics test draws (log-probs in (-5, 0]).
ROW_SCALE = 5.0


def _mask(shape, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < density


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", DENSITIES)
def test_metrics_match_objective_ops(shape, density):
    n = shape[0] * shape[1]
    g = torch.Generator().manual_seed(2)
    mask = _mask((n,), density, seed=3)
    logp = torch.where(mask, -torch.rand(n, generator=g) * 5, 0.0)
    ratio = torch.where(mask, torch.rand(n, generator=g) * 2, 1.0)
    kl = torch.where(mask, torch.rand(n, generator=g), 0.0)
    ent = torch.where(mask, torch.rand(n, generator=g) * 3, torch.tensor(float("nan")))
    bits = torch.randint(0, 8, (n,), generator=g, dtype=torch.int32)
    old = -torch.rand(n, generator=g) * 5
    # Garbage where rows are inactive: it must stay out of every mean.
    old = torch.where(mask, old, torch.tensor(float("nan")))
    ratio = torch.where(mask, ratio, torch.tensor(float("inf")))
    bits = torch.where(mask, bits, torch.tensor(7, dtype=torch.int32))
    loss_rows = torch.where(mask, torch.randn(n, generator=g), 0.0).requires_grad_(True)
    out = torch.full((len(METRIC_NAMES),), float("nan"))
    total = torch.tensor(float("nan"))
    with np.errstate(all="ignore"):
        interpreted(policy_metrics_kernel)[(1,)](
            mask, logp, ratio, kl, ent, bits, old, loss_rows.detach(), old, out, total, n,
            HAS_ROLLOUT=False, **parity_constexprs(spec.ROLLOUT_PARITY_TOLERANCES),
            BLOCK=ROWS_BLOCK, num_warps=ROWS_WARPS)
    loss_tol = spec.paths_tolerance(n, float(loss_rows.detach().abs().sum()))
    assert_close(total, loss_rows.detach().sum(), loss_tol, "loss")
    got = dict(zip(METRIC_NAMES, out.unbind()))
    want = _objective.token_metrics(
        XP, mask, mask.sum(), (bits & CLIP_LOW.value) != 0, (bits & CLIP_HIGH.value) != 0,
        (bits & CLIP_CAPPED.value) != 0, ratio, kl, torch.where(mask, old, 0.0) - logp, ent,
    )
    assert set(got) == set(want)
    for name in want:
        assert got[name].shape == () and torch.isfinite(got[name]), name
        assert_close(got[name], want[name], spec.paths_tolerance(n, ROW_SCALE), name)
    if density == 0.0:
        assert all(float(v) == 0.0 for v in got.values())
