"""Every op gives the same numbers under autocast as outside it: ratiokl decides its own
precision (float32 rows, the lm_head's ``logits_dtype`` / ``fp32_matmul``), and a trainer
that runs its loss under ``torch.autocast`` (TRL and OpenRLHF with ``bf16=True``) must not
change it. A matmul-like op autocast lists (``linalg.vecdot`` in the one-pass entropy) ran
in bfloat16 there and moved the entropy by 1e-4 (TRL adapter, ``cast_lm_head_to_fp32``).

CPU autocast to bfloat16, the backends that run here; the values and gradients bitwise."""

from __future__ import annotations

import pytest
import torch

from ratiokl.torch import loss

N, V, H = 12, 40, 16
BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"))]


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(N, V, generator=g)).to(dtype)
    ref = (3 * torch.randn(N, V, generator=g)).to(dtype)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = torch.randn(V, H, generator=g).to(dtype)
    ids = torch.randint(0, V, (N,), generator=g)
    mask = torch.rand(N, generator=g) > 0.25
    old = -torch.rand(N, generator=g) * 3
    adv = torch.randn(N, generator=g)
    return logits, ref, hidden, weight, ids, mask, old, adv


def _ops(backend):
    """``name -> fn(logits, ref, hidden, weight, ids, mask, old, adv) -> tensors``."""
    def logprobs(lg, ref, h, w, ids, mask, old, adv):
        return loss.selected_logprobs(lg, ids, mask, return_entropy=True, backend=backend)

    def ratio_kl(lg, ref, h, w, ids, mask, old, adv):
        return loss.ratio_kl(lg, ref, ids, mask, old, backend=backend)

    def policy(lg, ref, h, w, ids, mask, old, adv):
        value, metrics = loss.policy_loss(lg, ref, ids, mask, old, adv, kl_coef=0.1,
                                          entropy_coef=0.01, backend=backend)
        return (value, *metrics.values())

    def linear_logprobs(lg, ref, h, w, ids, mask, old, adv):
        return loss.linear_selected_logprobs(h, w, ids, mask, return_entropy=True,
                                             backend=backend)

    def linear_policy(lg, ref, h, w, ids, mask, old, adv):
        value, metrics = loss.linear_policy_loss(h, w, ids, mask, old, adv,
                                                 entropy_coef=0.01, backend=backend)
        return (value, *metrics.values())

    return {"selected_logprobs": logprobs, "ratio_kl": ratio_kl, "policy_loss": policy,
            "linear_selected_logprobs": linear_logprobs, "linear_policy_loss": linear_policy}


def _run(fn, inputs, autocast: bool):
    leaves = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    leaves[6].requires_grad_(False)
    leaves[7].requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    total = sum((o.float() * (k + 1)).sum() for k, o in enumerate(out) if o.requires_grad)
    grads = torch.autograd.grad(total, [x for x in leaves if x.requires_grad],
                                allow_unused=True) if torch.is_tensor(total) else ()
    return [o.detach() for o in out], [g for g in grads if g is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(_ops("native")))
def test_autocast_changes_nothing(op, backend, dtype):
    fn = _ops(backend)[op]
    inputs = _inputs(dtype)
    want_out, want_grads = _run(fn, inputs, autocast=False)
    got_out, got_grads = _run(fn, inputs, autocast=True)
    assert want_grads, "nothing was differentiated"
    assert len(got_out) == len(want_out) and len(got_grads) == len(want_grads)
    for k, (got, want) in enumerate(zip(got_out + got_grads, want_out + want_grads)):
        assert got.dtype == want.dtype, (k, got.dtype, want.dtype)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m, k=k: f"output/gradient {k}: {m}")
