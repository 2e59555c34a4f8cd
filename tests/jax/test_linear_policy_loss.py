"""JAX ``linear_policy_loss`` through Triton's CPU interpreter (``backend="interpret"``).

Against JAX's materialised route on the same data (``hidden @ weight.T`` -> ``policy_loss``
-> ``jax.grad``; inactive rows' hidden states zeroed there) under ``jit``, with chunks that
leave a remainder (the ``fori_loop`` and the chunk after it), and against PyTorch's
``linear_policy_loss`` on the same arrays (the two frameworks' chunk loops). Garbage on
inactive rows stays out of both gradients. The head's options, the native backend and the
errors, on both frameworks: ``tests/test_linear_policy_loss.py``. Sizes are small: the
interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss as jax_loss  # noqa: E402
from ratiokl.torch import loss as torch_loss  # noqa: E402

B, T, H, V = 3, 8, 16, 300
OPTIONS = dict(kl_coef=0.05, entropy_coef=0.01, clip_eps_high=0.28,
               loss_agg="seq-mean-token-mean")


def _data(seed=0):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) > 0.3
    return dict(
        hidden=rng.standard_normal((B, T, H)).astype(np.float32),
        weight=(rng.standard_normal((V, H)) * 0.3).astype(np.float32),
        ids=rng.integers(0, V, (B, T)), mask=mask,
        old=(rng.standard_normal((B, T)) * 0.1 - 5.0).astype(np.float32),
        ref=(rng.standard_normal((B, T)) * 0.1 - 5.0).astype(np.float32),
        adv=rng.standard_normal(B).astype(np.float32),
    )


def _jax_grads(x, chunk_rows=None):
    """``(loss, metrics, d hidden, d weight)`` of the chunked call (``chunk_rows``) or of the
    materialised route (None), jitted."""
    rest = tuple(jnp.asarray(x[k]) for k in ("ids", "mask", "old", "adv", "ref"))

    def objective(h, w, ids, mask, old, adv, ref):
        if chunk_rows is None:
            logits = jnp.where(mask[..., None], h, 0.0) @ w.T
            return jax_loss.policy_loss(logits, None, ids, mask, old, adv, ref_logps=ref,
                                        backend="interpret", check_ids=False, **OPTIONS)
        return jax_loss.linear_policy_loss(h, w, ids, mask, old, adv, ref_logps=ref,
                                           chunk_rows=chunk_rows, backend="interpret",
                                           check_ids=False, **OPTIONS)

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    (value, metrics), (gh, gw) = grad(jnp.asarray(x["hidden"]), jnp.asarray(x["weight"]), *rest)
    return value, metrics, gh, gw


def _close(got, want, what, terms=B * T):
    """Two float32 routes: ``terms`` summands behind each value (the loss and metrics:
    tokens; d hidden: the vocabulary; d weight: the rows)."""
    magnitude = float(np.abs(np.asarray(want)).max())
    assert_close(got, want, spec.paths_tolerance(terms, magnitude), what)


def test_matches_the_materialised_route_under_jit():
    x = _data()
    want = _jax_grads(x)
    got = _jax_grads(x, chunk_rows=7)  # 3 chunks in the loop, 3 rows after it
    _close(got[0], want[0], "loss")
    for name in want[1]:
        _close(got[1][name], want[1][name], name)
    _close(got[2], want[2], "d hidden", V)
    _close(got[3], want[3], "d weight")


def test_matches_torch_and_keeps_garbage_out():
    x = _data(seed=1)
    dirty = dict(x, hidden=x["hidden"].copy())
    dirty["hidden"][~x["mask"]] = np.nan
    got = _jax_grads(dirty, chunk_rows=10)
    assert np.isfinite(np.asarray(got[3])).all()
    assert not np.asarray(got[2])[~x["mask"]].any()
    h = torch.tensor(dirty["hidden"], requires_grad=True)
    w = torch.tensor(x["weight"], requires_grad=True)
    value, metrics = torch_loss.linear_policy_loss(
        h, w, torch.tensor(x["ids"]), torch.tensor(x["mask"]), torch.tensor(x["old"]),
        torch.tensor(x["adv"]), ref_logps=torch.tensor(x["ref"]), chunk_rows=10,
        backend="interpret", **OPTIONS)
    value.backward()
    _close(got[0], value.detach().numpy(), "loss")
    for name in metrics:
        _close(got[1][name], metrics[name].numpy(), name)
    _close(got[2], h.grad.numpy(), "d hidden", V)
    _close(got[3], w.grad.numpy(), "d weight")


def test_native_float16_head_gradient_accumulates_in_float32():
    """A float16 head over a wide vocabulary: the native route's ``d hidden`` is as
    accurate as PyTorch's (JAX's own transpose of the half-precision GEMM summed the
    vocabulary in float16: 20 % off at V = 262,144 on the GPU, 25 % here)."""
    from ratiokl import spec

    rng = np.random.default_rng(3)
    n, width, vocab = 7, 16, 262_144
    hidden = rng.standard_normal((1, n, width)).astype(np.float32)
    weight = (rng.standard_normal((vocab, width)) * 2 / width**0.5).astype(np.float32)
    ids = rng.integers(0, vocab, (1, n))
    mask = np.ones((1, n), dtype=bool)
    old = rng.standard_normal((1, n)).astype(np.float32) - 12.0
    adv = rng.standard_normal((1, n)).astype(np.float32)

    def jax_grad(dtype):
        def objective(h):
            return jax_loss.linear_policy_loss(
                h, jnp.asarray(weight, dtype), jnp.asarray(ids), jnp.asarray(mask),
                jnp.asarray(old), jnp.asarray(adv), logit_scale=0.5, backend="native",
                check_ids=False)[0]
        return np.asarray(jax.jit(jax.grad(objective))(jnp.asarray(hidden, dtype)), np.float32)

    exact = jax_grad(jnp.float32)
    half = jax_grad(jnp.float16)
    tol = spec.linear_grad_tolerance("float16", 0.5, float(np.abs(exact).max()))
    assert_close(half, exact, tol, "d hidden")
