"""``torch.func`` transforms (``grad``, ``vmap``) are refused at the public boundary.

The ops' custom ``autograd.Function``s have no functorch rules, so each public op raises
one ``RuntimeError`` that names the transforms and says what to use instead, on every
backend, rather than whatever error the transform meets inside.
"""

from __future__ import annotations

import pytest
import torch

from ratiokl.torch import loss

B, T, H, V = 2, 3, 4, 7

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"))]


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(ids=torch.randint(0, V, (B, T), generator=g),
                mask=torch.ones(B, T, dtype=torch.bool),
                old=torch.randn(B, T, generator=g) - 2.0, adv=torch.randn(B, T, generator=g))


#: name -> (first argument's shape, a scalar of the op's outputs from (x, ids, mask, old, adv)).
OPS = {
    "selected_logprobs": ((B, T, V), lambda b, w, x, i, m, o, a: loss.selected_logprobs(
        x, i, m, backend=b).sum()),
    "selected_logprobs_entropy": ((B, T, V), lambda b, w, x, i, m, o, a: loss.selected_logprobs(
        x, i, m, backend=b, return_entropy=True)[1].sum()),
    "ratio_kl": ((B, T, V), lambda b, w, x, i, m, o, a: loss.ratio_kl(
        x, None, i, m, o, ref_logps=o, backend=b)[1].sum()),
    "policy_loss": ((B, T, V), lambda b, w, x, i, m, o, a: loss.policy_loss(
        x, None, i, m, o, a, backend=b)[0]),
    "linear_policy_loss": ((B, T, H), lambda b, w, x, i, m, o, a: loss.linear_policy_loss(
        x, w, i, m, o, a, backend=b)[0]),
}

REFUSED = r"do not support torch\.func transforms \(grad, vmap.*loss\.backward\(\).*ratiokl\.jax"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("name", OPS)
def test_a_torch_func_transform_raises_a_clear_error(name, transform, backend):
    if backend != "native":
        pytest.importorskip("triton")
    shape, op = OPS[name]
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(shape, generator=g), torch.randn(V, H, generator=g)
    t = _inputs()

    def scalar(x, ids, mask, old, adv):
        return op(backend, weight, x, ids, mask, old, adv)

    args = (x, t["ids"], t["mask"], t["old"], t["adv"])
    transformed = torch.func.grad(scalar) if transform == "grad" else torch.func.vmap(scalar)
    with pytest.raises(RuntimeError, match=REFUSED):
        transformed(*args)
    scalar(*args)  # outside the transform the same call runs
