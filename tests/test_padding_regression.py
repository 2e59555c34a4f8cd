"""The bug that started ratiokl: padding rows poisoning a shared weight's gradient.

Finite hidden states ``[6, 4]`` times a trainable weight ``[4, 17]`` give the
logits; three inactive (padding) rows get NaN or ``-inf`` added, and hold
out-of-range ids (-100, the usual ignore index). Masking by multiplication
turns ``0 * NaN`` into NaN in the weight's gradient; ratiokl must give the
weight exactly the gradient of an independent reference that only ever sees
the active rows (plain ``log_softmax`` on ``h[active] @ W``).
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import assert_close
from ratiokl import harness, spec

ROWS, HIDDEN, VOCAB = 6, 4, 17
ACTIVE = np.array([True, False, True, True, False, False])
IDS = np.array([3, -100, 16, 0, 17, -100])
RNG = np.random.default_rng(7)
H = RNG.normal(size=(ROWS, HIDDEN)).astype(np.float32)
W = RNG.normal(size=(HIDDEN, VOCAB)).astype(np.float32)
OLD = np.where(ACTIVE, -2.5, np.nan).astype(np.float32)
REF = np.where(ACTIVE, -2.0, np.nan).astype(np.float32)
ADV = np.where(ACTIVE, [1.5, 0.0, -0.7, 2.0, 0.0, 0.0], np.nan).astype(np.float32)
G_OUT = RNG.normal(size=(2, ROWS)).astype(np.float32)  # upstream cotangents (ratio/logp, kl)
#: ``max |H @ W|``, the float32 logits' magnitude.
LOGIT_SCALE = float(np.abs(H @ W).max())


def _pad(value: float) -> np.ndarray:
    pad = np.zeros((ROWS, VOCAB), np.float32)
    pad[~ACTIVE] = value
    return pad


def _torch_grad(target: str, op: str, pad_value: float, strided: bool):
    import torch

    from ratiokl.torch import loss

    backend = harness.TARGETS[target].backend
    w = torch.tensor(W, requires_grad=True)
    logits = torch.tensor(H) @ w + torch.tensor(_pad(pad_value))
    if strided:  # interleave with NaN columns and view every other one: last-dim stride 2
        logits = torch.stack([logits, torch.full_like(logits, float("nan"))], -1).flatten(-2)[:, ::2]
        assert not logits.is_contiguous()
    ids, mask, g = torch.tensor(IDS), torch.tensor(ACTIVE), torch.tensor(G_OUT)
    if op == "selected_logprobs":
        total = (g[0] * loss.selected_logprobs(logits, ids, mask, backend=backend)).sum()
    elif op == "selected_logprobs_entropy":
        logp, ent = loss.selected_logprobs(logits, ids, mask, backend=backend,
                                           return_entropy=True)
        total = (g[0] * logp + g[1] * ent).sum()
    elif op == "policy_loss_cispo":
        total = loss.policy_loss(logits, None, ids, mask, torch.tensor(OLD), torch.tensor(ADV),
                                 objective="cispo", backend=backend)[0]
    else:
        ratio, kl = loss.ratio_kl(logits, None, ids, mask, torch.tensor(OLD),
                                  ref_logps=torch.tensor(REF), backend=backend)
        total = (g[0] * ratio + g[1] * kl).sum()
    total.backward()
    return w.grad.numpy()


def _jax_grad(target: str, op: str, pad_value: float, strided: bool):
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    backend = harness.TARGETS[target].backend
    ids, mask, g = jnp.asarray(IDS, jnp.int32), jnp.asarray(ACTIVE), jnp.asarray(G_OUT)

    def total(w):
        logits = jnp.asarray(H) @ w + jnp.asarray(_pad(pad_value))
        if op == "selected_logprobs":
            return jnp.sum(g[0] * loss.selected_logprobs(logits, ids, mask, backend=backend))
        if op == "selected_logprobs_entropy":
            logp, ent = loss.selected_logprobs(logits, ids, mask, backend=backend,
                                               return_entropy=True)
            return jnp.sum(g[0] * logp + g[1] * ent)
        if op == "policy_loss_cispo":
            return loss.policy_loss(logits, None, ids, mask, jnp.asarray(OLD), jnp.asarray(ADV),
                                    objective="cispo", backend=backend)[0]
        ratio, kl = loss.ratio_kl(logits, None, ids, mask, jnp.asarray(OLD),
                                  ref_logps=jnp.asarray(REF), backend=backend)
        return jnp.sum(g[0] * ratio + g[1] * kl)

    return np.asarray(jax.grad(total)(jnp.asarray(W)))


def _reference_grad(op: str) -> np.ndarray:
    """Gradient w.r.t. W from plain torch ops on the active rows only (k3 KL)."""
    import torch

    w = torch.tensor(W, dtype=torch.float64, requires_grad=True)
    h = torch.tensor(H[ACTIVE], dtype=torch.float64)
    ids = torch.tensor(IDS[ACTIVE])
    g = torch.tensor(G_OUT[:, ACTIVE], dtype=torch.float64)
    logp = torch.log_softmax(h @ w, dim=-1).gather(-1, ids[:, None])[:, 0]
    if op == "selected_logprobs":
        total = (g[0] * logp).sum()
    elif op == "selected_logprobs_entropy":
        log_p = torch.log_softmax(h @ w, dim=-1)
        total = (g[0] * logp - g[1] * (log_p.exp() * log_p).sum(-1)).sum()
    elif op == "policy_loss_cispo":  # -sg(clip(r, 0.8, 1.2)) * A * logp, token-mean
        ratio = torch.exp(logp - torch.tensor(OLD[ACTIVE], dtype=torch.float64)).detach()
        adv = torch.tensor(ADV[ACTIVE], dtype=torch.float64)
        total = -(ratio.clamp(0.8, 1.2) * adv * logp).mean()
    else:
        d = torch.tensor(REF[ACTIVE], dtype=torch.float64) - logp
        ratio = torch.exp(logp - torch.tensor(OLD[ACTIVE], dtype=torch.float64))
        total = (g[0] * ratio + g[1] * (torch.exp(d) - d - 1)).sum()
    total.backward()
    return w.grad.numpy()


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("pad_value", [np.nan, -np.inf], ids=["nan", "-inf"])
@pytest.mark.parametrize("op", ["selected_logprobs", "selected_logprobs_entropy", "ratio_kl",
                                "policy_loss_cispo"])
def test_padding_never_reaches_the_weight_gradient(target, op, pad_value, strided) -> None:
    framework = harness.TARGETS[target].framework
    if strided and framework == "jax":
        pytest.skip("JAX arrays have no user-visible strides")
    if harness.target_status("torch-native") is not None:
        pytest.skip("the reference gradient uses torch")
    grad_fn = _torch_grad if framework == "torch" else _jax_grad
    grad = grad_fn(target, op, pad_value, strided)
    assert np.all(np.isfinite(grad)), "padding leaked NaN/inf into the weight gradient"
    want = _reference_grad(op)
    tol = spec.linear_grad_tolerance("float32", LOGIT_SCALE, float(np.abs(want).max()))
    assert_close(grad, want, tol, "d weight")
