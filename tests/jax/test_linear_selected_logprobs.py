"""JAX ``linear_selected_logprobs`` (native and through Triton's CPU interpreter), and the
logit options and GEMM precision of both JAX ops from hidden states: what only JAX's tests
check. Rows independent of the batch, ``vmap``, PyTorch's op on the same arrays, every
``dot_general`` at ``Precision.HIGHEST``, the entropy returned undifferentiated, errors.
Values and gradients against the spec, bf16 and garbage on inactive rows on both
frameworks: ``tests/test_linear_selected_logprobs.py``. Sizes are small: the interpreter is
slow.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from linear_cases import B, T, V, build, expected, options, run  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

BACKENDS = ["native", "interpret"]
ARRAYS = ("hidden", "weight", "bias", "temperature")


def _grads(x, backend, dtype="float32", chunk_rows=4, entropy=True):
    """``(logp, entropy | None, d hidden, d weight, d bias | None)``, jitted, as NumPy
    (``linear_cases.run``)."""
    return run("jax", x, backend, dtype, chunk_rows, entropy)


def test_rows_do_not_depend_on_the_batch_on_interpret():
    """bf16 (whose CPU GEMM rows do not depend on the row count): a sub-batch and another
    chunking give the same rows bit for bit."""
    x = build("bias-scale", "bfloat16", seed=3)
    first = _grads(x, "interpret", "bfloat16")
    part = {k: (v[1:] if isinstance(v, np.ndarray) and v.shape[:2] == (B, T) else v)
            for k, v in x.items()}
    sub = _grads(part, "interpret", "bfloat16", chunk_rows=7)
    assert np.array_equal(np.asarray(sub[0]), np.asarray(first[0])[1:])
    assert np.array_equal(np.asarray(sub[1]), np.asarray(first[1])[1:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_maps_over_a_batch_of_hidden_states(backend):
    x = build("bias-scale", seed=4)
    ids, mask = jnp.asarray(x["action_ids"]), jnp.asarray(x["mask"])
    weight, bias = jnp.asarray(x["weight"]), jnp.asarray(x["bias"])
    stacked = jnp.stack([jnp.asarray(x["hidden"]), jnp.asarray(x["hidden"][::-1])])

    def one(h):
        return loss.linear_selected_logprobs(h, weight, ids, mask, bias=bias, logit_scale=0.5,
                                             return_entropy=True, chunk_rows=4,
                                             backend=backend, check_ids=False)

    mapped = jax.jit(jax.vmap(one))(stacked)
    for i in range(2):
        single = one(stacked[i])
        for what, got, want in zip(("logp", "entropy"), mapped, single):
            tol = spec.paths_tolerance(V, float(jnp.max(jnp.abs(want))))  # sums over V
            assert_close(got[i], want, tol, what)


@pytest.mark.parametrize("backend", BACKENDS)
def test_agrees_with_pytorch(backend):
    torch = pytest.importorskip("torch")
    from ratiokl.torch import loss as torch_loss

    x = build("softcap-temperature-masked", seed=5)
    got = _grads(x, backend)
    t = {k: torch.tensor(x[k]).requires_grad_(k != "temperature") for k in ARRAYS if k in x}
    logp, ent = torch_loss.linear_selected_logprobs(
        t["hidden"], t["weight"], torch.tensor(x["action_ids"]), torch.tensor(x["mask"]),
        bias=t["bias"], temperature=t["temperature"], return_entropy=True, chunk_rows=4,
        backend=backend, **options(x))
    ((logp * torch.tensor(x["g_logp"])).sum() + (ent * torch.tensor(x["g_entropy"])).sum()
     ).backward()
    want = expected(x)
    for name, a, b in (("logp", got[0], logp), ("entropy", got[1], ent),
                       ("d_hidden", got[2], t["hidden"].grad),
                       ("d_weight", got[3], t["weight"].grad),
                       ("d_bias", got[4], t["bias"].grad)):
        assert_close(a, b.detach().numpy(), want[f"tol_{name}"], name)
    assert not np.asarray(got[2])[~x["mask"]].any() and not t["hidden"].grad[
        torch.tensor(~x["mask"])].any()


def _dot_precisions(jaxpr) -> list:
    """The ``precision`` of every ``dot_general`` in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                if hasattr(sub, "eqns"):
                    found.extend(_dot_precisions(sub))
    return found


@pytest.mark.parametrize("op", ["linear_selected_logprobs", "linear_policy_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_gemm_runs_at_highest_precision(op, backend):
    """Forward and backward: no ``dot_general`` is left to JAX's default precision (TF32-class
    on GPUs), so float32 inputs get float32 GEMMs as in PyTorch."""
    x = build("bias-scale", seed=6)
    ids, mask = jnp.asarray(x["action_ids"]), jnp.asarray(x["mask"])

    def objective(h, w, b):
        if op == "linear_selected_logprobs":
            return jnp.sum(loss.linear_selected_logprobs(h, w, ids, mask, bias=b, chunk_rows=4,
                                                         backend=backend, check_ids=False))
        return loss.linear_policy_loss(h, w, ids, mask, None, jnp.ones(B), bias=b,
                                       chunk_rows=4, backend=backend, check_ids=False)[0]

    jaxpr = jax.make_jaxpr(jax.grad(objective, argnums=(0, 1, 2)))(
        *(jnp.asarray(x[k]) for k in ("hidden", "weight", "bias")))
    precisions = _dot_precisions(jaxpr.jaxpr)
    highest = jax.lax.Precision.HIGHEST
    assert len(precisions) >= 3
    assert all(p == (highest, highest) for p in precisions), precisions


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_logp_differentiated_with_the_entropy_returned(backend):
    """``return_entropy=True`` with only ``logp`` differentiated (the entropy's cotangent a
    symbolic zero, whose term the backward drops): the gradient of ``sum(g logp)``."""
    x = build("bias-scale", seed=7)
    args = (jnp.asarray(x["action_ids"]), jnp.asarray(x["mask"]))
    kw = dict(bias=jnp.asarray(x["bias"]), logit_scale=0.5, chunk_rows=4, backend=backend,
              check_ids=False)

    def objective(h, entropy):
        out = loss.linear_selected_logprobs(h, jnp.asarray(x["weight"]), *args,
                                            return_entropy=entropy, **kw)
        return jnp.sum((out[0] if entropy else out) * jnp.asarray(x["g_logp"]))

    h = jnp.asarray(x["hidden"])
    with_entropy = jax.grad(objective)(h, True)
    without = jax.grad(objective)(h, False)
    want = expected(x, entropy=False)
    assert_close(with_entropy, want["d_hidden"], want["tol_d_hidden"], "d hidden")
    assert_close(without, want["d_hidden"], want["tol_d_hidden"], "d hidden")
