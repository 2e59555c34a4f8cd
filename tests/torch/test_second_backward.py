"""A second backward through the same graph (``retain_graph=True``), op by op, on every backend.

One behaviour per op, whatever the backend or the route: ``policy_loss`` and
``linear_policy_loss`` backpropagate once (the Triton backends compute the gradient in the
forward and scale it in place), so a second backward raises a ``RuntimeError`` naming
``retain_graph`` and the fix, before it touches anything (the first gradient stays as it
was, and a new call backpropagates again); ``selected_logprobs`` and ``ratio_kl`` recompute
their gradient from the saved logits, so a second backward adds the same gradient again.
"""

from __future__ import annotations

import pytest
import torch

from ratiokl.torch import loss

B, T, H, V = 2, 5, 6, 23

BACKENDS = [
    "native",
    pytest.param("interpret", marks=pytest.mark.filterwarnings("ignore::RuntimeWarning")),
    pytest.param("triton", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="backend='triton' needs a CUDA GPU")]),
]


def _inputs(backend: str, seed: int = 0) -> dict:
    if backend != "native":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[0, 0] = True
    x = dict(logits=2 * torch.randn(B, T, V, generator=g),
             hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g),
             ids=torch.randint(0, V, (B, T), generator=g), mask=mask,
             old=torch.randn(B, T, generator=g) - 3.0, ref=torch.randn(B, T, generator=g) - 3.0,
             adv=torch.randn(B, T, generator=g))
    device = "cuda" if backend == "triton" else "cpu"
    return {k: v.to(device) for k, v in x.items()}


def _policy(x, backend, **options):
    return lambda p: loss.policy_loss(p["logits"], None, x["ids"], x["mask"], x["old"], x["adv"],
                                      ref_logps=x["ref"], kl_coef=0.1, backend=backend,
                                      **options)[0]


def _linear(x, backend):
    return lambda p: loss.linear_policy_loss(p["hidden"], p["weight"], x["ids"], x["mask"],
                                             x["old"], x["adv"], chunk_rows=4,
                                             backend=backend)[0]


#: The losses that backpropagate once: name -> (op named in the error, the call of the
#: leaves); every route: the one-kernel loss (Triton backends), its entropy bonus, the
#: two-pass route (GSPO's sequence ratio; every policy_loss on "native"), the chunks.
ONCE = {
    "policy_loss": ("policy_loss", lambda x, b: _policy(x, b)),
    "policy_loss_entropy_bonus": ("policy_loss",
                                  lambda x, b: _policy(x, b, entropy_coef=0.05)),
    "policy_loss_gspo": ("policy_loss", lambda x, b: _policy(x, b, ratio_level="sequence")),
    "linear_policy_loss": ("linear_policy_loss", _linear),
}


def _leaves(x, name):
    keys = ("hidden", "weight") if name == "linear_policy_loss" else ("logits",)
    return {k: x[k].clone().requires_grad_() for k in keys}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ONCE)
def test_a_second_backward_of_a_loss_raises_before_touching_anything(name, backend):
    op, make = ONCE[name]
    x = _inputs(backend)
    call = make(x, backend)
    leaves = _leaves(x, name)
    value = call(leaves)
    (2.0 * value).backward(retain_graph=True)
    first = {k: leaf.grad.clone() for k, leaf in leaves.items()}
    with pytest.raises(RuntimeError, match=rf"{op} backpropagates once.*retain_graph=True.*"
                                           rf"Call {op} again"):
        (2.0 * value).backward()
    for k, leaf in leaves.items():  # the first gradient as it was, bit for bit
        assert torch.equal(leaf.grad, first[k]), k
        leaf.grad = None
    (2.0 * call(leaves)).backward()  # a new call backpropagates again: the same gradient
    for k, leaf in leaves.items():
        assert torch.equal(leaf.grad, first[k]), k


#: The per-token ops: name -> a scalar of their outputs with non-unit weights.
RECOMPUTED = {
    "selected_logprobs": lambda x, b, p: 1.5 * loss.selected_logprobs(
        p, x["ids"], x["mask"], backend=b).sum(),
    "selected_logprobs_entropy": lambda x, b, p: sum(w * out.sum() for w, out in zip(
        (1.5, -0.7), loss.selected_logprobs(p, x["ids"], x["mask"], backend=b,
                                            return_entropy=True))),
    "ratio_kl": lambda x, b, p: sum(w * out.sum() for w, out in zip(
        (1.5, -0.7), loss.ratio_kl(p, None, x["ids"], x["mask"], x["old"], ref_logps=x["ref"],
                                   backend=b))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", RECOMPUTED)
def test_a_second_backward_of_a_per_token_op_adds_the_same_gradient(name, backend):
    x = _inputs(backend, seed=1)
    logits = x["logits"].clone().requires_grad_()
    value = RECOMPUTED[name](x, backend, logits)
    value.backward(retain_graph=True)
    first = logits.grad.clone()
    assert first.abs().max() > 0
    value.backward()
    assert torch.equal(logits.grad, first + first)
