"""The two ops from hidden states on a CUDA GPU, in float32, against float64 and each other.

Run on the H200 with ``pytest -m gpu tests/gpu/test_linear_selected_logprobs_gpu.py``;
skipped without CUDA (the JAX side also without jax-triton). With TF32 allowed in PyTorch
(``allow_tf32=True``) and JAX's default matmul precision (TF32-class on GPUs), both
frameworks' ``linear_selected_logprobs`` (``logp``, entropy, ``d hidden``, ``d weight``,
``d bias``) and ``linear_policy_loss`` (``d hidden``) must be within float32 error of a
float64 reference (TF32 GEMMs were three orders of magnitude off: 8.4e-4) and of each
other.
"""

from __future__ import annotations

import os

import pytest
import torch

from assertions import assert_close, two_paths

from ratiokl import spec
from ratiokl.torch import loss

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N, H, V = 1024, 2048, 32_768
NAMES = ("logp", "entropy", "d hidden", "d weight", "d bias")


def _data(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, device="cuda")
    weight = torch.randn(V, H, generator=g, device="cuda") / H ** 0.5 * 3.0
    bias = torch.randn(V, generator=g, device="cuda")
    ids = torch.randint(0, V, (N,), generator=g, device="cuda")
    mask = torch.rand(N, generator=g, device="cuda") > 0.2
    cot = torch.randn(2, N, generator=g, device="cuda")
    return hidden, weight, bias, ids, mask, cot


def _tolerance(name: str, scale: float, want, paths: bool = False):
    """The spec's float32 tolerance of one output of the ops from hidden states (the largest
    ``|want|`` standing for a gradient's yardstick); ``paths``: two float32 results. float32
    GEMMs stay within it; TF32's (10 mantissa bits, about 1e-3 of the largest entry) do not.
    """
    if name in ("logp", "entropy"):
        tol = spec.linear_forward_tolerance("float32", scale, V, entropy=name == "entropy")
    else:
        tol = spec.linear_grad_tolerance("float32", scale, float(want.abs().max()))
    return two_paths(tol) if paths else tol


def _logit_scale(hidden, weight, bias, mask) -> float:
    return float((torch.where(mask[:, None], hidden, 0.0) @ weight.t() + bias).abs().max())


@pytest.fixture
def tf32_allowed():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def _reference(hidden, weight, bias, ids, mask, cot):
    """float64 ``(logp, entropy, d hidden, d weight, d bias)`` through the materialised
    logits (autograd)."""
    h, w, b = (t.double().requires_grad_() for t in (hidden, weight, bias))
    x = torch.where(mask[:, None], h, 0.0) @ w.t() + b
    logp_all = torch.log_softmax(x, dim=-1)
    logp = torch.where(mask, logp_all.gather(1, ids[:, None])[:, 0], 0.0)
    ent = torch.where(mask, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    ((logp * cot[0]).sum() + (ent * cot[1]).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, b.grad


def _torch_op(hidden, weight, bias, ids, mask, cot):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, ent = loss.linear_selected_logprobs(h, w, ids, mask, bias=b, return_entropy=True,
                                              chunk_rows=384)
    ((logp * cot[0]).sum() + (ent * cot[1]).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, b.grad


def _jax_op(hidden, weight, bias, ids, mask, cot, backend):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    arrays = [jnp.asarray(t.cpu().numpy()) for t in (hidden, weight, bias, ids, mask, cot)]

    def objective(h, w, b, ids, mask, cot):
        logp, ent = jax_loss.linear_selected_logprobs(h, w, ids, mask, bias=b,
                                                      return_entropy=True, chunk_rows=384,
                                                      backend=backend, check_ids=False)
        return jnp.sum(logp * cot[0]) + jnp.sum(ent * cot[1]), (logp, ent)

    (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2),
                                                         has_aux=True))(*arrays)
    return (logp, ent) + tuple(grads)


def _jax_backends():
    from ratiokl.jax._route import _jax_triton_error

    return ["native"] + ([] if _jax_triton_error() else ["triton"])


@pytest.mark.usefixtures("tf32_allowed")
def test_float32_linear_selected_logprobs_matches_float64_in_both_frameworks():
    pytest.importorskip("jax")
    data = _data()
    want = _reference(*data)
    results = {"torch": _torch_op(*data)}
    for backend in _jax_backends():
        results[f"jax-{backend}"] = _jax_op(*data, backend)
    scale = _logit_scale(*data[:3], data[4])
    for target, got in results.items():
        for name, a, e in zip(NAMES, got, want):
            assert_close(a, e, _tolerance(name, scale, e), f"{target}: {name}")
        for name, a, e in zip(NAMES, got, results["torch"]):
            tol = _tolerance(name, scale, e, paths=True)
            assert_close(a, e, tol, f"{target} vs torch: {name}")


@pytest.mark.usefixtures("tf32_allowed")
def test_float32_linear_policy_loss_hidden_gradient_matches_float64_in_both_frameworks():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    hidden, weight, bias, ids, mask, _ = _data(seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    old = torch.randn(N, generator=g, device="cuda") * 0.1 - 10.0
    adv = torch.randn(N, generator=g, device="cuda")
    kw = dict(logit_scale=0.5, logit_softcap=20.0)
    h64 = hidden.double().requires_grad_()
    x = torch.where(mask[:, None], h64, 0.0) @ weight.double().t() + bias.double()
    x = 20.0 * torch.tanh(x * 0.5 / 20.0)
    # d hidden in float64 but for the loss kernel's d loss / d x (float32 logits).
    xf = x.float().detach().requires_grad_()
    value, _ = loss.policy_loss(xf, None, ids, mask, old, adv)
    value.backward()
    x.backward(xf.grad.double())
    want_dh = h64.grad
    h = hidden.clone().requires_grad_()
    value, _ = loss.linear_policy_loss(h, weight, ids, mask, old, adv, bias=bias, **kw)
    value.backward()
    tol = _tolerance("d hidden", float(x.detach().abs().max()), want_dh)
    assert_close(h.grad, want_dh, tol, "d hidden")
    arrays = [jnp.asarray(t.cpu().numpy()) for t in (hidden, weight, bias, ids, mask, old, adv)]
    for backend in _jax_backends():
        def objective(h, w, b, ids, mask, old, adv):
            return jax_loss.linear_policy_loss(h, w, ids, mask, old, adv, bias=b,
                                               backend=backend, check_ids=False, **kw)[0]

        dh = jax.jit(jax.grad(objective))(*arrays)
        assert_close(dh, want_dh, tol, f"jax-{backend}: d hidden")
        assert_close(dh, h.grad, two_paths(tol), f"jax-{backend} vs torch: d hidden")
