"""GAE's Triton kernel and JAX's scan on a CUDA GPU against the float64 spec, over the shapes
around the kernel's tiles (one row block and several, a time tile and several, ragged
ends), with masks holding gaps (observation tokens) and padding. Run with
``pytest -m gpu tests/gpu/test_advantages_gpu.py``; skipped without CUDA."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ratiokl import spec
from ratiokl.torch import advantages

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [(1, 1), (1, 7), (3, 511), (2, 512), (5, 513), (64, 1500), (512, 8192)]


def _case(b: int, t: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(0.0, 1.0, (b, t)).astype(np.float32)
    values = rng.normal(0.0, 1.0, (b, t)).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    mask &= rng.random((b, t)) > 0.1  # observation tokens inside the response
    rewards[~mask] = np.nan  # never read
    return rewards, values, mask


def _close(got, want, what):
    got = np.asarray(got, np.float64)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= 2e-5 * scale, f"{what}: {err:.2e} (scale {scale:.1f})"


@pytest.mark.parametrize("b, t", SHAPES)
def test_gae_kernel_and_jax_scan_match_the_spec(b, t):
    rewards, values, mask = _case(b, t)
    want_adv, want_ret = spec.reference_gae(rewards, values, mask, 0.99, 0.95, whiten="none")
    r, v, m = (torch.tensor(a, device="cuda") for a in (rewards, values, mask))
    adv, ret = advantages.gae(r, v, m, 0.99, 0.95, whiten="none", backend="triton")
    _close(adv.cpu(), want_adv, "torch-triton advantages")
    _close(ret.cpu(), want_ret, "torch-triton returns")
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX's GPU backend")
    from ratiokl.jax import advantages as jax_advantages

    adv_j, ret_j = jax.jit(lambda r, v, m: jax_advantages.gae(
        r, v, m, 0.99, 0.95, whiten="none"))(rewards, values, mask)
    _close(adv_j, want_adv, "jax advantages")
    _close(ret_j, want_ret, "jax returns")
