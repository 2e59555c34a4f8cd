"""``loss_agg="none"``: the per-token loss ``[...]`` of ``policy_loss`` and ``linear_policy_loss``.

One body for both frameworks on their CPU backends (native, interpret): the values and the
gradient for a random per-token upstream gradient against the float64 spec; every other
mode's loss is the per-token loss summed with that mode's weights; inactive rows hold 0 and
get an exactly zero gradient even when their upstream gradient is NaN; the chunked linear
route equals the materialised one; ``loss_normalizer`` is refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl import spec
from assertions import assert_close

B, T, V, H = 3, 6, 13, 5
OPTIONS = {"kl_coef": 0.2, "entropy_coef": 0.1, "clip_eps": 0.2}
TARGETS = [("torch", "native"), ("torch", "interpret"), ("jax", "native"), ("jax", "interpret")]


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.7
    mask[0] = True
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    logits[~mask] = np.nan  # garbage the loss must never read
    ids = rng.integers(0, V, (B, T))
    logp = spec.selected_logprobs(np.nan_to_num(logits), ids, mask)
    old = (logp + rng.normal(0.0, 0.1, (B, T))).astype(np.float32)
    ref = (logp + rng.normal(0.0, 0.1, (B, T))).astype(np.float32)
    return dict(logits=logits, ids=ids, mask=mask, old=old, ref=ref,
                adv=rng.normal(size=B).astype(np.float32),
                cot=rng.normal(size=(B, T)).astype(np.float32),
                hidden=rng.normal(size=(B, T, H)).astype(np.float32),
                weight=rng.normal(0.0, 0.7, (V, H)).astype(np.float32))


def _call(framework: str, backend: str, x, options, cot=None, linear: bool = False):
    """``(loss, grad)``: the per-token loss and the gradient of ``sum(cot * loss)`` w.r.t. the
    logits (or, ``linear``, w.r.t. hidden and weight), as NumPy."""
    cot = x["cot"] if cot is None else cot
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        t = {k: torch.tensor(v) for k, v in x.items()}
        if linear:
            leaves = (t["hidden"].requires_grad_(), t["weight"].requires_grad_())
            value, _ = loss.linear_policy_loss(
                *leaves, t["ids"], t["mask"], t["old"], t["adv"], ref_logps=t["ref"],
                chunk_rows=4, backend=backend, **options)
        else:
            leaves = (t["logits"].requires_grad_(),)
            value, _ = loss.policy_loss(leaves[0], None, t["ids"], t["mask"], t["old"], t["adv"],
                                        ref_logps=t["ref"], backend=backend, **options)
        grads = torch.autograd.grad(value, leaves, torch.tensor(cot))
        return value.detach().numpy(), [g.numpy() for g in grads]
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    j = {k: jnp.asarray(v) for k, v in x.items()}

    def fn(*leaves):
        if linear:
            return loss.linear_policy_loss(*leaves, j["ids"], j["mask"], j["old"], j["adv"],
                                           ref_logps=j["ref"], chunk_rows=4, backend=backend,
                                           **options)[0]
        return loss.policy_loss(leaves[0], None, j["ids"], j["mask"], j["old"], j["adv"],
                                ref_logps=j["ref"], backend=backend, **options)[0]

    leaves = (j["hidden"], j["weight"]) if linear else (j["logits"],)
    value, vjp = jax.vjp(jax.jit(fn), *leaves)
    return np.asarray(value), [np.asarray(g) for g in vjp(jnp.asarray(cot))]


def _skip_unavailable(framework: str):
    pytest.importorskip(framework)
    pytest.importorskip("triton")


@pytest.mark.parametrize("framework, backend", TARGETS)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_per_token_loss_and_gradient_match_the_spec(framework, backend, level):
    _skip_unavailable(framework)
    x = _inputs(1)
    options = {**OPTIONS, "loss_agg": "none", "ratio_level": level}
    value, (grad,) = _call(framework, backend, x, options)
    args = (x["logits"].astype(np.float64), None, x["ids"], x["mask"], x["old"], x["adv"])
    expected, _ = spec.policy_loss(*args, ref_logps=x["ref"], **options)
    expected_grad = spec.policy_loss_grad(*args, ref_logps=x["ref"], loss_cotangent=x["cot"],
                                          **options)
    assert value.shape == (B, T) and value.dtype == np.float32
    assert np.all(value[~x["mask"]] == 0.0)
    scale = float(np.abs(np.nan_to_num(x["logits"])).max())
    assert_close(value, expected, spec.forward_tolerance(scale))
    assert_close(grad, expected_grad,
                 spec.grad_tolerance("float32", scale, float(np.abs(expected_grad).max())))


@pytest.mark.parametrize("framework, backend", TARGETS)
def test_every_mode_is_the_per_token_loss_weighted(framework, backend):
    """``loss_mode == sum_t (a_t / D) * loss_none_t`` (the spec's module docstring)."""
    _skip_unavailable(framework)
    x = _inputs(2)
    mask = x["mask"]
    per_token, _ = _call(framework, backend, x, {**OPTIONS, "loss_agg": "none"})
    lengths = mask.sum(-1, keepdims=True)
    n_seq = int((lengths > 0).sum())
    weights = {
        "token-mean": mask / mask.sum(),
        "token-sum": mask * 1.0,
        "seq-mean-token-mean": mask / np.maximum(lengths, 1) / n_seq,
        "seq-mean-token-sum": mask / n_seq,
        "seq-mean-token-sum-norm": mask / T,
    }
    assert set(weights) == set(spec.LOSS_AGGS) - {"none"}
    for agg, w in weights.items():
        value, _ = _call(framework, backend, x, {**OPTIONS, "loss_agg": agg}, cot=np.float32(1))
        assert_close(np.float64(value), (per_token * w).sum(), spec.forward_tolerance(1.0))


@pytest.mark.parametrize("framework, backend", TARGETS)
def test_nan_upstream_on_inactive_rows_never_reaches_the_gradient(framework, backend):
    _skip_unavailable(framework)
    x = _inputs(3)
    cot = np.where(x["mask"], x["cot"], np.nan).astype(np.float32)
    _, (grad,) = _call(framework, backend, x, {**OPTIONS, "loss_agg": "none"}, cot=cot)
    assert np.all(grad[~x["mask"]] == 0.0)
    assert np.isfinite(grad[x["mask"]]).all()


@pytest.mark.parametrize("framework, backend", TARGETS)
def test_linear_policy_loss_per_token_matches_the_materialised_logits(framework, backend):
    """The chunked route (log-probs, then the objective) against ``policy_loss`` on
    ``hidden @ weight.T``: values and the hidden / weight gradients."""
    _skip_unavailable(framework)
    x = _inputs(4)
    options = {**OPTIONS, "loss_agg": "none"}
    value, (g_hidden, g_weight) = _call(framework, backend, x, options, linear=True)
    kept = np.where(x["mask"][..., None], x["hidden"].astype(np.float64), 0.0)
    logits = kept @ x["weight"].astype(np.float64).T
    args = (logits, None, x["ids"], x["mask"], x["old"], x["adv"])
    expected, _ = spec.policy_loss(*args, ref_logps=x["ref"], **options)
    dlogits = spec.policy_loss_grad(*args, ref_logps=x["ref"], loss_cotangent=x["cot"],
                                    **options)
    scale = float(np.abs(logits).max())
    assert_close(value, expected, spec.forward_tolerance(scale))
    tol = spec.linear_grad_tolerance("float32", scale, float(
        np.abs(dlogits).reshape(-1, V).sum(0).max() * np.abs(kept).max() * B * T))
    assert_close(g_hidden, dlogits @ x["weight"].astype(np.float64), tol)
    assert_close(g_weight, np.einsum("btv,bth->vh", dlogits, kept), tol)
    assert np.all(g_hidden[~x["mask"]] == 0.0)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_normalizer_is_refused(framework):
    _skip_unavailable(framework)
    x = _inputs(5)
    with pytest.raises(ValueError, match="loss_normalizer"):
        _call(framework, "native", x, {**OPTIONS, "loss_agg": "none", "loss_normalizer": 8.0})
