"""Benchmark inputs: one set per case, built on the device with torch, shared with JAX.

Logits are standard normals times 2 (``ref`` = policy plus small noise), so
ratios and KL values are those of a policy a few steps from its reference;
``old_logps`` and ``ref_logps`` are the exact log-probs plus small noise.
Exactly ``case.active`` rows are active, at random positions. JAX sees the
same buffers through DLPack (zero copy on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict

import torch

from _cases import Case

__all__ = ["TorchInputs", "jax_inputs", "make_inputs"]

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


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> TorchInputs:
    """Random inputs for ``case`` on ``device`` (deterministic for a seed)."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    shape = (case.batch, case.seq, case.v)

    def randn(*size: int, dt: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=dt)

    policy = randn(*shape, dt=dtype).mul_(2.0)
    ref = randn(*shape, dt=dtype).mul_(0.1).add_(policy)
    ids = torch.randint(0, case.v, shape[:2], generator=g, device=device)
    mask = torch.zeros(case.n, dtype=torch.bool, device=device)
    mask[torch.randperm(case.n, generator=g, device=device)[: case.active]] = True
    old = _exact_logps(policy, ids) + 0.05 * randn(*shape[:2])
    ref_lp = _exact_logps(ref, ids)
    return TorchInputs(
        policy=policy.requires_grad_(True),
        ref=ref,
        ids=ids,
        mask=mask.reshape(shape[:2]),
        old_logps=old,
        ref_logps=ref_lp,
        advantages=randn(case.batch),
        cot_a=randn(*shape[:2]),
        cot_b=randn(*shape[:2]),
    )


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


def jax_inputs(inputs: TorchInputs) -> Dict[str, Any]:
    """Every field of ``inputs`` as a JAX array (same names)."""
    if inputs.policy.is_cuda:
        torch.cuda.synchronize()
    return {f.name: _to_jax(getattr(inputs, f.name)) for f in fields(inputs)}
