"""GAE's one Triton launch (``ratiokl._kernels.gae``), bound eager, compiled and interpreted."""

from __future__ import annotations

from typing import Callable, Tuple

import torch
import triton

from ratiokl._kernels.gae import GAE_BLOCK_B, GAE_BLOCK_T, GAE_WARPS, gae_kernel
from ratiokl.torch._launch.op import KernelOp

__all__ = ["GAE"]

Tensor = torch.Tensor


def gae_scan(kernels: Callable, rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
             lam: float) -> Tuple[Tensor, Tensor]:
    """Raw advantages and returns, float32 ``[B, T]`` (0 where masked), from float32
    ``rewards``, ``values`` and bool ``mask [B, T]``, each with column stride 1."""
    n_rows, n_steps = rewards.shape
    adv = torch.empty((n_rows, n_steps), dtype=torch.float32, device=rewards.device)
    ret = torch.empty_like(adv)
    if n_rows and n_steps:
        kernels(gae_kernel)[(triton.cdiv(n_rows, GAE_BLOCK_B),)](
            rewards, values, mask, adv, ret,
            n_rows, n_steps, rewards.stride(0), values.stride(0), mask.stride(0), adv.stride(0),
            GAMMA=gamma, LAM=lam, BLOCK_B=GAE_BLOCK_B, BLOCK_T=GAE_BLOCK_T,
            num_warps=GAE_WARPS,
        )
    return adv, ret


GAE = KernelOp(gae_scan, fake=lambda rewards, *_: (
    torch.empty_like(rewards, dtype=torch.float32, memory_format=torch.contiguous_format),
    torch.empty_like(rewards, dtype=torch.float32, memory_format=torch.contiguous_format)))
