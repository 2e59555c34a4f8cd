"""The fused policy loss's aggregation weights on Triton's CPU interpreter, one body run on
both bindings (``torch-interpret``, ``jax-interpret``).

Each binding's ``token_weights`` (the weights launch of ``_kernels.loss_rows``) against the
core ops it replaces (``ratiokl._core.objective.aggregation_weights``, with that
framework's adapter): every aggregation, with and without a normaliser (a number or an
array), masks with no, some and all rows active, more rows than one block; and which of
them launch the weights kernel. What only one binding has (the metrics kernel's own tests,
``vmap`` and ``jit``) stays in ``tests/torch`` and ``tests/jax`` ``test_loss_rows.py``.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402

from ratiokl import harness, spec  # noqa: E402
from ratiokl._core import objective as _objective  # noqa: E402
from ratiokl._kernels.loss_rows import ROWS_BLOCK  # noqa: E402
from ratiokl.spec import LOSS_AGGS, POLICY_LOSS_DEFAULTS, policy_loss_options  # noqa: E402

#: [R, T] layouts: a few rows; more tokens than one block of the kernels' loops.
SHAPES = [(3, 5), (2, ROWS_BLOCK // 2 + 7)]
DENSITIES = [0.0, 0.6, 1.0]
#: A weight of the kernel and of the ops: a count's conversion and up to two divisions each.
WEIGHT_TOL = spec.rounding_tolerance(2 * 3)


def _weights(framework: str, mask: np.ndarray, segs: np.ndarray, normalizer, opts,
             monkeypatch):
    """``(got, want, kernels)``: the binding's ``token_weights`` on ``mask`` (None where it
    leaves the weights to the ops), the core ops' weights (both as NumPy arrays) and the
    kernels the binding launched; ``normalizer``: None, a number or ``"array"`` (7.5)."""
    shape = mask.shape
    checks = importlib.import_module(f"ratiokl.{framework}._checks")
    xp = importlib.import_module(f"ratiokl.{framework}._arrays").XP
    if framework == "torch":
        import torch

        from ratiokl.torch import _launch, _triton

        kernels = []
        launch = _launch.TOKEN_WEIGHTS.run

        def spy(*args):
            kernels.append("token_weights_kernel")
            return launch(*args)

        monkeypatch.setattr(_launch.TOKEN_WEIGHTS, "run", spy)
        m, s, zeros = torch.from_numpy(mask), torch.from_numpy(segs), torch.zeros(shape)
        norm = torch.tensor(7.5) if normalizer == "array" else normalizer
        inputs = checks.token_inputs(shape, zeros, zeros, s, None, norm)
        got = _triton.token_weights(m.reshape(-1), opts, inputs.loss_normalizer, shape[-1])
    else:
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import _interpret, _triton_loss

        m, s, zeros = jnp.asarray(mask), jnp.asarray(segs), jnp.zeros(shape, jnp.float32)
        norm = jnp.float32(7.5) if normalizer == "array" else normalizer
        inputs = checks.token_inputs(shape, zeros, zeros, s, None, norm)
        with _interpret.recording() as staged:
            got = jax.block_until_ready(_triton_loss.token_weights(
                _interpret.triton_call, m.reshape(-1), opts, inputs.loss_normalizer,
                shape[-1]))
        kernels = [launch.kernel for launch in staged]
    want = _objective.aggregation_weights(xp, m, inputs.segment_ids, inputs.loss_normalizer,
                                          opts)
    if got is not None:
        assert str(got.dtype).endswith("float32") and tuple(got.shape) == (mask.size,)
        got = np.asarray(got).reshape(shape)
    return got, np.asarray(want), kernels


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("agg", sorted(LOSS_AGGS))
@pytest.mark.parametrize("normalizer", [None, 7.5, "array"])
def test_weights_match_objective_ops(interpret_target, shape, density, agg, normalizer,
                                     monkeypatch):
    rng = np.random.default_rng(len(agg))
    mask = rng.random(shape) < density
    segs = np.random.default_rng(1).integers(0, 3, shape)
    opts = policy_loss_options(**{**POLICY_LOSS_DEFAULTS, "loss_agg": agg})
    got, want, kernels = _weights(harness.TARGETS[interpret_target].framework, mask, segs,
                                  normalizer, opts, monkeypatch)
    # One weight for every active token: "none" (weight 1; the routes refuse a normaliser
    # with it), a number, or the active count; not sequence lengths or counts, nor an
    # array normaliser (the caller takes the ops).
    uniform = agg == "none" or (normalizer != "array" and agg != "seq-mean-token-mean" and not (
        agg == "seq-mean-token-sum" and normalizer is None))
    assert (got is not None) == uniform
    # The active count on the device (token-mean without a normaliser); a known D: a `where`.
    counted = normalizer is None and agg == "token-mean"
    assert kernels == (["token_weights_kernel"] if counted else [])
    if got is None:
        return
    assert got.shape == want.shape
    # WEIGHT_TOL's atol is 0: an inactive entry must be the exact 0 the ops give.
    assert_close(got, want, WEIGHT_TOL, "weights")
    assert np.all(want[~mask] == 0)
