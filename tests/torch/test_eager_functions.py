"""The eager binding of every ``KernelOp`` against its ``"interpret"`` custom op.

On CUDA, outside ``torch.compile``, ``ratiokl.torch._launch.KernelOp`` runs
a launch through a generated ``autograd.Function`` (or directly) instead of
the custom-op dispatcher, with the same launch code and autograd formula.
Here the eager binding launches the interpreter twins of the kernels
(``_raw`` swapped for ``ratiokl._kernels.interpreted``) on CPU tensors and
must agree bitwise with the ``"interpret"`` custom op, forward and
gradient, and refuse a second backward through the in-place scaled gradient
as the mutating op does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ratiokl._kernels import interpreted  # noqa: E402
from ratiokl.torch import _launch  # noqa: E402

N, V = 7, 45

#: Inactive rows hold data the kernels never use; the interpreter's numpy warns on it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(autouse=True)
def _interpreted_launches(monkeypatch):
    monkeypatch.setattr(_launch.op, "_raw", interpreted)


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    policy = torch.randn(N, V, generator=g) * 2.0
    return dict(
        policy=policy, ref=torch.randn(N, V, generator=g), ids=torch.randint(0, V, (N,), generator=g),
        mask=torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.bool),
        old=torch.randn(N, generator=g) * 0.1 - 3.8, adv=torch.randn(N, generator=g),
        temp=torch.full((1,), 0.9),
    )


def _grad_of(fn, policy: torch.Tensor, upstream: torch.Tensor):
    leaf = policy.clone().requires_grad_(True)
    outs = fn(leaf)
    (grad,) = torch.autograd.grad(outs[0], leaf, grad_outputs=upstream)
    return [o.detach() for o in outs], grad


@pytest.mark.parametrize("kl_code", [0, 1, 3])
def test_eager_forward_matches_the_interpret_op(kl_code: int) -> None:
    x = _rows()
    args = lambda p: (p, x["ref"], x["ids"], x["mask"], x["old"], None, x["temp"], kl_code)  # noqa: E731
    upstream = torch.linspace(-1.0, 2.0, N)
    eager, g_eager = _grad_of(lambda p: _launch.FORWARD.run("eager", *args(p))[1:3],
                              x["policy"], upstream)
    op, g_op = _grad_of(lambda p: _launch.FORWARD.run("interpret", *args(p))[1:3], x["policy"],
                        upstream)
    for a, b in zip(eager + [g_eager], op + [g_op]):
        assert torch.equal(a, b)
    assert g_eager[~x["mask"]].abs().max() == 0
    assert g_eager[x["mask"]].abs().max() > 0


def _fused_args(x, p):
    w = torch.where(x["mask"], 1.0 / x["mask"].sum(), 0.0)
    coefs = torch.tensor([0.1, 0.8, 1.2, float("inf"), 0.05])  # entropy_coef 0.05
    return (p, None, x["ids"], x["mask"], x["old"], x["old"] + 0.05, x["temp"], x["adv"], 1,
            None, w, coefs, True, 3, False, 20.0, 0, True, False, None)


@pytest.mark.parametrize("scale", [1.0, -2.5])
def test_eager_fused_matches_the_interpret_op(scale: float) -> None:
    x = _rows(1)
    upstream = torch.tensor(scale)
    eager, g_eager = _grad_of(lambda p: _launch.POLICY_LOSS.run("eager", *_fused_args(x, p))[:2],
                              x["policy"], upstream)
    op, g_op = _grad_of(lambda p: _launch.POLICY_LOSS.run("interpret", *_fused_args(x, p))[:2],
                        x["policy"], upstream)
    for a, b in zip(eager + [g_eager], op + [g_op]):
        assert torch.equal(a, b)
    assert g_eager[~x["mask"]].abs().max() == 0
    assert g_eager[x["mask"]].abs().max() > 0


def test_eager_fused_second_backward_fails_loudly() -> None:
    x = _rows(2)
    leaf = x["policy"].clone().requires_grad_(True)
    loss = _launch.POLICY_LOSS.run("eager", *_fused_args(x, leaf))[0]
    (2.0 * loss).backward(retain_graph=True)
    grad = leaf.grad.clone()
    with pytest.raises(RuntimeError, match="policy_loss backpropagates once.*retain_graph"):
        loss.backward()
    assert torch.equal(leaf.grad, grad)  # refused before the stored gradient was scaled


def test_eager_without_a_gradient_skips_the_autograd_function(monkeypatch) -> None:
    """No grad mode, or logits that need none: the launch itself (no ``Function.apply``),
    the same values; with a gradient to take, the Function (and its gradient)."""
    x = _rows()
    args = lambda p: (p, x["ref"], x["ids"], x["mask"], x["old"], None, x["temp"], 3)  # noqa: E731
    applied = []
    function = _launch.FORWARD._eager
    monkeypatch.setattr(_launch.FORWARD, "_eager",
                        lambda *a: applied.append(1) or function(*a))
    with_grad = x["policy"].clone().requires_grad_(True)
    reference = _launch.FORWARD.run("eager", *args(with_grad))
    assert applied and reference[1].requires_grad
    applied.clear()
    with torch.no_grad():
        under_no_grad = _launch.FORWARD.run("eager", *args(with_grad))
    plain = _launch.FORWARD.run("eager", *args(x["policy"]))
    assert not applied
    for got in (under_no_grad, plain):
        assert not got[1].requires_grad
        for a, b in zip(got, reference):
            b = b.detach()  # bit for bit, NaN where NaN
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
