"""The cached eager launch on the GPU: the same bits as Triton's own path, no binder after the
first launch of a specialisation, and a new specialisation where Triton would make one."""

from __future__ import annotations

import pytest
import torch

from assertions import assert_close, assert_identical

from ratiokl import spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _inputs(dtype, offset=0, n=96, v=5000, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    big = torch.randn(n, v + offset, generator=g, device="cuda").to(dtype)
    policy = big[:, offset:]  # offset 1: a base address off 16-byte alignment
    ids = torch.randint(0, v, (n,), generator=g, device="cuda")
    mask = torch.rand(n, generator=g, device="cuda") < 0.8
    old = -torch.rand(n, generator=g, device="cuda") * 5
    adv = torch.randn(n, generator=g, device="cuda")
    return policy, ids, mask, old, adv


def _step(policy, ids, mask, old, adv):
    from ratiokl.torch.loss import policy_loss, ratio_kl, selected_logprobs

    x = policy.detach().requires_grad_()
    loss, metrics = policy_loss(x, None, ids, mask, old, adv, check_ids=False)
    (grad,) = torch.autograd.grad(loss * 0.5, x)  # upstream 0.5: the scale kernel runs
    with torch.no_grad():
        logp = selected_logprobs(policy, ids, mask, check_ids=False)
        ratio, _ = ratio_kl(policy, None, ids, mask, old, ref_logps=logp, check_ids=False)
    return [loss, grad, logp, ratio, *metrics.values()]


def _triton_path(monkeypatch):
    from ratiokl.torch import _launch

    monkeypatch.setattr(_launch.op, "_raw", lambda kernel: kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_cached_launches_give_tritons_bits(dtype, offset, monkeypatch):
    inputs = _inputs(dtype, offset)
    cold = _step(*inputs)
    warm = _step(*inputs)
    with monkeypatch.context() as m:
        _triton_path(m)
        reference = _step(*inputs)
    for a, b, c in zip(cold, warm, reference):
        assert_identical(a, c, "cold launch")
        assert_identical(b, c, "warm launch")


def test_vocabularies_of_the_same_facts_are_two_kernels(monkeypatch):
    """V = 127 then 126 (neither 1 nor a multiple of 16) in one process: the fused kernel's
    ``V`` is compiled in, so the second must not run the first one's handle."""
    from ratiokl.torch.loss import policy_loss

    for v in (127, 126, 100):
        policy, ids, mask, old, adv = _inputs(torch.float32, n=7, v=v, seed=v)
        got, _ = policy_loss(policy, None, ids, mask, old, adv, check_ids=False)
        want, _ = policy_loss(policy, None, ids, mask, old, adv, check_ids=False,
                              backend="native")
        assert_close(got, want, spec.paths_tolerance(v), "loss")


def test_warm_launches_skip_the_binder(monkeypatch):
    import triton

    inputs = _inputs(torch.float16)
    _step(*inputs)
    calls = []
    run = triton.runtime.jit.JITFunction.run
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run",
                        lambda self, *a, **k: calls.append(self) or run(self, *a, **k))
    _step(*_inputs(torch.float16, seed=1))  # new values, same specialisation
    assert calls == []
    _step(*_inputs(torch.float16, offset=1))  # a misaligned base: Triton specialises anew
    assert calls, "a new specialisation must go through Triton"
