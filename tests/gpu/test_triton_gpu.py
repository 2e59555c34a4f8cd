"""The Triton backends on a CUDA GPU: torch ``"triton"`` and JAX ``"triton"`` (jax-triton).

Run on the H200 with ``pytest -m gpu tests/gpu``; skipped without CUDA.
Checks: both frameworks against ``ratiokl.spec`` in fp32/fp16/bf16 (forward
and gradient, inactive rows holding garbage), N x V beyond 2^31 elements,
bitwise determinism, batch invariance, ``torch.compile(fullgraph=True)`` of
a training step, and torch-vs-JAX parity of the same kernels.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from assertions import assert_close, two_paths  # noqa: E402

from ratiokl import spec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KL_NAMES = {1: "k1", 2: "k2", 3: "k3"}


def _require_jax_triton() -> None:
    """Skip without jax-triton; import it through the helper that keeps TRITON_CACHE_DIR."""
    pytest.importorskip("jax")
    from ratiokl.jax._jax_triton import import_jax_triton

    try:
        import_jax_triton()
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")


def _inputs(n: int, vocab: int, dtype: str, seed: int, garbage: bool = True):
    """Random CUDA inputs; a few inactive rows hold NaN/inf logits and bad ids."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    cuda = dict(device="cuda")
    policy = (torch.randn(n, vocab, generator=g, **cuda) * 2).to(DTYPES[dtype])
    ref = (policy.float() + 0.3 * torch.randn(n, vocab, generator=g, **cuda)).to(DTYPES[dtype])
    ids = torch.randint(0, vocab, (n,), generator=g, **cuda)
    mask = torch.rand(n, generator=g, **cuda) < 0.8
    old = torch.randn(n, generator=g, **cuda) * 0.1 - 9.0
    if garbage:
        mask[:3] = False
        policy[0], ref[1] = float("nan"), float("inf")
        ids[1], ids[2] = -7, vocab + 5
        old[2] = float("nan")
        mask[3] = True
        policy[3, ::3] = -float("inf")  # vocabulary masking on an active row
        ids[3] = 1
    g_ratio = torch.randn(n, generator=g, **cuda)
    g_kl = torch.randn(n, generator=g, **cuda)
    return policy, ref, ids, mask, old, g_ratio, g_kl


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float64)


def _torch_run(policy, ref, ids, mask, old, g_ratio, g_kl, kl_code=3, temperature=1.0):
    from ratiokl.torch import _triton

    leaf = policy.detach().requires_grad_(True)
    ratio, kl = _triton.ratio_kl(leaf, ref, ids, mask, old, None, kl_code, temperature)
    (ratio * g_ratio + kl * g_kl).sum().backward()
    return ratio.detach(), kl.detach(), leaf.grad


def _jax_run(policy, ref, ids, mask, old, g_ratio, g_kl, kl_code=3, temperature=1.0):
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import _triton
    from ratiokl.jax._jax_triton import triton_call

    to_jax = lambda t: jnp.asarray(t.cpu().numpy()) if t.dtype != torch.bfloat16 else (  # noqa: E731
        jnp.asarray(t.cpu().view(torch.int16).numpy()).view(jnp.bfloat16))
    x, r, i, m, o, gr, gk = map(to_jax, (policy, ref, ids, mask, old, g_ratio, g_kl))

    def objective(x):
        ratio, kl = _triton.ratio_kl(triton_call, x, r, i, m, o, None, kl_code, temperature)
        return jnp.sum(ratio * gr + kl * gk), (ratio, kl)

    grad, (ratio, kl) = jax.jit(jax.grad(objective, has_aux=True))(x)
    back = lambda a: torch.from_numpy(np.asarray(a.astype(jnp.float32)))  # noqa: E731
    return back(ratio), back(kl), back(grad)


def _finite_max(a) -> float:
    return float(np.abs(a[np.isfinite(a)]).max())


