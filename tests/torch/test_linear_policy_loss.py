"""``linear_policy_loss``: the policy loss from hidden states and the lm_head weight, in row
chunks, through Triton's CPU interpreter (``backend="interpret"``).

Every case is checked against the materialised route on the same data -- ``logits =
hidden @ weight.T``, :func:`policy_loss`, autograd for ``d hidden`` and ``d weight`` -- with
the inactive rows' hidden states zeroed there (the materialised step would otherwise leak
their NaN into ``d weight``, which the chunked path must not). One chunk covering every row
runs the very GEMM and kernel of the materialised route: the loss and metrics must match
bit for bit. The head's options, the native backend and the errors, on both frameworks:
``tests/test_linear_policy_loss.py``. Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402

B, T, H, V = 3, 8, 16, 300  # 24 rows
#: ``max |h @ W.T / T|``: normal hidden states, a 0.3-scaled weight, temperatures >= 0.5.
LOGIT_SCALE = 10.0


def _data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    old = torch.randn(B, T, generator=g) * 0.1 - 5.0
    ref = torch.randn(B, T, generator=g) * 0.1 - 5.0
    adv = torch.randn(B, generator=g)
    return hidden, weight, ids, mask, old, ref, adv


def _materialised(hidden, weight, ids, mask, old, adv, upstream=1.0, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    logits = torch.where(mask[..., None], h, torch.zeros((), dtype=h.dtype)) @ w.t()
    value, metrics = loss.policy_loss(logits, None, ids, mask, old, adv, backend="interpret",
                                      **kw)
    (value * upstream).backward()
    return value, metrics, h.grad, w.grad


def _chunked(hidden, weight, ids, mask, old, adv, upstream=1.0, chunk_rows=5, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    value, metrics = loss.linear_policy_loss(h, w, ids, mask, old, adv, chunk_rows=chunk_rows,
                                             backend="interpret", **kw)
    (value * upstream).backward()
    return value, metrics, h.grad, w.grad


def _close(got, want, what, terms=B * T):
    """Chunked against materialised, both float32: ``terms`` summands behind each value (the
    loss and metrics: tokens; d hidden: the vocabulary; d weight: the rows)."""
    assert_close(got, want, spec.paths_tolerance(terms, float(want.abs().max())), what)


def _close_low(got, want, what):
    """Chunked against materialised in a 16-bit dtype: each side's logits are rounded to it
    (:func:`ratiokl.spec.linear_grad_tolerance` of the larger side)."""
    dtype = str(want.dtype).removeprefix("torch.")
    tol = spec.linear_grad_tolerance(dtype, LOGIT_SCALE, float(want.float().abs().max()))
    assert_close(got, want, tol, what)


CASES = {
    "defaults": {},
    "kl-entropy": dict(kl_coef=0.05, entropy_coef=0.01, clip_eps_high=0.28),
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean", dual_clip=3.0),
    "cispo-iw": dict(objective="cispo", kl_coef=0.1, kl_estimator="k1"),
    "rollout-truncate": dict(rollout_correction="token-truncate"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_materialised(case):
    hidden, weight, ids, mask, old, ref, adv = _data()
    kw = dict(CASES[case], ref_logps=ref)
    if case == "cispo-iw":
        kw["importance_weights"] = torch.rand(B, T) + 0.5
    if case == "rollout-truncate":
        kw["rollout_logps"] = old + 0.05 * torch.randn(B, T)
    want = _materialised(hidden, weight, ids, mask, old, adv, **kw)
    got = _chunked(hidden, weight, ids, mask, old, adv, chunk_rows=7, **kw)  # 7+7+7+3
    _close(got[0], want[0], "loss")
    assert set(got[1]) == set(want[1])
    for name in want[1]:
        _close(got[1][name], want[1][name], name)
    _close(got[2], want[2], "d hidden", V)
    _close(got[3], want[3], "d weight")


def test_one_chunk_is_the_materialised_route_bit_for_bit():
    hidden, weight, ids, mask, old, ref, adv = _data()
    hidden = torch.where(mask[..., None], hidden, 0.0)  # the materialised side zeroes them
    want = _materialised(hidden, weight, ids, mask, old, adv, ref_logps=ref, kl_coef=0.05)
    got = _chunked(hidden, weight, ids, mask, old, adv, chunk_rows=B * T, ref_logps=ref,
                   kl_coef=0.05)
    assert torch.equal(got[0], want[0])
    for name in want[1]:
        assert torch.equal(got[1][name], want[1][name]), name


def test_bf16_per_token_advantages_temperature_and_upstream():
    """``logits_dtype="input"``: the chunks round their logits to bf16 as the materialised
    bf16 GEMM does (a bf16 head, reproduced)."""
    hidden, weight, ids, mask, old, ref, adv = _data(torch.bfloat16, seed=1)
    adv = torch.randn(B, T)
    temp = torch.rand(B, T) + 0.5
    kw = dict(ref_logps=ref, kl_coef=0.02, temperature=temp, upstream=2.5)
    want = _materialised(hidden, weight, ids, mask, old, adv, **kw)
    got = _chunked(hidden, weight, ids, mask, old, adv, chunk_rows=16, logits_dtype="input",
                   **kw)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    for what, a, b in zip(("loss", "d hidden", "d weight"), got[:1] + got[2:],
                          want[:1] + want[2:]):
        _close_low(a, b, what)


def test_inactive_rows_hold_garbage():
    hidden, weight, ids, mask, old, ref, adv = _data(seed=2)
    clean = _chunked(hidden, weight, ids, mask, old, adv, ref_logps=ref, kl_coef=0.05)
    dirty = hidden.clone()
    dirty[~mask] = float("nan")
    dirty[0, ~mask[0]] = float("inf")
    bad_ids = ids.clone()
    bad_ids[~mask] = V + 7  # out of range where inactive: never read
    got = _chunked(dirty, weight, bad_ids, mask, old, adv, ref_logps=ref, kl_coef=0.05)
    assert torch.isfinite(got[0]) and torch.isfinite(got[3]).all()
    assert torch.equal(got[2][~mask], torch.zeros_like(got[2][~mask]))
    for what, a, b in zip(("loss", "d hidden", "d weight"), got[:1] + got[2:],
                          clean[:1] + clean[2:]):
        assert torch.equal(a, b), what  # the garbage is never read: the same bits


def test_gradient_of_one_input_and_no_gradient():
    hidden, weight, ids, mask, old, ref, adv = _data(seed=3)
    full = _chunked(hidden, weight, ids, mask, old, adv)
    h = hidden.clone().requires_grad_()
    value, _ = loss.linear_policy_loss(h, weight, ids, mask, old, adv, chunk_rows=5,
                                       backend="interpret")
    value.backward()
    assert torch.equal(value, full[0]) and torch.equal(h.grad, full[2])
    w = weight.clone().requires_grad_()
    value, _ = loss.linear_policy_loss(hidden, w, ids, mask, old, adv, chunk_rows=5,
                                       backend="interpret")
    value.backward()
    assert torch.equal(value, full[0]) and torch.equal(w.grad, full[3])
    with torch.no_grad():
        value, metrics = loss.linear_policy_loss(hidden, weight, ids, mask, old, adv,
                                                 chunk_rows=5, backend="interpret")
    assert torch.equal(value, full[0]) and not value.requires_grad
    assert metrics["ratio_mean"].item() == pytest.approx(full[1]["ratio_mean"].item())


def test_bad_active_id_raises():
    hidden, weight, ids, mask, old, ref, adv = _data(seed=5)
    ids = ids.clone()
    mask = mask.clone()
    mask[1, 2] = True
    ids[1, 2] = V
    with pytest.raises(ValueError, match="action_ids"):
        loss.linear_policy_loss(hidden, weight, ids, mask, old, adv, backend="interpret")


@pytest.mark.parametrize("backend", ["interpret", "native"])
def test_inactive_garbage_stays_out_of_the_bias_gradient(backend):
    hidden, weight, ids, mask, old, ref, adv = _data(seed=8)
    bias = torch.randn(V)

    def run(h_in, ids_in):
        h, w, b = (t.clone().requires_grad_() for t in (h_in, weight, bias))
        value, _ = loss.linear_policy_loss(h, w, ids_in, mask, old, adv, bias=b,
                                           logit_scale=2.0, logit_softcap=5.0, chunk_rows=5,
                                           backend=backend)
        value.backward()
        return value, h.grad, w.grad, b.grad

    clean = run(hidden, ids)
    dirty_h = hidden.clone()
    dirty_h[~mask] = float("nan")
    dirty_ids = torch.where(mask, ids, torch.full_like(ids, V + 3))
    dirty = run(dirty_h, dirty_ids)
    assert not dirty[1][~mask].any()
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
