"""``linear_policy_loss`` on a CUDA GPU: row chunks of hidden states against the materialised
step (``hidden @ W.T`` -> ``policy_loss`` -> autograd), at a real vocabulary.

Run on the H200 with ``pytest -m gpu tests/gpu/test_linear_policy_loss_gpu.py``; skipped
without CUDA. Loss, metrics, ``d hidden`` and ``d W`` against the materialised step
(inactive rows zeroed there), bf16 and fp32, chunks that divide the rows and one that
leaves a remainder (the forward-only and gradient launch plans at several row counts);
NaN hidden states on inactive rows; the step's peak memory beyond its gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from assertions import assert_close, two_paths

from ratiokl import spec
from ratiokl.torch import loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T, H, V = 4, 384, 512, 151_936  # 1536 rows


def _data(dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(V, H, generator=g, device="cuda") / H ** 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g, device="cuda")
    mask = torch.rand(B, T, generator=g, device="cuda") > 0.2
    old = torch.randn(B, T, generator=g, device="cuda") * 0.1 - 12.0
    ref = old + 0.05 * torch.randn(B, T, generator=g, device="cuda")
    adv = torch.randn(B, generator=g, device="cuda")
    return hidden, weight, ids, mask, old, ref, adv


def _step(fn, hidden, weight):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    value, metrics = fn(h, w)
    value.backward()
    return value, metrics, h.grad, w.grad


def _assert_steps_close(got, want, hidden, weight, dtype: str) -> None:
    """Loss and metrics: two float32 paths of a sum over the ``B * T`` tokens, each token's
    error relative to the logits' magnitude; ``d hidden`` and ``d W``: two evaluations each
    within ``spec.linear_grad_tolerance`` (the largest entry standing for the yardstick)."""
    scale = float((hidden.float().reshape(-1, H) @ weight.float().t()).abs().max())
    value_tol = spec.paths_tolerance(B * T, magnitude=max(1.0, scale))
    assert_close(got[0], want[0], value_tol, "loss")
    for name in want[1]:
        assert_close(got[1][name], want[1][name], value_tol, name)
    for what, g, w in (("d hidden", got[2], want[2]), ("d W", got[3], want[3])):
        top = float(w.float().abs().max())
        assert_close(g, w, two_paths(spec.linear_grad_tolerance(dtype, scale, top)), what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk_rows", [512, 1000, 4096])
def test_matches_the_materialised_step(dtype, chunk_rows):
    hidden, weight, ids, mask, old, ref, adv = _data(dtype)
    kw = dict(ref_logps=ref, kl_coef=0.05, entropy_coef=0.01)
    zero = torch.zeros((), dtype=dtype, device="cuda")
    want = _step(lambda h, w: loss.policy_loss(
        torch.where(mask[..., None], h, zero) @ w.t(), None, ids, mask, old, adv, **kw),
        hidden, weight)
    # logits_dtype="input", fp32_matmul="ieee": the materialised step's own head (its GEMM
    # rounds the logits to the inputs' dtype; float32 GEMMs for float32 inputs).
    got = _step(lambda h, w: loss.linear_policy_loss(
        h, w, ids, mask, old, adv, chunk_rows=chunk_rows, logits_dtype="input",
        fp32_matmul="ieee", **kw), hidden, weight)
    if chunk_rows >= B * T:  # one chunk: the materialised route's own GEMM and kernel
        assert torch.equal(got[0], want[0])
    _assert_steps_close(got, want, hidden, weight, str(dtype).split(".")[-1])
    assert torch.equal(got[2][~mask], torch.zeros_like(got[2][~mask]))


def test_nan_hidden_states_on_inactive_rows_stay_out():
    hidden, weight, ids, mask, old, ref, adv = _data(torch.bfloat16, seed=1)
    clean = _step(lambda h, w: loss.linear_policy_loss(h, w, ids, mask, old, adv,
                                                       chunk_rows=700), hidden, weight)
    dirty = hidden.clone()
    dirty[~mask] = float("nan")
    got = _step(lambda h, w: loss.linear_policy_loss(h, w, ids, mask, old, adv,
                                                     chunk_rows=700), dirty, weight)
    assert torch.isfinite(got[3]).all() and torch.isfinite(got[2]).all()
    for a, b in zip(got[:1] + got[2:], clean[:1] + clean[2:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accum", ["float32", "weight"])
def test_peak_memory_is_one_chunk_beyond_the_gradients(accum):
    """Beyond the gradients: one chunk's buffers, and with ``grad_weight_accum="float32"``
    the float32 ``d weight`` sum (its bf16 copy beside it at the end: ``V * H * 4`` bytes
    more than ``"weight"``)."""
    hidden, weight, ids, mask, old, ref, adv = _data(torch.bfloat16, seed=2)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    chunk = 512
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    value, _ = loss.linear_policy_loss(h, w, ids, mask, old, adv, chunk_rows=chunk,
                                       check_ids=False, grad_weight_accum=accum)
    value.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    grads = h.numel() * 2 + w.numel() * 2
    buffer = chunk * V * (4 + 2)  # float32 logits and the bf16 gradient
    accumulator = w.numel() * 4 if accum == "float32" else 0
    assert extra <= grads + buffer + accumulator + 64 * 2**20, (extra, grads, buffer)


def test_jax_matches_torch_under_jit():
    """The JAX chunk loop (``fori_loop`` + remainder, jax-triton launches) against PyTorch's."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax._jax_triton import import_jax_triton

    try:  # through the helper: a bare `import jax_triton` empties TRITON_CACHE_DIR, and
        import_jax_triton()  # every later Triton compile in this worker would fail
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")

    from ratiokl.jax import loss as jax_loss

    if jax.default_backend() != "gpu":
        pytest.skip("needs JAX's GPU backend")
    hidden, weight, ids, mask, old, ref, adv = _data(torch.bfloat16, seed=3)
    kw = dict(kl_coef=0.05, entropy_coef=0.01, chunk_rows=1000)
    want = _step(lambda h, w: loss.linear_policy_loss(h, w, ids, mask, old, adv, ref_logps=ref,
                                                      **kw), hidden, weight)
    to_jax = lambda t: jnp.asarray(t.float().cpu().numpy())  # noqa: E731
    rest = [to_jax(t) for t in (ids, mask, old, adv, ref)]
    rest[0], rest[1] = rest[0].astype(jnp.int32), rest[1].astype(jnp.bool_)

    def objective(h, w, ids_j, mask_j, old_j, adv_j, ref_j):
        return jax_loss.linear_policy_loss(h, w, ids_j, mask_j, old_j, adv_j, ref_logps=ref_j,
                                           **kw)

    step = jax.jit(jax.value_and_grad(objective, argnums=(0, 1), has_aux=True))
    (value, metrics), (gh, gw) = step(to_jax(hidden).astype(jnp.bfloat16),
                                      to_jax(weight).astype(jnp.bfloat16), *rest)
    back = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32))).cuda()  # noqa: E731
    got = (back(value), {name: back(m) for name, m in metrics.items()}, back(gh), back(gw))
    _assert_steps_close(got, want, hidden, weight, "bfloat16")