def _logit_scale(policy, ref, mask, temperature: float = 1.0) -> float:
    """``max |logits / T|`` over the active rows' finite logits."""
    active = mask.cpu().numpy()
    return max(_finite_max(_np(policy)[active]), _finite_max(_np(ref)[active])) / temperature


def _check_spec(run, dtype: str, kl_code: int, vocab: int = 50_257, n: int = 64) -> None:
    policy, ref, ids, mask, old, g_ratio, g_kl = _inputs(n, vocab, dtype, seed=kl_code)
    ratio, kl, grad = run(policy, ref, ids, mask, old, g_ratio, g_kl, kl_code, 0.9)
    args = (_np(policy), _np(ref), ids.cpu().numpy(), mask.cpu().numpy(), _np(old))
    kw = dict(kl_estimator=KL_NAMES[kl_code], temperature=0.9)
    e_ratio, e_kl = spec.ratio_kl(*args, **kw)
    e_grad = spec.ratio_kl_grad(*args, _np(g_ratio), _np(g_kl), **kw)
    scale = _logit_scale(policy, ref, mask, 0.9)
    fwd = spec.forward_tolerance(scale)
    errs = (assert_close(_np(ratio), e_ratio, fwd, "ratio"), assert_close(_np(kl), e_kl, fwd, "kl"),
            assert_close(_np(grad), e_grad,
                          spec.grad_tolerance(dtype, scale, _finite_max(e_grad)), "grad"))
    print(f"[worst err / tolerance] {run.__name__} {dtype} k{kl_code}: ratio {errs[0]:.3g} "
          f"kl {errs[1]:.3g} grad {errs[2]:.3g}")


@pytest.mark.parametrize(
    "dtype, kl_code",
    [("float32", 3), ("float16", 3), ("bfloat16", 3), ("bfloat16", 1), ("bfloat16", 2)],
)
def test_torch_triton_matches_spec(dtype, kl_code):
    _check_spec(_torch_run, dtype, kl_code)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_jax_triton_matches_spec(dtype):
    _require_jax_triton()
    _check_spec(_jax_run, dtype, 3)


def test_torch_and_jax_triton_agree():
    _require_jax_triton()
    inputs = _inputs(32, 32_000, "bfloat16", seed=5)
    t_out, j_out = _torch_run(*inputs), _jax_run(*inputs)
    scale = _logit_scale(inputs[0], inputs[1], inputs[3])
    for name, a, b in zip(("ratio", "kl", "grad"), t_out, j_out):
        a = a.float().cpu()
        same = torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
        print(f"[parity] {name}: bitwise {'equal' if same else 'different'}, "
              f"max |diff| {torch.nan_to_num((a - b).abs(), 0.0).max().item():.3g}")
        tol = (spec.grad_tolerance("bfloat16", scale, _finite_max(b.numpy())) if name == "grad"
               else spec.forward_tolerance(scale))
        assert_close(a, b, two_paths(tol), name)


@pytest.mark.whole_gpu  # ~25 GB of inputs and gradients: run alone, not beside other workers
def test_beyond_2_pow_31_elements():
    n, vocab = 16_384, 131_200  # n * vocab = 2.15e9 > 2^31
    policy, ref, ids, mask, old, g_ratio, g_kl = _inputs(n, vocab, "bfloat16", seed=1, garbage=False)
    mask[-4:] = True
    ratio, kl, grad = _torch_run(policy, ref, ids, mask, old, g_ratio, g_kl)
    tail = slice(n - 4, n)  # rows whose offsets are past 2^31
    args = (_np(policy[tail]), _np(ref[tail]), ids[tail].cpu().numpy(), mask[tail].cpu().numpy(),
            _np(old[tail]))
    e_ratio, e_kl = spec.ratio_kl(*args)
    e_grad = spec.ratio_kl_grad(*args, _np(g_ratio[tail]), _np(g_kl[tail]))
    scale = max(np.abs(args[0]).max(), np.abs(args[1]).max())
    assert_close(_np(ratio[tail]), e_ratio, spec.forward_tolerance(scale), "ratio")
    assert_close(_np(kl[tail]), e_kl, spec.forward_tolerance(scale), "kl")
    assert_close(_np(grad[tail]), e_grad,
                  spec.grad_tolerance("bfloat16", scale, np.abs(e_grad).max()), "grad")


