"""A user's per-token ratio and KL in PyTorch, its port to JAX, and both checked against
ratiokl's conformance fixtures (docs/check.md)::

    ratiokl check --target examples.check_target_port:TorchRatioKL \
                  --target examples.check_target_port:JaxRatioKL --case 'kl_*'

Each class follows ``ratiokl.harness.CheckTarget``: ``supports`` says which fixture
cases it can run (here: the ``ratio_kl`` ones, without the argument checks it does not
make), ``__call__`` takes the case's NumPy inputs and returns the outputs and the
gradient with respect to the policy logits, computed from the case's cotangents.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ratiokl.harness import TargetCall, TargetResult


def supports_ratio_kl(call: TargetCall) -> Optional[str]:
    """Both ports compute ``ratio_kl`` and check none of its arguments."""
    if call.op != "ratio_kl":
        return f"implements ratio_kl only, not {call.op}"
    if call.expect_error is not None:
        return "does not validate action ids or temperatures"
    return None


class TorchRatioKL:
    """``ratio = exp(logp - old_logp)`` and Schulman's k1 / k2 / k3 on ``d = ref - logp``,
    float32 math on ``[..., V]`` logits; inactive rows: ratio 1, KL 0, zero gradient."""

    name = "port-torch"
    supports = staticmethod(supports_ratio_kl)

    def __call__(self, call: TargetCall) -> TargetResult:
        import torch

        args = call.arguments
        mask = torch.as_tensor(args["mask"])
        ids = torch.where(mask, torch.as_tensor(args["action_ids"]).long(), 0)
        temperature = torch.where(mask, torch.as_tensor(args.get("temperature", 1.0)), 1.0)

        def logprobs(logits):
            # Inactive rows may hold NaN / inf: replace them before any arithmetic, so
            # neither their values nor 0 * NaN in the backward reach the active rows.
            z = torch.where(mask[..., None], logits.float(), 0.0) / temperature[..., None]
            return torch.log_softmax(z, dim=-1).gather(-1, ids[..., None])[..., 0]

        policy = torch.as_tensor(args["policy_logits"]).to(getattr(torch, call.dtype))
        policy.requires_grad_(True)
        logp = logprobs(policy)
        if args.get("ref_logits") is not None:
            ref = logprobs(torch.as_tensor(args["ref_logits"]).to(getattr(torch, call.dtype)))
        else:
            ref = torch.as_tensor(args["ref_logps"])
        old = torch.where(mask, torch.as_tensor(args["old_logps"]), 0.0)
        d = torch.where(mask, ref - logp, 0.0)
        kl = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.expm1(d) - d}[
            args.get("kl_estimator", "k3")]
        ratio = torch.where(mask, torch.exp(torch.where(mask, logp - old, 0.0)), 1.0)
        kl = torch.where(mask, kl, 0.0)
        cotangents = [torch.as_tensor(call.cotangents[o]) for o in ("ratio", "kl")]
        (grad,) = torch.autograd.grad([ratio, kl], [policy], cotangents)
        return TargetResult(
            outputs={"ratio": ratio.detach().numpy(), "kl": kl.detach().numpy()},
            grads={"policy_logits": grad.float().numpy()})


class JaxRatioKL:
    """The same arithmetic in JAX, differentiated with ``jax.vjp``."""

    name = "port-jax"
    supports = staticmethod(supports_ratio_kl)

    def __call__(self, call: TargetCall) -> TargetResult:
        import jax
        import jax.numpy as jnp

        args = call.arguments
        mask = jnp.asarray(args["mask"])
        ids = jnp.where(mask, jnp.asarray(args["action_ids"]), 0)
        temperature = jnp.where(mask, jnp.asarray(args.get("temperature", 1.0)), 1.0)

        def logprobs(logits):
            z = jnp.where(mask[..., None], logits.astype(jnp.float32), 0.0)
            z = jax.nn.log_softmax(z / temperature[..., None], axis=-1)
            return jnp.take_along_axis(z, ids[..., None], axis=-1)[..., 0]

        def ratio_kl(policy):
            logp = logprobs(policy)
            if args.get("ref_logits") is not None:
                ref = logprobs(jnp.asarray(args["ref_logits"], dtype=call.dtype))
            else:
                ref = jnp.asarray(args["ref_logps"])
            old = jnp.where(mask, jnp.asarray(args["old_logps"]), 0.0)
            d = jnp.where(mask, ref - logp, 0.0)
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": jnp.expm1(d) - d}[
                args.get("kl_estimator", "k3")]
            ratio = jnp.exp(jnp.where(mask, logp - old, 0.0))
            return jnp.where(mask, ratio, 1.0), jnp.where(mask, kl, 0.0)

        policy = jnp.asarray(args["policy_logits"], dtype=call.dtype)
        (ratio, kl), vjp = jax.vjp(ratio_kl, policy)
        (grad,) = vjp(tuple(jnp.asarray(call.cotangents[o]) for o in ("ratio", "kl")))
        as_numpy = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
        return TargetResult(outputs={"ratio": as_numpy(ratio), "kl": as_numpy(kl)},
                            grads={"policy_logits": as_numpy(grad)})
