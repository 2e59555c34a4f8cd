"""PyTorch's Triton binding through Triton's CPU interpreter, the behaviours only it has:
strided logits read without a copy, and the public op under ``torch.compile``. The
kernels' math on both bindings: ``tests/test_triton_interpret.py``. Sizes are small: the
interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl import spec  # noqa: E402
from ratiokl.torch import _triton  # noqa: E402
from assertions import assert_close  # noqa: E402
from ratio_kl_cases import DTYPES, Case  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_selected_logprobs_strided_logits(dtype):
    rng = np.random.default_rng(2)
    base = torch.tensor(rng.normal(size=(70, 12)) * 4, dtype=torch.float32).to(DTYPES[dtype])
    leaf = base.t()[::2].detach().requires_grad_(True)  # [6, 70], strides (2, 12): no copy
    assert leaf.stride() == (2, 12)
    ids = torch.tensor(rng.integers(0, 70, 6))
    mask = torch.tensor([True, True, False, True, True, True])
    g = torch.tensor(rng.normal(size=6), dtype=torch.float32)
    logp = _triton.selected_logprobs(leaf, ids, mask, 0.8)
    (logp * g).sum().backward()
    x = leaf.detach().float().numpy().astype(np.float64)
    e_logp = spec.selected_logprobs(x, ids.numpy(), mask.numpy(), temperature=0.8)
    e_grad = spec.selected_logprobs_grad(x, ids.numpy(), mask.numpy(), g.numpy(), temperature=0.8)
    scale = np.abs(x).max() / 0.8
    assert_close(logp.detach().numpy(), e_logp, spec.forward_tolerance(scale), "logp")
    assert_close(leaf.grad.float().numpy(), e_grad,
                  spec.grad_tolerance(dtype, scale, np.abs(e_grad).max()), "grad")


def test_through_public_loss_and_torch_compile():
    from ratiokl.torch import loss

    case = Case(6, 33, "float32", seed=12)
    policy = case.policy.reshape(2, 3, 33)
    args = (policy, case.ref.reshape(2, 3, 33), case.ids.reshape(2, 3), case.mask.reshape(2, 3),
            case.old.reshape(2, 3))
    eager = loss.ratio_kl(*args, backend="interpret")
    compiled = torch.compile(
        lambda *a: loss.ratio_kl(*a, backend="interpret", check_ids=False),
        backend="aot_eager", fullgraph=True,
    )(*args)
    e_ratio, _, _ = case.expected(True, 3)
    assert_close(eager[0].reshape(-1).numpy(), e_ratio, spec.forward_tolerance(case.scale()), "ratio")
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
