"""Benchmark inputs: one set per case, built on the device with torch, shared with JAX.

Logits are standard normals times 2 (``ref`` = policy plus small noise), so
ratios and KL values are those of a policy a few steps from its reference;
``old_logps`` and ``ref_logps`` are the exact log-probs plus small noise, and the
engine's ``rollout_logps`` are ``old_logps`` plus smaller noise (a sequence of 1024
tokens then has a log-weight of about +-0.6, so the sequence-level weights vary).
Exactly ``case.active`` rows are active, at random positions. JAX sees the
same buffers through DLPack (zero copy on the GPU).

The lm_head step's cases (``case.hidden > 0``) get :class:`StepInputs`:
hidden states and ``W`` scaled so that ``hidden @ W.T`` has the same spread
(standard normals times 2), the per-token inputs of the policy loss, and a
random ``[N, V]`` gradient for the bare GEMMs (never a constant one: PERF.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Union

import torch

from _cases import CLIP_EPS, KL_COEF, Case

__all__ = ["StepInputs", "TorchInputs", "jax_inputs", "make_inputs"]

#: Rows per chunk when computing exact log-probs (bounds the fp32 temporary).
_CHUNK_ROWS = 1024


@dataclass
class TorchInputs:
    """Inputs of one case; leading shape ``[B, T]`` with ``N = B * T``."""

    policy: torch.Tensor  # [B, T, V] case dtype, requires_grad
    ref: torch.Tensor  # [B, T, V] case dtype
    ids: torch.Tensor  # [B, T] int64, in [0, V)
    mask: torch.Tensor  # [B, T] bool, case.active rows true
    old_logps: torch.Tensor  # [B, T] float32
    ref_logps: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32, one per sequence
    cot_a: torch.Tensor  # [B, T] float32 upstream gradient (logp / ratio)
    cot_b: torch.Tensor  # [B, T] float32 upstream gradient (kl)
    rollout_logps: torch.Tensor  # [B, T] float32: the engine's log-probs, old_logps + noise


def _exact_logps(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float32 ``log_softmax(logits)[ids]`` per row, in row chunks."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    flat_ids = ids.reshape(-1, 1)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], _CHUNK_ROWS):
        rows = slice(start, start + _CHUNK_ROWS)
        lsm = torch.log_softmax(flat[rows].float(), dim=-1)
        out[rows] = lsm.gather(-1, flat_ids[rows]).squeeze(-1)
    return out.reshape(ids.shape)


@dataclass
class StepInputs:
    """Inputs of one lm_head step case: ``logits = hidden @ weight.T`` viewed ``[B, T, V]``."""

    hidden: torch.Tensor  # [N, H] case dtype, requires_grad
    weight: torch.Tensor  # [V, H] case dtype, requires_grad
    ids: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] bool
    old_logps: torch.Tensor  # [B, T] float32
    ref_logps: torch.Tensor  # [B, T] float32
    advantages: torch.Tensor  # [B] float32
    grad_logits: torch.Tensor  # [N, V] case dtype: the bare GEMMs' upstream gradient
    cot_a: torch.Tensor  # [B, T] float32 upstream gradient of the seam's logp
    cot_b: torch.Tensor  # [B, T] float32 upstream gradient of the seam's entropy
    seam_grad_logits: torch.Tensor  # [N, V] case dtype: the seam's own logits gradient


class _Random:
    """Seeded random tensors on one device."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.g = torch.Generator(device=device).manual_seed(seed)

    def randn(self, *size: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*size, generator=self.g, device=self.device, dtype=dt)

    def ids(self, case: Case) -> torch.Tensor:
        return torch.randint(0, case.v, (case.batch, case.seq), generator=self.g,
                             device=self.device)

    def mask(self, case: Case) -> torch.Tensor:
        """``[B, T]`` bool with exactly ``case.active`` true entries, at random positions."""
        mask = torch.zeros(case.n, dtype=torch.bool, device=self.device)
        mask[torch.randperm(case.n, generator=self.g, device=self.device)[: case.active]] = True
        return mask.reshape(case.batch, case.seq)


def _logits_inputs(case: Case, r: _Random) -> TorchInputs:
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seq, case.v)
    policy = r.randn(*shape, dt=dtype).mul_(2.0)
    ref = r.randn(*shape, dt=dtype).mul_(0.1).add_(policy)
    ids = r.ids(case)
    mask = r.mask(case)
    old = _exact_logps(policy, ids) + 0.05 * r.randn(*shape[:2])
    ref_lp = _exact_logps(ref, ids)
    advantages, cot_a, cot_b = r.randn(case.batch), r.randn(*shape[:2]), r.randn(*shape[:2])
    return TorchInputs(
        policy=policy.requires_grad_(True),
        ref=ref,
        ids=ids,
        mask=mask,
        old_logps=old,
        ref_logps=ref_lp,
        advantages=advantages,
        cot_a=cot_a,
        cot_b=cot_b,
        # Drawn last: the other inputs are those of the runs before it existed.
        rollout_logps=old + 0.02 * r.randn(*shape[:2]),
    )