def test_bitwise_deterministic_and_batch_invariant():
    inputs = _inputs(1024, 65_536 + 77, "bfloat16", seed=3)
    first, second = _torch_run(*inputs), _torch_run(*inputs)
    for a, b in zip(first, second):
        assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
    for rows in (slice(3, 4), slice(500, 501), slice(10, 200)):
        alone = _torch_run(*(t[rows] for t in inputs))
        for a, b in zip(alone, first):
            assert torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b[rows], 7.0))


def test_torch_compile_training_step():
    from ratiokl.torch import loss

    torch.manual_seed(0)
    # float32 logits: inductor's matmul rounds bf16 logits differently from eager's
    # (1.3e-4 relative on the objective), which would hide what this test checks.
    head = torch.nn.Linear(64, 5_000, device="cuda")
    ref_head = torch.nn.Linear(64, 5_000, device="cuda")
    hidden = torch.randn(4, 16, 64, device="cuda")
    ids = torch.randint(0, 5_000, (4, 16), device="cuda")
    mask = torch.rand(4, 16, device="cuda") < 0.7
    old = torch.randn(4, 16, device="cuda") - 8.0

    def value(logits, hidden):
        with torch.no_grad():
            ref_logits = ref_head(hidden)
        ratio, kl = loss.ratio_kl(logits, ref_logits, ids, mask, old,
                                  backend="triton", check_ids=False)
        return (ratio + 0.1 * kl).sum()

    def objective(hidden):
        return value(head(hidden), hidden)

    eager = objective(hidden)
    eager.backward()
    eager_grad = head.weight.grad.clone()
    head.weight.grad = None
    compiled = torch.compile(objective, fullgraph=True)(hidden)
    compiled.backward()  # AOTAutograd's compiled backward runs the backward kernel
    # The sum of 64 same-signed tokens; d W against the yardstick max(|du|.T @ |hidden|).
    assert_close(compiled, eager, spec.paths_tolerance(ids.numel(), float(eager.abs())), "value")
    logits = head(hidden).detach().requires_grad_()
    (du,) = torch.autograd.grad(value(logits, hidden), logits)
    yardstick = float((du.abs().reshape(-1, 5_000).t() @ hidden.abs().reshape(-1, 64)).max())
    tol = spec.linear_grad_tolerance("float32", float(logits.abs().max()), yardstick)
    assert_close(head.weight.grad, eager_grad, two_paths(tol), "d weight")


@pytest.mark.parametrize("op", ["ratio_kl", "policy_loss", "policy_loss_inplace"])
def test_deferred_id_check_raises_from_the_same_call(op):
    """``check_ids=True`` on CUDA reads its result after the launches: same error, same call."""
    from ratiokl.torch import loss

    policy, ref, ids, mask, old, _, _ = _inputs(64, 4097, "bfloat16", seed=2, garbage=False)
    mask[5], ids[5] = True, 4097 + 3
    adv = torch.ones_like(old)
    leaf = policy.clone().requires_grad_(True)
    calls = {
        "ratio_kl": lambda: loss.ratio_kl(leaf, ref, ids, mask, old),
        "policy_loss": lambda: loss.policy_loss(leaf, None, ids, mask, old, adv),
        "policy_loss_inplace": lambda: loss.policy_loss(leaf, None, ids, mask, old, adv,
                                                        inplace_grad=True),
    }
    with pytest.raises(ValueError, match=r"action_ids\[5\] = 4100"):
        calls[op]()
    if op == "policy_loss_inplace":  # checked before the launch that consumes the logits
        assert torch.equal(leaf.detach(), policy)
    ids[5] = 7  # a good call after a failed one works (the pinned flags are per call)
    out = calls[op]()
    assert torch.isfinite(out[0]).all()
