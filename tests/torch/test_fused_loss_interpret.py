"""The fused ``policy_loss`` kernel's PyTorch launch through Triton's CPU interpreter: what
only this binding has. The forward without a gradient allocating none, the opt-in
in-place gradient and per-sequence advantages read as given. The kernel's math, the
route's choice of the fused kernel, the two-pass backward's entropy term and one program
a row against programs meeting, on both bindings: ``tests/test_fused_loss_interpret.py``.
Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl.torch import _launch, loss  # noqa: E402
from fused_loss_cases import (  # noqa: E402
    V, inputs as _inputs, options as _options, torch_call as _torch,
)


def test_forward_without_gradient_skips_the_sweep_and_gives_the_same_bits(monkeypatch):
    case = dict(kl_coef=0.1, ref="logps")
    x = _inputs(23, case)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    args = (t["policy_logits"], None, t["action_ids"], t["mask"], t["old_logps"], t["advantages"])
    kw = dict(ref_logps=t["ref_logps"], kl_coef=0.1, backend="interpret")
    with_grad, _ = loss.policy_loss(args[0].clone().requires_grad_(), *args[1:], **kw)
    shapes = []
    launch = _launch.POLICY_LOSS.run

    def spy(*a, **k):
        outs = launch(*a, **k)
        shapes.append(tuple(outs[2].shape))
        return outs

    monkeypatch.setattr(_launch.POLICY_LOSS, "run", spy)
    with torch.no_grad():
        no_grad, metrics = loss.policy_loss(args[0].clone().requires_grad_(), *args[1:], **kw)
    frozen, _ = loss.policy_loss(args[0], *args[1:], **kw)
    assert shapes == [(0, V), (0, V)]  # no [N, V] gradient allocated or written
    assert no_grad.item() == with_grad.item() == frozen.item()
    assert np.isfinite(metrics["kl_mean"].item())


# --- opt-in in-place gradient -----------------------------------------------------------------


def _inplace_call(x: dict, case: dict, logits: torch.Tensor, **kw):
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items() if k != "policy_logits"}
    return loss.policy_loss(
        logits, None, t["action_ids"], t["mask"], t["old_logps"], t["advantages"],
        ref_logps=t.get("ref_logps"), backend="interpret", **_options(case), **kw)


def test_inplace_grad_writes_the_gradient_into_the_logits_buffer():
    case = dict(kl_coef=0.1, ref="logps", dual_clip=3.0)
    x = _inputs(31, case)
    want_loss, want_metrics, want_grad = _torch(x, case, "interpret", -1.5)
    base = torch.from_numpy(x["policy_logits"]).requires_grad_()
    logits = base * 1.0  # a non-leaf, as the output of an lm head would be
    value, metrics = _inplace_call(x, case, logits, inplace_grad=True)
    assert value.item() == want_loss
    assert {k: v.item() for k, v in metrics.items()} == want_metrics
    (-1.5 * value).backward()
    # The logits' own buffer now holds d loss / d logits (upstream -1.5 included) ...
    assert torch.equal(logits.detach(), want_grad)
    # ... which is what reached the leaf, bit for bit, inactive rows exactly 0.
    assert torch.equal(base.grad, want_grad)
    assert torch.all(base.grad[torch.from_numpy(~x["mask"])] == 0.0)


def test_inplace_grad_fails_loudly_where_the_logits_are_needed_again():
    case = dict(ref="logps", kl_coef=0.1)
    x = _inputs(37, case)
    pre = torch.from_numpy(x["policy_logits"]).requires_grad_()
    logits = torch.tanh(pre)  # tanh's backward needs its output: the logits
    value, _ = _inplace_call(x, case, logits, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()
    value, _ = _inplace_call(x, case, torch.from_numpy(x["policy_logits"]).requires_grad_(),
                             inplace_grad=True)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_grad=True.*once"):
        value.backward()
    with pytest.raises(ValueError, match="contiguous `policy_logits`"):
        strided = torch.from_numpy(x["policy_logits"]).transpose(0, 1).requires_grad_()
        _inplace_call({**x, "action_ids": x["action_ids"].T, "mask": x["mask"].T,
                       "old_logps": x["old_logps"].T, "advantages": x["advantages"].T,
                       "ref_logps": x["ref_logps"].T}, case, strided, inplace_grad=True)


def test_inplace_grad_without_a_gradient_leaves_the_logits_alone():
    case = dict(ref="logps", kl_coef=0.1)
    x = _inputs(41, case)
    logits = torch.from_numpy(x["policy_logits"].copy())
    with torch.no_grad():
        value, _ = _inplace_call(x, case, logits.clone().requires_grad_(), inplace_grad=True)
    frozen, _ = _inplace_call(x, case, logits, inplace_grad=True)
    np.testing.assert_array_equal(logits.numpy(), x["policy_logits"])  # NaN rows included
    assert value.item() == frozen.item()


@pytest.mark.parametrize("lead", [(3, 5), (2, 2, 4)], ids=["rows", "two_leading_axes"])
def test_per_sequence_advantages_reach_the_kernel_as_given(lead, monkeypatch):
    """Advantages given per sequence are read as ``adv[row // T]`` (no ``[N]`` copy): the
    same bits as the same values given per token, gradient included."""
    g = torch.Generator().manual_seed(7)
    vocab = 37
    logits = torch.randn(*lead, vocab, generator=g)
    ids = torch.randint(0, vocab, lead, generator=g)
    mask = torch.rand(lead, generator=g) < 0.8
    old = -torch.rand(lead, generator=g) * 4
    per_sequence = torch.randn(lead[:-1], generator=g)
    seen = []
    launch = _launch.POLICY_LOSS.run
    monkeypatch.setattr(_launch.POLICY_LOSS, "run",
                        lambda binding, *args: seen.append(args[7:9]) or launch(binding, *args))

    def call(advantages):
        x = logits.clone().requires_grad_()
        value, metrics = loss.policy_loss(x, None, ids, mask, old, advantages,
                                          backend="interpret", clip_eps=0.1)
        return [value, *metrics.values(), torch.autograd.grad(value, x)[0]]

    given = call(per_sequence)
    expanded = call(per_sequence[..., None].expand(lead).contiguous())
    for a, b in zip(given, expanded):
        assert torch.equal(a, b)
    (adv, rows), (adv_tokens, one) = seen
    assert rows == lead[-1] and adv.shape == (math.prod(lead[:-1]),)
    assert one == 1 and adv_tokens.shape == (math.prod(lead),)
