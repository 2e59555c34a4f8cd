"""The Triton kernels through Triton's CPU interpreter, against ``ratiokl.spec``, one body per
behaviour run on both bindings (``torch-interpret``, ``jax-interpret``).

``backend="interpret"`` runs the very kernel functions that the GPU runs
(``ratiokl._kernels``), so this file is where CI checks the kernels' math and each
framework's binding of them: forward and gradient in fp32/fp16/bf16, each KL estimator,
reference logits or log-probs, per-row temperature, inactive rows holding garbage, ``-inf``
vocabulary masking, NaN rows, unchecked bad ids, tiny and multi-block vocabularies, empty
and all-inactive batches, determinism (the cases: ``tests/helpers/ratio_kl_cases.py``).
The binding-only behaviours stay in ``tests/torch/test_triton_interpret.py`` (strided
logits, ``torch.compile``) and ``tests/jax/test_triton_interpret.py`` (``jit`` / ``vmap``,
bitwise against PyTorch). Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratio_kl_cases import DTYPES, Case  # noqa: E402

from ratiokl import spec  # noqa: E402
from ratiokl._kernels import forward_config  # noqa: E402


def _framework(target: str) -> str:
    return target.split("-")[0]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kl_code", [1, 2, 3])
def test_ratio_kl_matches_spec(interpret_target, dtype, kl_code):
    Case(6, 300, dtype, seed=kl_code).check(use_ref_logits=True, kl_code=kl_code,
                                            framework=_framework(interpret_target))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ref_logps_and_per_row_temperature(interpret_target, dtype):
    case = Case(6, 300, dtype, seed=7, scale=1.0)  # exp(d) of the k3 gradient fits fp16
    case.temperature = torch.tensor([0.5, 1.0, 1.7, 0.9, 2.0, 1.1])
    case.ref_logps = torch.tensor(spec.selected_logprobs(
        case.np(case.ref), case.ids.numpy(), None, temperature=case.np(case.temperature)
    ), dtype=torch.float32)
    case.check(use_ref_logits=False, kl_code=3, framework=_framework(interpret_target))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_block_vocabulary(interpret_target, dtype):
    block = forward_config(10_000, DTYPES[dtype].itemsize).block_v
    vocab = 2 * block + 37  # two unmasked blocks and a ragged tail
    Case(3, vocab, dtype, seed=3).check(use_ref_logits=True, kl_code=3,
                                        framework=_framework(interpret_target))


@pytest.mark.parametrize("vocab", [1, 2, 5])
def test_tiny_vocabulary(interpret_target, vocab):
    Case(5, vocab, "float32", seed=vocab).check(use_ref_logits=True, kl_code=3,
                                                framework=_framework(interpret_target))


def test_inactive_rows_hold_garbage(interpret_target):
    case = Case(6, 64, "float32", seed=11)
    case.mask = torch.tensor([True, False, True, False, False, True])
    case.policy[1] = float("nan")
    case.policy[3] = float("inf")
    case.ref[4] = -float("inf")
    case.ids[1], case.ids[3], case.ids[4] = -3, 64, 10**9
    case.old[3] = float("nan")
    case.g_ratio[4] = float("nan")
    ratio, kl, grad = case.check(use_ref_logits=True, kl_code=3,
                                 framework=_framework(interpret_target))
    inactive = ~case.mask.numpy()
    np.testing.assert_array_equal(ratio[inactive], 1.0)
    np.testing.assert_array_equal(kl[inactive], 0.0)
    np.testing.assert_array_equal(grad[inactive], 0.0)


def test_inf_masking_and_nan_rows(interpret_target):
    case = Case(4, 50, "bfloat16", seed=5)
    case.mask = torch.ones(4, dtype=torch.bool)
    case.policy[0, 1::2] = -float("inf")  # vocabulary masking: valid
    case.ids[0] = 0
    case.policy[2, 7] = float("nan")  # invalid distribution: NaN row only
    ratio, kl, grad = case.check(use_ref_logits=True, kl_code=3,
                                 framework=_framework(interpret_target))
    assert np.isfinite(ratio[[0, 1, 3]]).all() and np.isnan(ratio[2])
    assert np.isfinite(grad[0]).all() and np.isnan(grad[2]).all()


def test_unchecked_bad_ids_poison_their_row(interpret_target):
    case = Case(4, 40, "float32", seed=9)
    case.mask = torch.ones(4, dtype=torch.bool)
    case.ids[1], case.ids[2] = -1, 40
    ratio, kl, grad = case.run(use_ref_logits=True, kl_code=3, check_ids=False,
                               framework=_framework(interpret_target))
    assert np.isnan(ratio[[1, 2]]).all() and np.isnan(kl[[1, 2]]).all()
    assert np.isfinite(ratio[[0, 3]]).all()
    assert np.isnan(grad[1:3]).all() and np.isfinite(grad[[0, 3]]).all()


def test_empty_and_all_inactive(interpret_target):
    ratio, kl, grad = Case(0, 9, "float32").run(True, 3, framework=_framework(interpret_target))
    assert ratio.shape == kl.shape == (0,) and grad.shape == (0, 9)
    case = Case(3, 20, "float32")
    case.mask = torch.zeros(3, dtype=torch.bool)
    ratio, kl, grad = case.check(framework=_framework(interpret_target))
    assert (ratio == 1).all() and (kl == 0).all() and (grad == 0).all()


def test_bitwise_deterministic(interpret_target):
    case = Case(4, 700, "bfloat16", seed=4)
    first, second = (case.run(True, 3, framework=_framework(interpret_target)) for _ in "12")
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
