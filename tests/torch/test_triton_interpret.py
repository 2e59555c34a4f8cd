"""The Triton kernels through Triton's CPU interpreter, against ``ratiokl.spec``.

``backend="interpret"`` runs the very kernel functions that the GPU runs
(``ratiokl._kernels``), so this file is where CI checks the kernels' math:
forward and gradient in fp32/fp16/bf16, each KL estimator, reference logits
or log-probs, per-row temperature, inactive rows holding garbage, ``-inf``
vocabulary masking, NaN rows, unchecked bad ids, tiny and multi-block
vocabularies and strided logits. The JAX binding (``ratiokl.jax._triton``)
is exercised too, through JAX's ``backend="interpret"`` (the same interpreter
behind ``jax.pure_callback``; jax-triton cannot run on a CPU).
Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl import spec  # noqa: E402
from ratiokl._kernels import forward_config  # noqa: E402
from ratiokl.torch import _triton  # noqa: E402
from assertions import assert_close  # noqa: E402


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KL_NAMES = {1: "k1", 2: "k2", 3: "k3"}


class Case:
    """Random inputs of one case, in the logits' dtype, plus their float64 spec."""

    def __init__(self, n: int, vocab: int, dtype: str, seed: int = 0, scale: float = 3.0):
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        as_dtype = lambda a: torch.tensor(a, dtype=torch.float32).to(DTYPES[dtype])  # noqa: E731
        self.policy = as_dtype(rng.normal(size=(n, vocab)) * scale)
        self.ref = as_dtype(rng.normal(size=(n, vocab)) * scale)
        self.ids = torch.tensor(rng.integers(0, vocab, n))
        self.mask = torch.tensor(rng.random(n) < 0.8)
        self.old = torch.tensor(rng.normal(size=n) - 2.0, dtype=torch.float32)
        self.ref_logps = torch.tensor(rng.normal(size=n) - 2.0, dtype=torch.float32)
        self.g_ratio = torch.tensor(rng.normal(size=n), dtype=torch.float32)
        self.g_kl = torch.tensor(rng.normal(size=n), dtype=torch.float32)
        self.temperature: object = 1.0

    def np(self, t: Optional[torch.Tensor]):
        return None if t is None else t.detach().float().numpy().astype(np.float64)

    def scale(self) -> float:
        t = self.temperature
        t_min = float(t.min()) if isinstance(t, torch.Tensor) else t
        finite = lambda a: np.abs(a[np.isfinite(a)]).max(initial=1.0)  # noqa: E731
        return max(finite(self.np(self.policy)), finite(self.np(self.ref))) / t_min

    def run(self, use_ref_logits: bool, kl_code: int, check_ids: bool = True):
        policy = self.policy.clone().requires_grad_(True)
        ratio, kl = _triton.ratio_kl(
            policy, self.ref if use_ref_logits else None, self.ids, self.mask, self.old,
            None if use_ref_logits else self.ref_logps, kl_code, self.temperature,
        )
        (ratio * self.g_ratio + kl * self.g_kl).sum().backward()
        return ratio.detach().numpy(), kl.detach().numpy(), policy.grad

    def expected(self, use_ref_logits: bool, kl_code: int):
        temp = self.temperature
        kwargs = dict(
            ref_logps=None if use_ref_logits else self.np(self.ref_logps),
            kl_estimator=KL_NAMES[kl_code],
            temperature=self.np(temp) if isinstance(temp, torch.Tensor) else temp,
        )
        args = (self.np(self.policy), self.np(self.ref) if use_ref_logits else None,
                self.ids.numpy(), self.mask.numpy(), self.np(self.old))
        ratio, kl = spec.ratio_kl(*args, **kwargs)
        grad = spec.ratio_kl_grad(*args, self.np(self.g_ratio), self.np(self.g_kl), **kwargs)
        return ratio, kl, grad

    def check(self, use_ref_logits: bool = True, kl_code: int = 3, check_ids: bool = True):
        ratio, kl, grad = self.run(use_ref_logits, kl_code, check_ids)
        e_ratio, e_kl, e_grad = self.expected(use_ref_logits, kl_code)
        fwd = spec.forward_tolerance(self.scale())
        assert_close(ratio, e_ratio, fwd, "ratio")
        assert_close(kl, e_kl, fwd, "kl")
        assert grad.dtype == DTYPES[self.dtype]
        finite = np.isfinite(e_grad)
        grad_scale = np.abs(e_grad[finite]).max(initial=0.0)
        assert_close(grad.float().numpy(), e_grad,
                      spec.grad_tolerance(self.dtype, self.scale(), grad_scale), "grad")
        return ratio, kl, grad


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kl_code", [1, 2, 3])
def test_ratio_kl_matches_spec(dtype, kl_code):
    Case(6, 300, dtype, seed=kl_code).check(use_ref_logits=True, kl_code=kl_code)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ref_logps_and_per_row_temperature(dtype):
    case = Case(6, 300, dtype, seed=7, scale=1.0)  # exp(d) of the k3 gradient fits fp16
    case.temperature = torch.tensor([0.5, 1.0, 1.7, 0.9, 2.0, 1.1])
    case.ref_logps = torch.tensor(spec.selected_logprobs(
        case.np(case.ref), case.ids.numpy(), None, temperature=case.np(case.temperature)
    ), dtype=torch.float32)
    case.check(use_ref_logits=False, kl_code=3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_block_vocabulary(dtype):
    block = forward_config(10_000, DTYPES[dtype].itemsize).block_v
    vocab = 2 * block + 37  # two unmasked blocks and a ragged tail
    Case(3, vocab, dtype, seed=3).check(use_ref_logits=True, kl_code=3)


@pytest.mark.parametrize("vocab", [1, 2, 5])
def test_tiny_vocabulary(vocab):
    Case(5, vocab, "float32", seed=vocab).check(use_ref_logits=True, kl_code=3)


def test_inactive_rows_hold_garbage():
    case = Case(6, 64, "float32", seed=11)
    case.mask = torch.tensor([True, False, True, False, False, True])
    case.policy[1] = float("nan")
    case.policy[3] = float("inf")
    case.ref[4] = -float("inf")
    case.ids[1], case.ids[3], case.ids[4] = -3, 64, 10**9
    case.old[3] = float("nan")
    case.g_ratio[4] = float("nan")
    ratio, kl, grad = case.check(use_ref_logits=True, kl_code=3)
    inactive = ~case.mask.numpy()
    np.testing.assert_array_equal(ratio[inactive], 1.0)
    np.testing.assert_array_equal(kl[inactive], 0.0)
    assert torch.equal(grad[~case.mask], torch.zeros_like(grad[~case.mask]))


def test_inf_masking_and_nan_rows():
    case = Case(4, 50, "bfloat16", seed=5)
    case.mask = torch.ones(4, dtype=torch.bool)
    case.policy[0, 1::2] = -float("inf")  # vocabulary masking: valid
    case.ids[0] = 0
    case.policy[2, 7] = float("nan")  # invalid distribution: NaN row only
    ratio, kl, grad = case.check(use_ref_logits=True, kl_code=3)
    assert np.isfinite(ratio[[0, 1, 3]]).all() and np.isnan(ratio[2])
    assert torch.isfinite(grad[0]).all() and torch.isnan(grad[2]).all()


def test_unchecked_bad_ids_poison_their_row():
    case = Case(4, 40, "float32", seed=9)
    case.mask = torch.ones(4, dtype=torch.bool)
    case.ids[1], case.ids[2] = -1, 40
    ratio, kl, grad = case.run(use_ref_logits=True, kl_code=3, check_ids=False)
    assert np.isnan(ratio[[1, 2]]).all() and np.isnan(kl[[1, 2]]).all()
    assert np.isfinite(ratio[[0, 3]]).all()
    assert torch.isnan(grad[1:3]).all() and torch.isfinite(grad[[0, 3]]).all()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_selected_logprobs_strided_logits(dtype):
    rng = np.random.default_rng(2)
    base = torch.tensor(rng.normal(size=(70, 12)) * 4, dtype=torch.float32).to(DTYPES[dtype])
    leaf = base.t()[::2].detach().requires_grad_(True)  # [6, 70], strides (2, 12): no copy
    assert leaf.stride() == (2, 12)
    ids = torch.tensor(rng.integers(0, 70, 6))
    mask = torch.tensor([True, True, False, True, True, True])
    g = torch.tensor(rng.normal(size=6), dtype=torch.float32)
    logp = _triton.selected_logprobs(leaf, ids, mask, 0.8)
    (logp * g).sum().backward()
    x = leaf.detach().float().numpy().astype(np.float64)
    e_logp = spec.selected_logprobs(x, ids.numpy(), mask.numpy(), temperature=0.8)
    e_grad = spec.selected_logprobs_grad(x, ids.numpy(), mask.numpy(), g.numpy(), temperature=0.8)
    scale = np.abs(x).max() / 0.8
    assert_close(logp.detach().numpy(), e_logp, spec.forward_tolerance(scale), "logp")
    assert_close(leaf.grad.float().numpy(), e_grad,
                  spec.grad_tolerance(dtype, scale, np.abs(e_grad).max()), "grad")


def test_empty_and_all_inactive():
    empty = torch.zeros((0, 9), requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    ratio, kl = _triton.ratio_kl(empty, empty.detach(), none, none.bool(), none.float(), None,
                                 3, 1.0)
    assert ratio.shape == kl.shape == (0,)
    case = Case(3, 20, "float32")
    case.mask = torch.zeros(3, dtype=torch.bool)
    ratio, kl, grad = case.check()
    assert (ratio == 1).all() and (kl == 0).all() and torch.equal(grad, torch.zeros_like(grad))


def test_bitwise_deterministic():
    case = Case(4, 700, "bfloat16", seed=4)
    first, second = case.run(True, 3), case.run(True, 3)
    for a, b in zip(first, second):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_through_public_loss_and_torch_compile():
    from ratiokl.torch import loss

    case = Case(6, 33, "float32", seed=12)
    policy = case.policy.reshape(2, 3, 33)
    args = (policy, case.ref.reshape(2, 3, 33), case.ids.reshape(2, 3), case.mask.reshape(2, 3),
            case.old.reshape(2, 3))
    eager = loss.ratio_kl(*args, backend="interpret")
    compiled = torch.compile(
        lambda *a: loss.ratio_kl(*a, backend="interpret", check_ids=False),
        backend="aot_eager", fullgraph=True,
    )(*args)
    e_ratio, _, _ = case.expected(True, 3)
    assert_close(eager[0].reshape(-1).numpy(), e_ratio, spec.forward_tolerance(case.scale()), "ratio")
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# --- the JAX binding, through backend="interpret" -------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_wrapper_jit_vmap_grad(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    case = Case(6, 45, dtype, seed=21)
    case.temperature = 1.3
    x = jnp.asarray(case.np(case.policy).reshape(2, 3, 45), dtype=jnp.dtype(dtype))
    r = jnp.asarray(case.np(case.ref).reshape(2, 3, 45), dtype=jnp.dtype(dtype))
    rows = [jnp.asarray(t.numpy().reshape(2, 3)) for t in
            (case.ids, case.mask, case.old, case.g_ratio, case.g_kl)]
    ids, mask, old, g_ratio, g_kl = rows

    def per_sequence(x, r, ids, mask, old):
        return jax_loss.ratio_kl(x, r, ids, mask, old, kl_estimator="k3", temperature=1.3,
                                 backend="interpret", check_ids=False)

    def objective(x):
        ratio, kl = jax.vmap(per_sequence)(x, r, ids, mask, old)
        return jnp.sum(ratio * g_ratio + kl * g_kl), (ratio, kl)

    grad, (ratio, kl) = jax.jit(jax.grad(objective, has_aux=True))(x)
    assert grad.dtype == x.dtype
    e_ratio, e_kl, e_grad = case.expected(True, 3)
    fwd = spec.forward_tolerance(case.scale())
    assert_close(np.asarray(ratio).reshape(-1), e_ratio, fwd, "ratio")
    assert_close(np.asarray(kl).reshape(-1), e_kl, fwd, "kl")
    assert_close(np.asarray(grad, np.float32).reshape(6, 45), e_grad,
                  spec.grad_tolerance(dtype, case.scale(), np.abs(e_grad).max()), "grad")


def test_jax_wrapper_matches_torch_bitwise():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    case = Case(5, 30, "float32", seed=22)
    case.ids[2] = 99  # unchecked bad id: NaN in both
    torch_logp = _triton.selected_logprobs(case.policy, case.ids, case.mask, 0.7)
    jax_logp = jax.jit(lambda x: jax_loss.selected_logprobs(
        x, jnp.asarray(case.ids.numpy()), jnp.asarray(case.mask.numpy()), temperature=0.7,
        backend="interpret", check_ids=False))(jnp.asarray(case.policy.numpy()))
    assert np.isnan(np.asarray(jax_logp)[2])
    np.testing.assert_array_equal(np.asarray(jax_logp), torch_logp.numpy())
