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

import numpy as np
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


def _tolerance(name: str, scale: float, want, paths: bool = False, grad: str = "float32"):
    """The spec's float32 tolerance of one output of the ops from hidden states (the largest
    ``|want|`` standing for a gradient's yardstick); ``paths``: two float32 results. float32
    GEMMs stay within it; TF32's (10 mantissa bits, about 1e-3 of the largest entry) do not.
    """
    if name in ("logp", "entropy"):
        tol = spec.linear_forward_tolerance("float32", scale, V, entropy=name == "entropy")
    else:
        tol = spec.linear_grad_tolerance(grad, scale, float(want.abs().max()))
    return two_paths(tol) if paths else tol


#: fp32_matmul -> the gradient's rounding (ratiokl.spec.GRAD_ROUNDOFF): float32 GEMMs, or
#: two bfloat16 pieces a side (the logits keep float32's precision either way).
FP32_MATMUL = {"ieee": "float32", "bf16x3": "bf16x2"}


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


def _torch_op(hidden, weight, bias, ids, mask, cot, fp32_matmul="ieee"):
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    logp, ent = loss.linear_selected_logprobs(h, w, ids, mask, bias=b, return_entropy=True,
                                              chunk_rows=384, fp32_matmul=fp32_matmul)
    ((logp * cot[0]).sum() + (ent * cot[1]).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad, b.grad


def _jax_op(hidden, weight, bias, ids, mask, cot, backend, fp32_matmul="ieee"):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    arrays = [jnp.asarray(t.cpu().numpy()) for t in (hidden, weight, bias, ids, mask, cot)]

    def objective(h, w, b, ids, mask, cot):
        logp, ent = jax_loss.linear_selected_logprobs(h, w, ids, mask, bias=b,
                                                      return_entropy=True, chunk_rows=384,
                                                      backend=backend, check_ids=False,
                                                      fp32_matmul=fp32_matmul)
        return jnp.sum(logp * cot[0]) + jnp.sum(ent * cot[1]), (logp, ent)

    (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2),
                                                         has_aux=True))(*arrays)
    return (logp, ent) + tuple(grads)


def _jax_backends():
    from ratiokl.jax._route import _jax_triton_error

    return ["native"] + ([] if _jax_triton_error() else ["triton"])


@pytest.mark.usefixtures("tf32_allowed")
@pytest.mark.parametrize("fp32_matmul", sorted(FP32_MATMUL))
def test_float32_linear_selected_logprobs_matches_float64_in_both_frameworks(fp32_matmul):
    pytest.importorskip("jax")
    data = _data()
    want = _reference(*data)
    results = {"torch": _torch_op(*data, fp32_matmul=fp32_matmul)}
    for backend in _jax_backends():
        results[f"jax-{backend}"] = _jax_op(*data, backend, fp32_matmul=fp32_matmul)
    scale = _logit_scale(*data[:3], data[4])
    grad = FP32_MATMUL[fp32_matmul]
    for target, got in results.items():
        for name, a, e in zip(NAMES, got, want):
            assert_close(a, e, _tolerance(name, scale, e, grad=grad), f"{target}: {name}")
        for name, a, e in zip(NAMES, got, results["torch"]):
            tol = _tolerance(name, scale, e, paths=True, grad=grad)
            assert_close(a, e, tol, f"{target} vs torch: {name}")


@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float32"])
def test_bf16_hidden_gives_fp32_head_log_probs_in_both_frameworks(weight_dtype):
    """bf16 hidden states, logits of std 8 (max about 45), half the targets the argmax: the
    default (float32 logits; a float32 weight through the split products) is within the
    float32 forward's tolerance of float64 on the inputs' own values (the GEMM's float32
    accumulation over H = 1024), in both frameworks; ``logits_dtype="input"`` (a bf16
    head) is off by far more."""
    g = torch.Generator(device="cuda").manual_seed(5)
    n, h_, v = 512, 1024, 32_000
    hidden = torch.randn(n, h_, generator=g, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h_, generator=g, device="cuda") * (8.0 / h_ ** 0.5)).to(
        getattr(torch, weight_dtype))
    z = hidden.double() @ weight.double().T
    ids = torch.where(torch.rand(n, generator=g, device="cuda") < 0.5, z.argmax(-1),
                      torch.randint(0, v, (n,), generator=g, device="cuda"))
    lp_all = torch.log_softmax(z, -1)
    want = (lp_all.gather(1, ids[:, None])[:, 0], -(lp_all.exp() * lp_all).sum(-1))
    got = {"torch": loss.linear_selected_logprobs(hidden, weight, ids, return_entropy=True)}
    bf16_head = loss.linear_selected_logprobs(hidden, weight, ids, return_entropy=True,
                                              logits_dtype="input")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    h_j = jnp.asarray(hidden.float().cpu().numpy()).astype(jnp.bfloat16)
    w_j = jnp.asarray(weight.float().cpu().numpy()).astype(weight_dtype)
    for backend in _jax_backends():
        got[f"jax-{backend}"] = jax.jit(lambda h, w: jax_loss.linear_selected_logprobs(
            h, w, jnp.asarray(ids.cpu().numpy()), return_entropy=True, backend=backend))(h_j,
                                                                                          w_j)
    scale = float(z.abs().max())
    for target, (logp, ent) in got.items():
        for name, a, e in (("logp", logp, want[0]), ("entropy", ent, want[1])):
            a = a.double() if isinstance(a, torch.Tensor) else torch.as_tensor(
                np.asarray(a, dtype=np.float64), device="cuda")
            tol = spec.linear_forward_tolerance("float32", scale, v, entropy=name == "entropy")
            assert_close(a, e, tol, f"{target} {name}")
    if weight_dtype == "bfloat16":
        assert float((bf16_head[0].double() - want[0]).abs().max()) > 100 * spec. \
            linear_forward_tolerance("float32", scale, v).atol


@pytest.mark.usefixtures("tf32_allowed")
def test_float32_linear_policy_loss_hidden_gradient_matches_float64_in_both_frameworks():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    hidden, weight, bias, ids, mask, _ = _data(seed=1)
    g = torch.Generator(device="cuda").manual_seed(2)
    old = torch.randn(N, generator=g, device="cuda") * 0.1 - 10.0
    adv = torch.randn(N, generator=g, device="cuda")
    kw = dict(logit_scale=0.5, logit_softcap=20.0, fp32_matmul="ieee")
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
