"""``linear_policy_loss`` of both frameworks, one body per behaviour on each target that runs
without a GPU (native and Triton's CPU interpreter; JAX under ``jit``).

The head's options (a bias with masked tokens, a logit scale, a softcap, per-token
temperatures) against the materialised ``policy_loss`` on ``softcap((where(mask, h, 0) @
W.T + b) * scale)`` and autograd's / ``jax.grad``'s three gradients; the native backend
(every row's logits at once) against the interpreter's chunks; errors that name the
argument. What only one framework has stays in ``tests/torch`` and ``tests/jax``
``test_linear_policy_loss.py``. Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, Sequence

import numpy as np
import pytest

from assertions import assert_close

from ratiokl import harness, spec
from ratiokl.spec import LogitTransform, transform_logits

B, T, H, V = 3, 8, 16, 300  # 24 rows
OPTIONS = dict(kl_coef=0.05, entropy_coef=0.01)


def _data(seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(
        hidden=rng.standard_normal((B, T, H)).astype(np.float32),
        weight=(rng.standard_normal((V, H)) * 0.3).astype(np.float32),
        ids=rng.integers(0, V, (B, T)), mask=rng.random((B, T)) > 0.3,
        old=(rng.standard_normal((B, T)) * 0.1 - 5.0).astype(np.float32),
        ref=(rng.standard_normal((B, T)) * 0.1 - 5.0).astype(np.float32),
        adv=rng.standard_normal(B).astype(np.float32),
    )


def _value_and_grads(framework: str, call: Callable, x: Dict[str, np.ndarray],
                     leaves: Sequence[str]):
    """``(value, metrics, grads of leaves)`` of ``call(loss, xp, arrays)`` -> ``(value,
    metrics)`` on ``x`` as ``framework`` arrays (JAX: ``jax.value_and_grad`` under ``jit``);
    ``xp`` is ``torch`` or ``jax.numpy``."""
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    if framework == "torch":
        import torch

        arrays = {k: torch.tensor(v) for k, v in x.items()}
        for name in leaves:
            arrays[name].requires_grad_()
        value, metrics = call(loss, torch, arrays)
        value.backward()
        return value.detach(), metrics, [arrays[name].grad for name in leaves]
    import jax
    import jax.numpy as jnp

    fixed = {k: jnp.asarray(v) for k, v in x.items() if k not in leaves}

    def objective(*grads_of):
        return call(loss, jnp, dict(fixed, **dict(zip(leaves, grads_of))))

    grad = jax.jit(jax.value_and_grad(objective, argnums=tuple(range(len(leaves))),
                                      has_aux=True))
    (value, metrics), grads = grad(*(jnp.asarray(x[name]) for name in leaves))
    return value, metrics, list(grads)


def _close(got, want, what, terms=B * T):
    """Two float32 routes: ``terms`` summands behind each value (the loss and metrics:
    tokens; d hidden: the vocabulary; d weight and d bias: the rows)."""
    magnitude = float(np.abs(np.asarray(want, dtype=np.float64)).max())
    assert_close(got, want, spec.paths_tolerance(terms, magnitude), what)


def _head_data(seed: int) -> Dict[str, np.ndarray]:
    """``_data`` with a bias masking a fifth of the tokens (-inf, never a sampled one) and
    per-token temperatures."""
    x = _data(seed)
    rng = np.random.default_rng([seed, 1])
    bias = (rng.standard_normal(V) * 0.5).astype(np.float32)
    drop = rng.random(V) < 0.2
    drop[x["ids"].reshape(-1)] = False
    bias[drop] = -np.inf
    x.update(bias=bias, temperature=(rng.random((B, T)) + 0.5).astype(np.float32))
    return x


@pytest.mark.parametrize("softcap", [None, 2.5])
def test_bias_logit_scale_softcap_match_the_materialised_route(cpu_target, softcap):
    """The head's options give the loss, metrics and the three gradients of the materialised
    ``policy_loss`` on ``softcap((where(mask, h, 0) @ W.T + b) * scale)`` (a float32 GEMM)."""
    target = harness.TARGETS[cpu_target]
    x = _head_data(seed=7)

    def materialised(loss, xp, a):
        kept = xp.where(a["mask"][..., None], a["hidden"], xp.zeros((), dtype=a["hidden"].dtype))
        if xp.__name__ == "torch":
            u = kept @ a["weight"].t()
        else:
            import jax

            u = xp.matmul(kept, a["weight"].T, precision=jax.lax.Precision.HIGHEST)
        logits = transform_logits(u + a["bias"], LogitTransform(0.7, softcap), xp.tanh)
        return loss.policy_loss(logits, None, a["ids"], a["mask"], a["old"], a["adv"],
                                ref_logps=a["ref"], temperature=a["temperature"],
                                backend="interpret", check_ids=False, **OPTIONS)

    def chunked(loss, xp, a):
        return loss.linear_policy_loss(
            a["hidden"], a["weight"], a["ids"], a["mask"], a["old"], a["adv"], bias=a["bias"],
            logit_scale=0.7, logit_softcap=softcap, chunk_rows=7, ref_logps=a["ref"],
            temperature=a["temperature"], backend=target.backend, check_ids=False, **OPTIONS)

    leaves = ("hidden", "weight", "bias")
    want, want_metrics, want_grads = _value_and_grads(target.framework, materialised, x, leaves)
    got, metrics, grads = _value_and_grads(target.framework, chunked, x, leaves)
    _close(got, want, "loss")
    for name in want_metrics:
        _close(metrics[name], want_metrics[name], name)
    for (what, terms), a, e in zip((("d hidden", V), ("d weight", B * T), ("d bias", B * T)),
                                   grads, want_grads):
        assert np.isfinite(np.asarray(a)).all(), what
        _close(a, e, what, terms)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_native_backend_materialises_the_same_loss(framework):
    """``backend="native"`` (what ``"auto"`` picks without a GPU): every row's logits at
    once, the framework-ops loss; the values and gradients of the interpreter's chunks,
    garbage (NaN hidden states) on inactive rows kept out."""
    pytest.importorskip(framework)
    x = _data(seed=6)
    x["hidden"][~x["mask"]] = np.nan

    def call(backend, chunk_rows):
        def run(loss, xp, a):
            return loss.linear_policy_loss(
                a["hidden"], a["weight"], a["ids"], a["mask"], a["old"], a["adv"],
                ref_logps=a["ref"], chunk_rows=chunk_rows, backend=backend, check_ids=False,
                **OPTIONS)
        return run

    leaves = ("hidden", "weight")
    want, want_metrics, want_grads = _value_and_grads(framework, call("interpret", 10), x,
                                                      leaves)
    got, metrics, grads = _value_and_grads(framework, call("native", 2048), x, leaves)
    _close(got, want, "loss")
    for name in want_metrics:
        _close(metrics[name], want_metrics[name], name)
    assert not np.asarray(grads[0])[~x["mask"]].any(), "inactive rows' d hidden"
    _close(grads[0], want_grads[0], "d hidden", V)
    _close(grads[1], want_grads[1], "d weight")


#: (what to change, the error's type, what it names); ``("zeros", shape, dtype)`` is an
#: array of the framework.
BAD = [
    (dict(weight=("zeros", (V, H + 1), "float32")), ValueError, "weight"),
    (dict(logits_dtype="bfloat16"), ValueError, "logits_dtype"),
    (dict(fp32_matmul="float64"), ValueError, "fp32_matmul"),
    (dict(weight=("zeros", (V, H), "float64")), (ValueError, TypeError), "weight"),
    (dict(bias=("zeros", (V + 1,), "float32")), ValueError, "bias"),
    (dict(chunk_rows=0), ValueError, "chunk_rows"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
]


@pytest.mark.parametrize("bad, error, match", BAD, ids=[f"{next(iter(b))}-{m}" for b, _, m in BAD])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_errors_name_the_argument(framework, bad, error, match):
    xp = pytest.importorskip("torch" if framework == "torch" else "jax.numpy")
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    as_array = xp.tensor if framework == "torch" else xp.asarray
    a = {k: as_array(v) for k, v in _data(seed=0).items()}
    kw = dict(weight=a["weight"], backend="interpret", chunk_rows=8)
    for name, value in bad.items():
        if isinstance(value, tuple) and framework == "jax" and value[2] == "float64":
            pytest.skip("JAX without x64 has no float64 arrays")
        if isinstance(value, tuple):
            value = xp.zeros(value[1], dtype=getattr(xp, value[2]))
        kw[name] = value
    with pytest.raises(error, match=match):
        loss.linear_policy_loss(a["hidden"], kw.pop("weight"), a["ids"], a["mask"], a["old"],
                                a["adv"], **kw)
