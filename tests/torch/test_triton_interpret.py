"""The Triton kernels through Triton's CPU interpreter, against ``ratiokl.spec``.

``backend="interpret"`` runs the very kernel functions that the GPU runs
(``ratiokl._kernels``), so this file is where CI checks the kernels' math:
forward and gradient in fp32/fp16/bf16, each KL estimator, reference logits
or log-probs, per-row temperature, inactive rows holding garbage, ``-inf``
vocabulary masking, NaN rows, unchecked bad ids, tiny and multi-block
vocabularies and strided logits. The JAX binding's tests run the same cases
(``tests/helpers/ratio_kl_cases.py``, ``tests/jax/test_triton_interpret.py``).
Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl import spec  # noqa: E402
from ratiokl._kernels import forward_config  # noqa: E402
from ratiokl.torch import _triton  # noqa: E402
from assertions import assert_close  # noqa: E402
from ratio_kl_cases import DTYPES, Case  # noqa: E402


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
