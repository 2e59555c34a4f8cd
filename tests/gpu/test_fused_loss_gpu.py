"""The fused ``policy_loss`` on a CUDA GPU: torch ``"triton"`` and JAX ``"triton"`` vs native.

Run on the H200 with ``pytest -m gpu tests/gpu/test_fused_loss_gpu.py``;
skipped without CUDA. Loss, metrics and policy-logit gradient of the fused
kernel against each framework's two-pass native path (fp32 and bf16, with
reference logits or log-probs, inactive rows holding garbage), a non-unit
upstream gradient, bitwise determinism and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from assertions import as_float64, assert_close, two_paths  # noqa: E402

from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T, V = 4, 16, 50_257
OPTIONS = {
    "grpo_k3_ref_logits": dict(kl_coef=0.1),
    "dapo_dual_clip_k3_is_seq_mean_ref_logps": dict(
        clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.2, kl_estimator="k3-is",
        loss_agg="seq-mean-token-mean", ref="logps"),
    "cispo_entropy_bonus_token_sum_ref_logps": dict(
        objective="cispo", entropy_coef=0.05, kl_coef=0.1, loss_agg="token-sum", ref="logps"),
}


def _inputs(dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cuda = dict(device="cuda", generator=g)
    policy = (torch.randn(B, T, V, **cuda) * 2).to(dtype)
    ref = (policy.float() + 0.3 * torch.randn(B, T, V, **cuda)).to(dtype)
    mask = torch.rand(B, T, **cuda) < 0.8
    mask[0, 0], mask[0, 1] = False, True
    policy[0, 0] = float("nan")  # garbage on an inactive row
    return dict(
        policy=policy, ref=ref, ids=torch.randint(0, V, (B, T), **cuda), mask=mask,
        old=torch.randn(B, T, **cuda) * 0.3 - 10.0, adv=torch.randn(B, T, **cuda),
        ref_logps=torch.randn(B, T, **cuda) * 0.3 - 10.0,
    )


def _torch(x, options, backend, upstream=1.0, compiled=False):
    options = dict(options)
    by_logps = options.pop("ref", None) == "logps"
    leaf = x["policy"].detach().clone().requires_grad_(True)

    def forward(leaf):
        return loss.policy_loss(
            leaf, None if by_logps else x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
            ref_logps=x["ref_logps"] if by_logps else None, backend=backend, check_ids=False,
            **options)

    value, metrics = (torch.compile(forward, fullgraph=True) if compiled else forward)(leaf)
    (value * upstream).backward()  # compiled: AOTAutograd's backward runs the scale kernel
    return value.detach(), metrics, leaf.grad


def _tolerances(policy, grad, dtype: str):
    """Two paths' tolerances: of the loss and metrics (the fp32 forward's, relative to the
    logits' magnitude) and of the gradient stored in ``dtype``."""
    scale = float(np.nanmax(np.abs(as_float64(policy))))
    g = float(np.abs(as_float64(grad)).max())
    return (two_paths(spec.forward_tolerance(scale)),
            two_paths(spec.grad_tolerance(dtype, scale, g)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_torch_fused_matches_native(name, dtype):
    x = _inputs(dtype, seed=len(name))
    f_val, f_met, f_grad = _torch(x, OPTIONS[name], "triton", upstream=-1.7)
    n_val, n_met, n_grad = _torch(x, OPTIONS[name], "native", upstream=-1.7)
    value_tol, grad_tol = _tolerances(x["policy"], n_grad, str(dtype).split(".")[-1])
    assert_close(f_val, n_val, value_tol, "loss")
    for key in n_met:
        assert_close(f_met[key], n_met[key], value_tol, key)
    assert_close(f_grad, n_grad, grad_tol, "grad")
    assert f_grad.dtype == dtype
    assert torch.all(f_grad[~x["mask"]] == 0)


def test_torch_fused_is_deterministic_and_compiles():
    x = _inputs(torch.bfloat16, seed=3)
    runs = [_torch(x, OPTIONS["grpo_k3_ref_logits"], "triton") for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
    c_val, _, c_grad = _torch(x, OPTIONS["grpo_k3_ref_logits"], "triton", compiled=True)
    value_tol, grad_tol = _tolerances(x["policy"], runs[0][2], "bfloat16")
    assert_close(c_val, runs[0][0], value_tol, "compiled loss")
    assert_close(c_grad, runs[0][2], grad_tol, "compiled grad")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_fused_matches_native(dtype):
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss
    from ratiokl.jax._jax_triton import import_jax_triton

    try:
        import_jax_triton()
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")
    x = _inputs(torch.bfloat16 if dtype == "bfloat16" else torch.float32, seed=11)
    def to_jax(t):
        if t.dtype == torch.bfloat16:
            return jnp.asarray(t.cpu().view(torch.int16).numpy()).view(jnp.bfloat16)
        return jnp.asarray(t.cpu().numpy())

    j = {k: to_jax(v) for k, v in x.items()}
    options = dict(kl_coef=0.1, dual_clip=3.0, loss_agg="seq-mean-token-sum")

    def run(backend):
        def objective(p):
            value, metrics = jax_loss.policy_loss(
                p, j["ref"], j["ids"], j["mask"], j["old"], j["adv"], backend=backend,
                check_ids=False, **options)
            return -1.7 * value, metrics
        return jax.jit(jax.value_and_grad(objective, has_aux=True))(j["policy"])

    (f_val, f_met), f_grad = run("triton")
    (n_val, n_met), n_grad = run("native")
    value_tol, grad_tol = _tolerances(x["policy"], n_grad, dtype)
    assert_close(f_val, n_val, value_tol, "loss")
    for key in n_met:
        assert_close(f_met[key], n_met[key], value_tol, key)
    assert f_grad.dtype == j["policy"].dtype
    f_grad, n_grad = np.asarray(f_grad, np.float32), np.asarray(n_grad, np.float32)
    assert_close(f_grad, n_grad, grad_tol, "grad")
    assert np.all(f_grad[~np.asarray(x["mask"].cpu())] == 0)


def test_torch_inplace_grad_matches_and_allocates_no_gradient():
    x = _inputs(torch.bfloat16, seed=5)
    options = dict(kl_coef=0.1)
    want_val, _, want_grad = _torch(x, options, "triton", upstream=-1.7)
    leaf = x["policy"].detach().clone().requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    value, _ = loss.policy_loss(leaf, x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                                backend="triton", check_ids=False, inplace_grad=True, **options)
    (grad,) = torch.autograd.grad(value * -1.7, leaf)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert torch.equal(value.detach(), want_val)
    assert torch.equal(grad, want_grad)
    assert grad.data_ptr() == leaf.data_ptr()  # the gradient is the logits' buffer
    assert extra < x["policy"].numel() * 2 // 4  # O(N): far below one [N, V] gradient


def test_jax_inplace_grad_with_donated_logits_matches_and_aliases():
    pytest.importorskip("jax")
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss
    from ratiokl.jax._jax_triton import import_jax_triton

    try:
        import_jax_triton()
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")
    x = _inputs(torch.float32, seed=7)
    j = {k: jnp.asarray(v.cpu().numpy()) for k, v in x.items()}

    def grad_fn(inplace):
        def objective(p):
            return -1.7 * jax_loss.policy_loss(
                p, j["ref"], j["ids"], j["mask"], j["old"], j["adv"], backend="triton",
                check_ids=False, kl_coef=0.1, inplace_grad=inplace)[0]
        return jax.jit(jax.grad(objective), donate_argnums=0)

    want = grad_fn(False)(jnp.array(j["policy"]))
    compiled = grad_fn(True).lower(j["policy"]).compile()
    got = compiled(jnp.array(j["policy"]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    stats = compiled.memory_analysis()
    if stats is not None:  # the gradient reuses the donated logits: no [N, V] temporary
        assert stats.temp_size_in_bytes < j["policy"].size * 4 // 4


@pytest.mark.parametrize("write_grad", [True, False], ids=["grad", "no_grad"])
def test_torch_fused_spans_meeting_gives_the_bits_of_one_program_per_row(monkeypatch, write_grad):
    """A program per span meeting at the row's counter == one program taking every span
    (the entropy's partials included)."""
    from ratiokl.torch import _launch

    x = _inputs(torch.bfloat16, seed=9)
    x["mask"][1] = False  # a whole inactive sequence among active ones

    def run():
        leaf = x["policy"].detach().clone().requires_grad_(write_grad)
        value, metrics = loss.policy_loss(
            leaf, x["ref"], x["ids"], x["mask"], x["old"], x["adv"], backend="triton",
            check_ids=False, kl_coef=0.1, entropy_coef=0.05)
        grad = torch.autograd.grad(value * -1.7, leaf)[0] if write_grad else None
        return value.detach(), metrics, grad

    spans = run()
    plan = _launch.loss.launch_plan

    def whole_rows(vocab, itemsize, n_rows, write_grad):  # one program takes a row's spans
        chosen = plan(vocab, itemsize, n_rows, write_grad)
        return chosen._replace(spans_per_program=chosen.spans.splits)

    monkeypatch.setattr(_launch.loss, "launch_plan", whole_rows)
    whole = run()
    n = x["policy"].shape[0] * x["policy"].shape[1]
    assert plan(V, 2, n, write_grad).spans_per_program == 1  # few rows: a program per span
    assert plan(V, 2, n, write_grad).spans.splits > 1
    assert torch.equal(spans[0], whole[0])
    for key in spans[1]:
        assert torch.equal(spans[1][key], whole[1][key]), key
    if write_grad:
        assert torch.equal(spans[2], whole[2])
        assert torch.all(spans[2][~x["mask"]] == 0)
