"""The few-rows split forward and the split backward, through Triton's CPU interpreter.

With a tiny tile (16) and ``max_splits`` of 2 or 3, a row of 100 logits is
cut into spans whose last one holds only the masked tail (or a few whole
tiles and the tail). The split path (``lse_partials_kernel`` +
``logp_combine_kernel``) must give bitwise the outputs of the one-program-
per-row kernel -- the batch-invariance argument of ``heuristics.split_plan``
-- on ordinary, inactive-garbage, ``-inf``-masked, ``+inf`` and bad-id rows,
and match ``ratiokl.spec``; the backward on a ``(rows, spans)`` grid matches
the spec gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._kernels import LaunchConfig, interpreted, split_plan  # noqa: E402
from ratiokl.torch import _launch  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

VOCAB = 100
CONFIG = LaunchConfig(block_v=16, num_warps=1)  # 6 whole tiles and a tail of 4 (V = 100)


def _inputs(seed: int, vocab: int = VOCAB):
    rng = np.random.default_rng(seed)
    n = 6
    policy = torch.tensor(rng.normal(size=(n, vocab)) * 3.0, dtype=torch.float32)
    ref = torch.tensor(rng.normal(size=(n, vocab)) * 3.0, dtype=torch.float32)
    ids = torch.tensor(rng.integers(0, vocab, n))
    mask = torch.tensor([True, True, False, True, True, True])
    old = torch.tensor(rng.normal(size=n) - 2.0, dtype=torch.float32)
    temp = torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 2.0], dtype=torch.float32)
    return policy, ref, ids, mask, old, temp


def _forward(policy, ref, ids, mask, old, temp, max_splits: int, split: bool):
    with np.errstate(all="ignore"):
        return _launch.row_forward(
            interpreted, policy, ref, ids, mask, old, None, temp, 3, config=CONFIG,
            plan=split_plan(policy.shape[1], CONFIG.block_v, max_splits), split=split,
        )


# (100, 2): spans of 4 and 2 tiles + tail; (100, 3): the last span is the tail alone;
# (96, 3): no tail, three spans of 2 whole tiles.
@pytest.mark.parametrize("vocab, max_splits, splits", [(100, 2, 2), (100, 3, 3), (96, 3, 3)])
def test_split_forward_is_bitwise_the_row_kernel(vocab, max_splits, splits):
    policy, ref, ids, mask, old, temp = _inputs(seed=max_splits, vocab=vocab)
    policy[2] = float("nan")  # inactive garbage: never read
    policy[3, 90:] = -float("inf")  # masked vocabulary, partly in the tail
    policy[4, 50] = float("inf")
    ids[5] = vocab + 3  # active bad id: poisoned
    assert split_plan(vocab, CONFIG.block_v, max_splits).splits == splits
    split = _forward(policy, ref, ids, mask, old, temp, max_splits, split=True)
    whole = _forward(policy, ref, ids, mask, old, temp, max_splits, split=False)
    for name, a, b in zip(("logp", "ratio", "kl", "dkl", "lse"), split, whole):
        np.testing.assert_array_equal(a.view(torch.int32), b.view(torch.int32), err_msg=name)
    assert torch.isnan(split[0][5]) and split[0][2] == 0.0 and split[1][2] == 1.0


def _entropy_forward(policy, ids, mask, temp, max_splits: int, split: bool):
    with np.errstate(all="ignore"):
        return _launch.logprobs._forward_launch(
            interpreted, policy, None, ids, mask, None, None, temp, 0, True, CONFIG,
            split_plan(policy.shape[1], CONFIG.block_v, max_splits), split)


@pytest.mark.parametrize("vocab, max_splits", [(100, 2), (100, 3), (96, 3)])
def test_entropy_split_forward_is_bitwise_the_row_kernel_and_the_spec(vocab, max_splits):
    """ENTROPY mode: the split path's (logp, entropy, lse) are the row kernel's bits, the
    entropy the spec's (``-inf`` entries add 0, an inactive garbage row gives 0)."""
    policy, _, ids, mask, _, temp = _inputs(seed=max_splits + 10, vocab=vocab)
    policy[2] = float("nan")  # inactive garbage: never read
    policy[3, 90:] = -float("inf")  # masked vocabulary, partly in the tail
    policy[4, :40] = -float("inf")  # a whole span masked
    split = _entropy_forward(policy, ids, mask, temp, max_splits, split=True)
    whole = _entropy_forward(policy, ids, mask, temp, max_splits, split=False)
    for name, a, b in zip(("logp", "ratio", "entropy", "entropy (dkl)", "lse"), split, whole):
        np.testing.assert_array_equal(a.view(torch.int32), b.view(torch.int32), err_msg=name)
    f64 = policy.numpy().astype(np.float64)
    want = spec.entropy(f64, mask.numpy(), temperature=temp.numpy().astype(np.float64))
    tol = spec.forward_tolerance(float(np.nanmax(np.abs(f64[np.isfinite(f64)])) / temp.min()))
    assert_close(split[2], want, tol, "entropy")
    assert split[2][2] == 0.0


def test_split_forward_and_backward_match_spec():
    policy, ref, ids, mask, old, temp = _inputs(seed=5)
    logp, ratio, kl, _, lse = _forward(policy, ref, ids, mask, old, temp, 3, split=True)
    f64 = lambda t: t.numpy().astype(np.float64)  # noqa: E731
    args = (f64(policy), f64(ref), ids.numpy(), mask.numpy(), f64(old))
    e_ratio, e_kl = spec.ratio_kl(*args, kl_estimator="k3", temperature=f64(temp))
    e_logp = spec.selected_logprobs(f64(policy), ids.numpy(), mask.numpy(), temperature=f64(temp))
    scale = float(np.abs(f64(policy)).max() / temp.min())
    tol = spec.forward_tolerance(scale)
    for name, got, want in (("logp", logp, e_logp), ("ratio", ratio, e_ratio), ("kl", kl, e_kl)):
        assert_close(got, want, tol, name)

    coef = torch.linspace(-1.0, 1.0, len(ids), dtype=torch.float32)
    with np.errstate(all="ignore"):  # small row count: one program per tile of a row
        grad = _launch.row_backward(
            interpreted, policy, ids, mask, temp, lse, coef, config=CONFIG)
    e_grad = spec.selected_logprobs_grad(
        f64(policy), ids.numpy(), mask.numpy(), f64(coef), temperature=f64(temp))
    gtol = spec.grad_tolerance("float32", scale, float(np.abs(e_grad).max()))
    assert_close(grad, e_grad, gtol, "grad")
    assert torch.all(grad[2] == 0.0)


def test_fused_loss_plan_splits_rows_only_where_it_pays():
    from ratiokl._kernels.heuristics import launch_plan

    v = 151_936
    with_grad = launch_plan(v, 2, 8192, True)
    assert with_grad.spans.splits > 1 and with_grad.spans_per_program == 1  # re-read from L2
    assert with_grad.programs(8192) == 8192 * with_grad.spans.splits
    no_grad = launch_plan(v, 2, 8192, False)  # nothing to re-read, rows fill the GPU
    assert no_grad.spans == with_grad.spans and no_grad.programs(8192) == 8192
    assert no_grad.row_programs == 1 and with_grad.row_programs == with_grad.spans.splits
    assert no_grad.counters(8192) == 0 and with_grad.counters(8192) == 8193  # + work counter
    assert launch_plan(v, 2, 128, False).spans_per_program == 1  # few rows: split them
    assert launch_plan(40_000, 4, 3, True).row_programs > 1  # the interpreter meets too
