"""``grad_weight_accum``: the dtype of ``d weight``'s running sum over the row chunks, both
linear ops, both frameworks, against float64.

A bf16 weight's gradient summed in float32 and rounded once (``"float32"``, the default) is
within one bf16 rounding of the float64 gradient at every entry (plus float32's own
error); summed in bf16 (``"weight"``) it rounds once per chunk, and entries fall outside that
bound. The GPU's rules (a bf16 ``d loss / d x`` into bf16 GEMMs) run on the CPU through
``head_operands(..., gpu=True)``, where a bf16 ``addmm_`` rounds once per call as cuBLAS
does. Small shapes, few chunks: the interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl import harness, spec
from ratiokl.harness import round_to_dtype
from linear_cases import run

N, H, V = 24, 32, 64
CHUNK = 6  # four chunks
#: bf16's unit roundoff: one rounding moves a value by at most this fraction of it.
BF16_ROUNDOFF = 2.0 ** -8
#: float32's error in a sum of N products (and in the float32 logits before it), as a
#: fraction of the sum of the products' magnitudes: far below one bf16 rounding.
FP32_SLACK = 2.0 ** -16


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"hidden": round_to_dtype(rng.standard_normal((N, H)), "bfloat16"),
            "weight": round_to_dtype(rng.standard_normal((V, H)) * 0.5, "bfloat16"),
            "action_ids": rng.integers(0, V, N), "mask": rng.random(N) > 0.2,
            "g_logp": rng.standard_normal(N).astype(np.float32),
            "g_entropy": rng.standard_normal(N).astype(np.float32),
            "old": (rng.standard_normal(N) * 0.1 - 4.0).astype(np.float32),
            "adv": rng.standard_normal(N).astype(np.float32)}


def _outside_one_rounding(got: np.ndarray, exact: np.ndarray, magnitude: float) -> int:
    """How many entries of ``got`` lie further from ``exact`` than one bf16 rounding (and
    float32's error in the sum, ``magnitude`` the largest sum of the products' sizes)."""
    bound = BF16_ROUNDOFF * np.abs(exact) + FP32_SLACK * magnitude
    return int((np.abs(got - exact) > bound).sum())


@pytest.mark.parametrize("mode", ["float32", "weight"])
@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("hidden, weight", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                            ("bfloat16", "float32")])
def test_option_sets_the_accumulator(mode, gpu, hidden, weight):
    import jax.numpy as jnp
    import torch

    from ratiokl.jax._lm_head import grad_weight_zeros
    from ratiokl.torch._lm_head import head_operands

    transform = spec.logit_transform(grad_weight_accum=mode)
    want = "float32" if mode == "float32" else weight
    assert spec.grad_weight_accumulator(weight, transform) == want
    head = head_operands(getattr(torch, hidden), torch.zeros(4, 2, dtype=getattr(torch, weight)),
                         transform, gpu=gpu)
    assert head.accumulate == getattr(torch, want)
    assert grad_weight_zeros(jnp.zeros((4, 2), weight), transform).dtype == jnp.dtype(want)


def test_default_is_float32_and_bad_value_names_the_argument():
    from ratiokl.torch import loss

    assert spec.logit_transform().grad_weight_accum == "float32"
    with pytest.raises(ValueError, match="grad_weight_accum"):
        spec.logit_transform(grad_weight_accum="bfloat16")
    import torch

    with pytest.raises(ValueError, match="grad_weight_accum"):
        loss.linear_selected_logprobs(torch.randn(2, 8), torch.randn(16, 8),
                                      torch.zeros(2, dtype=torch.long), grad_weight_accum="bf16")


def test_gpu_rules_round_d_weight_once_or_per_chunk():
    """The GPU's chunk GEMMs on the CPU: bf16 ``du`` and hidden rows into ``d weight``;
    against the float64 sum of the same bf16 products."""
    import torch

    from ratiokl.torch._lm_head import chunk_grads, head_operands

    g = torch.Generator().manual_seed(5)
    rows, chunks = 32, 8
    hidden = torch.randn(rows * chunks, H, generator=g).bfloat16()
    du = (torch.randn(rows * chunks, V, generator=g) * 0.1).bfloat16()
    exact = du.double().T @ hidden.double()
    magnitude = float((du.double().abs().T @ hidden.double().abs()).max())
    weight = torch.zeros(V, H, dtype=torch.bfloat16)
    outside = {}
    for mode in ("float32", "weight"):
        transform = spec.logit_transform(grad_weight_accum=mode)
        head = head_operands(torch.bfloat16, weight, transform, gpu=True)
        assert head.grad == torch.bfloat16 and not head.split_grads
        dw = torch.empty(V, H, dtype=head.accumulate)
        for c in range(chunks):
            part = slice(c * rows, (c + 1) * rows)
            chunk_grads(du[part], hidden[part], head, transform, None, dw, c == 0, None)
        got = dw.to(torch.bfloat16).double().numpy()
        outside[mode] = _outside_one_rounding(got, exact.numpy(), magnitude)
    assert outside["float32"] == 0 and outside["weight"] > V * H // 50, outside


def test_linear_selected_logprobs(native_target):
    t = harness.TARGETS[native_target]
    x = _data()
    _, exact, _ = spec.linear_selected_logprobs_grad(
        x["hidden"], x["weight"], x["action_ids"], x["mask"], x["g_logp"], x["g_entropy"])
    _, magnitude, _ = spec.linear_grad_magnitudes(
        x["hidden"], x["weight"], x["action_ids"], x["mask"], x["g_logp"], x["g_entropy"])
    outside = {mode: _outside_one_rounding(
        run(t.framework, x, t.backend, "bfloat16", chunk_rows=CHUNK,
            grad_weight_accum=mode)[3], exact, magnitude) for mode in ("float32", "weight")}
    assert outside["float32"] == 0 and outside["weight"] > 0, outside


def _policy_d_weight(framework: str, backend: str, x, mode: str) -> np.ndarray:
    """``d weight`` (float32 NumPy; checked bf16) of a bf16 ``linear_policy_loss``."""
    args = (x["action_ids"], x["mask"], x["old"], x["adv"])
    kw = dict(chunk_rows=CHUNK, backend=backend, grad_weight_accum=mode)
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        h = torch.tensor(x["hidden"]).bfloat16()
        w = torch.tensor(x["weight"]).bfloat16().requires_grad_()
        value, _ = loss.linear_policy_loss(h, w, *map(torch.tensor, args), **kw)
        value.backward()
        assert w.grad.dtype == torch.bfloat16
        return w.grad.float().numpy()
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    h = jnp.asarray(x["hidden"], jnp.bfloat16)
    rest = tuple(map(jnp.asarray, args))
    grad = jax.jit(jax.grad(lambda w: loss.linear_policy_loss(h, w, *rest, **kw)[0]))(
        jnp.asarray(x["weight"], jnp.bfloat16))
    assert grad.dtype == jnp.bfloat16
    return np.asarray(grad.astype(jnp.float32))


def test_linear_policy_loss(interpret_target):
    """The fused chunks (the interpreter; ``"native"`` takes one GEMM over every row)."""
    t = harness.TARGETS[interpret_target]
    x = dict(_data(1))
    hidden, weight = (x[k].astype(np.float64) for k in ("hidden", "weight"))
    kept = np.where(x["mask"][:, None], hidden, 0.0)
    dx = spec.policy_loss_grad(kept @ weight.T, None, x["action_ids"], x["mask"], x["old"],
                               x["adv"])
    exact = dx.T @ kept
    magnitude = float((np.abs(dx).T @ np.abs(kept)).max())
    outside = {mode: _outside_one_rounding(_policy_d_weight(t.framework, t.backend, x, mode),
                                           exact, magnitude) for mode in ("float32", "weight")}
    assert outside["float32"] == 0 and outside["weight"] > 0, outside
