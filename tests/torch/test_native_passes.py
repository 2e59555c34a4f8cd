"""The native backend's work per logit, counted by op (not timed): one exponential per logit
for the normaliser and the entropy together, and no element-by-element select over
``[N, V]`` (``torch.where`` / ``masked_fill`` with a per-row condition run as slowly as an
``exp`` on the CPU). Issue 47, item 13: the entropy of ``metrics["entropy_mean"]`` was a
second pass with its own exponentials."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ratiokl.torch import loss

N, V = 6, 40
_EXP = {"exp", "exp_"}
_SELECT = {"where", "masked_fill", "masked_fill_"}


class _Elements(TorchDispatchMode):
    """Elements each aten op (by base name) wrote, over tensors with ``V`` columns."""

    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == V:
            self.count[name] += out.numel()
        return out


def _inputs():
    torch.manual_seed(0)
    logits = torch.randn(N, V, requires_grad=True)
    ids = torch.randint(0, V, (N,))
    mask = torch.tensor([True, False, True, True, False, True])
    return logits, ids, mask


def _counts(fn) -> collections.Counter:
    mode = _Elements()
    with mode:
        fn()
    return mode.count


@pytest.mark.parametrize("entropy", [False, True])
def test_forward_one_exp_per_logit_no_select(entropy):
    logits, ids, mask = _inputs()
    count = _counts(lambda: loss.selected_logprobs(logits, ids, mask, return_entropy=entropy,
                                                   backend="native"))
    assert sum(count[k] for k in _EXP) == N * V
    assert sum(count[k] for k in _SELECT) == 0


def test_policy_loss_one_exp_per_logit_each_way():
    """The loss's forward (its entropy metric included) and its backward: one exponential per
    logit each, and no per-element select."""
    logits, ids, mask = _inputs()
    old, adv = torch.full((N,), -3.0), torch.randn(N)
    ref_logps = torch.full((N,), -3.5)

    def step():
        value, metrics = loss.policy_loss(logits, None, ids, mask, old, adv,
                                          ref_logps=ref_logps, kl_coef=0.1, backend="native")
        assert torch.isfinite(metrics["entropy_mean"])
        value.backward()

    count = _counts(step)
    assert sum(count[k] for k in _EXP) == 2 * N * V
    assert sum(count[k] for k in _SELECT) == 0
    assert torch.equal(logits.grad[~mask], torch.zeros(int((~mask).sum()), V))