def _step_inputs(case: Case, r: _Random) -> StepInputs:
    dtype = getattr(torch, case.dtype)
    hidden = r.randn(case.n, case.hidden, dt=dtype)
    weight = r.randn(case.v, case.hidden, dt=dtype).mul_(2.0 / case.hidden**0.5)
    ids = r.ids(case)
    with torch.no_grad():
        logps = _exact_logps((hidden @ weight.T).view(case.batch, case.seq, case.v), ids)
    mask = r.mask(case)
    old_logps = logps + 0.05 * r.randn(case.batch, case.seq)
    ref_logps = logps + 0.05 * r.randn(case.batch, case.seq)
    advantages = r.randn(case.batch)
    cot_a, cot_b = r.randn(case.batch, case.seq), r.randn(case.batch, case.seq)
    return StepInputs(
        hidden=hidden.requires_grad_(True),
        weight=weight.requires_grad_(True),
        ids=ids,
        mask=mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        advantages=advantages,
        grad_logits=_loss_gradient(hidden, weight, ids, mask, old_logps, ref_logps, advantages),
        cot_a=cot_a,
        cot_b=cot_b,
        seam_grad_logits=_seam_gradient(hidden, weight, ids, mask, cot_a, cot_b),
    )


def _loss_gradient(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                   mask: torch.Tensor, old_logps: torch.Tensor, ref_logps: torch.Tensor,
                   advantages: torch.Tensor) -> torch.Tensor:
    """The bare GEMMs' upstream gradient: the policy loss's own gradient of the logits
    ``hidden @ weight.T`` (``[N, V]``, their dtype), from the framework-ops backend. A GEMM's
    speed depends on its data (clocks follow power): on a random gradient the three GEMMs
    ran as long as the whole step with the loss on the H200, so only the loss's own
    gradient gives the "GEMMs on the same data" baseline."""
    from ratiokl.torch import loss

    batch, vocab = ids.shape[0], weight.shape[0]
    logits = (hidden.detach() @ weight.detach().T).view(batch, -1, vocab).requires_grad_()
    value, _ = loss.policy_loss(logits, None, ids, mask, old_logps, advantages,
                                ref_logps=ref_logps, clip_eps=CLIP_EPS, kl_coef=KL_COEF,
                                backend="native")
    (grad,) = torch.autograd.grad(value, logits)
    return grad.reshape(-1, vocab)


def _seam_gradient(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                   mask: torch.Tensor, cot_a: torch.Tensor, cot_b: torch.Tensor) -> torch.Tensor:
    """The log-prob seam's own logits gradient (``cot_a`` on logp, ``cot_b`` on the entropy;
    ``[N, V]``, their dtype), computed in row chunks of fp32 framework ops: the bare GEMMs'
    upstream gradient for the seam (the loss's own data, as :func:`_loss_gradient` says)."""
    flat_ids, active = ids.reshape(-1), mask.reshape(-1)
    ga, gb = cot_a.reshape(-1), cot_b.reshape(-1)
    out = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], _CHUNK_ROWS):
            rows = slice(start, start + _CHUNK_ROWS)
            log_p = torch.log_softmax((hidden[rows] @ weight.T).float(), dim=-1)
            p = log_p.exp()
            entropy = -(p * log_p).sum(-1, keepdim=True)
            onehot = torch.zeros_like(p).scatter_(1, flat_ids[rows, None], 1.0)
            grad = ga[rows, None] * (onehot - p) - gb[rows, None] * p * (log_p + entropy)
            out[rows] = torch.where(active[rows, None], grad, 0.0).to(out.dtype)
    return out


def make_inputs(case: Case, device: torch.device,
                seed: int = 0) -> Union[TorchInputs, StepInputs]:
    """Random inputs for ``case`` on ``device`` (deterministic for a seed): logits in, or
    (``case.hidden > 0``) the lm_head step's hidden states and weight."""
    r = _Random(device, seed)
    return _step_inputs(case, r) if case.hidden else _logits_inputs(case, r)


def _to_jax(tensor: torch.Tensor) -> Any:
    """The same buffer as a JAX array (DLPack), or a host copy where DLPack fails."""
    import jax
    import jax.numpy as jnp

    tensor = tensor.detach()
    try:
        return jax.dlpack.from_dlpack(tensor)
    except Exception:  # noqa: BLE001 - any DLPack refusal falls back to a copy
        dtype = jnp.dtype(str(tensor.dtype).removeprefix("torch."))
        host = tensor.cpu().float().numpy() if tensor.is_floating_point() else tensor.cpu().numpy()
        return jnp.asarray(host, dtype=dtype)


def jax_inputs(inputs: Union[TorchInputs, StepInputs]) -> Dict[str, Any]:
    """Every field of ``inputs`` as a JAX array (same names)."""
    if inputs.ids.is_cuda:
        torch.cuda.synchronize()
    return {f.name: _to_jax(getattr(inputs, f.name)) for f in fields(inputs)}
