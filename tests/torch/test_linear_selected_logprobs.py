"""PyTorch's ``linear_selected_logprobs``: what only its tests check, on the native backend
and through Triton's CPU interpreter. Determinism and chunking, one chunk against
``selected_logprobs`` bit for bit, gradients of some inputs or none, float32 GEMMs
whatever the global precision. Values and gradients against the spec, bf16, garbage on
inactive rows and errors on both frameworks: ``tests/test_linear_selected_logprobs.py``.
Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from linear_cases import B, T, H, V, build, run
from ratiokl.torch import loss

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.skipif(
    pytest.importorskip("importlib").util.find_spec("triton") is None, reason="no triton"))]


def _run(x, backend, dtype="float32", chunk_rows=4, entropy=True):
    """``(logp, entropy | None, d hidden, d weight, d bias | None)`` as NumPy
    (``linear_cases.run``)."""
    return run("torch", x, backend, dtype, chunk_rows, entropy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_and_chunking_leaves_rows_alone(backend):
    """Run to run bitwise; bf16 rows (whose CPU GEMM rows do not depend on the row count)
    bitwise the same in any chunking and in a sub-batch: the row kernels read no other row."""
    x = build("bias-scale", "bfloat16", seed=3)
    first, again = _run(x, backend, "bfloat16"), _run(x, backend, "bfloat16")
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    whole = _run(x, backend, "bfloat16", chunk_rows=B * T)
    assert np.array_equal(whole[0], first[0]) and np.array_equal(whole[1], first[1])
    part = {k: (v[1:] if isinstance(v, np.ndarray) and v.shape[:2] == (B, T) else v)
            for k, v in x.items()}
    sub = _run(part, backend, "bfloat16", chunk_rows=7)
    assert np.array_equal(sub[0], first[0][1:]) and np.array_equal(sub[1], first[1][1:])


def test_one_chunk_is_selected_logprobs_on_the_logits_bit_for_bit():
    """On a Triton backend a row's values are ``selected_logprobs``'s on its logits."""
    pytest.importorskip("triton")
    x = build("bias-scale", seed=4)
    h, w, b = (torch.tensor(x[k]) for k in ("hidden", "weight", "bias"))
    ids, mask = torch.tensor(x["action_ids"]), torch.tensor(x["mask"])
    kept = torch.where(mask[..., None], h, 0.0).reshape(-1, H)
    logits = torch.addmm(b, kept, w.t(), beta=0.5, alpha=0.5).reshape(B, T, V)
    want = loss.selected_logprobs(logits, ids, mask, return_entropy=True, backend="interpret")
    got = loss.linear_selected_logprobs(h, w, ids, mask, bias=b, logit_scale=0.5,
                                        return_entropy=True, chunk_rows=B * T,
                                        backend="interpret")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_of_some_inputs_and_no_gradient(backend):
    x = build("bias-scale", seed=5)
    full = _run(x, backend, entropy=False)
    h = torch.tensor(x["hidden"]).requires_grad_()
    args = (torch.tensor(x["weight"]), torch.tensor(x["action_ids"]), torch.tensor(x["mask"]))
    kw = dict(bias=torch.tensor(x["bias"]), logit_scale=0.5, chunk_rows=4, backend=backend)
    logp = loss.linear_selected_logprobs(h, *args, **kw)
    (logp * torch.tensor(x["g_logp"])).sum().backward()
    assert np.array_equal(logp.detach().numpy(), full[0])
    assert np.array_equal(h.grad.numpy(), full[2])
    with torch.no_grad():
        logp = loss.linear_selected_logprobs(h, *args, **kw)
        _, ent = loss.linear_selected_logprobs(h, *args, return_entropy=True, **kw)
    assert np.array_equal(logp.numpy(), full[0])
    assert not logp.requires_grad and not ent.requires_grad


class _MatmulPrecision(TorchDispatchMode):
    """Records the float32 matmul precision in effect at every matmul the call makes,
    backward included: the global setting and (torch >= 2.9) the CUDA and oneDNN ones."""

    OPS = {"mm", "addmm", "bmm", "matmul"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__.rstrip("_") in self.OPS:
            backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
            self.seen.append((torch.get_float32_matmul_precision(),) + tuple(
                getattr(b, "fp32_precision", "ieee") for b in backends))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["linear_selected_logprobs", "linear_policy_loss"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_gemms_whatever_the_global_precision(op, backend):
    """Under ``torch.set_float32_matmul_precision("medium")`` (TF32 on CUDA, bf16 on oneDNN)
    every GEMM of the op, backward included, runs at "highest"; the setting is restored."""
    x = build("bias-scale", seed=7)
    h = torch.tensor(x["hidden"]).requires_grad_()
    w = torch.tensor(x["weight"]).requires_grad_()
    ids, mask = torch.tensor(x["action_ids"]), torch.tensor(x["mask"])
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        with _MatmulPrecision() as mode:
            if op == "linear_selected_logprobs":
                value = loss.linear_selected_logprobs(h, w, ids, mask, bias=torch.tensor(
                    x["bias"]), chunk_rows=4, backend=backend).sum()
            else:
                value, _ = loss.linear_policy_loss(h, w, ids, mask, None, torch.ones(B),
                                                   logit_scale=0.5, chunk_rows=4,
                                                   backend=backend)
            value.backward()
        assert len(mode.seen) >= 3 and set(mode.seen) == {("highest", "ieee", "ieee")}, \
            mode.seen
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(saved)
