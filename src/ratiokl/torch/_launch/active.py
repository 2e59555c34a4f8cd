"""The active-row check's launch: an active id outside ``[0, V)`` or temperature outside
``(0, inf)``, as two int32 flags (``ratiokl.torch._checks``'s ``check_ids``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ratiokl._kernels.active_check import CHECK_BLOCK, CHECK_WARPS, active_check_kernel
from ratiokl.torch._launch.op import kernels_for, row_stride

__all__ = ["active_flags"]

Tensor = torch.Tensor


def active_flags(ids: Tensor, mask: Tensor, vocab: Optional[int],
                 temperature: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """int32 ``[2]``: (an active id outside ``[0, vocab)``, an active temperature outside
    ``(0, inf)``), from one launch; ``vocab`` / ``temperature`` None: not tested.

    Inputs of the leading shape, any strides (flattened; a 0-d temperature expanded
    over the rows is read with stride 0). CUDA tensors launch the kernel, CPU tensors its
    interpreter twin (tests). ``out``: where the flags go (its first two int32), e.g. a
    pinned host slot the device writes through unified addressing; returned.
    """
    kernels = kernels_for(ids.device)
    ids = ids.reshape(-1).contiguous()
    mask = mask.reshape(-1).contiguous()
    flags = torch.empty(2, dtype=torch.int32, device=ids.device) if out is None else out
    temp = mask if temperature is None else temperature.reshape(-1)
    if temp.stride(0) not in (0, 1):
        temp = temp.contiguous()
    kernels(active_check_kernel)[(1,)](
        ids, mask, temp, flags, ids.numel(), vocab or 0, row_stride(temp),
        CHECK_IDS=vocab is not None, CHECK_TEMP=temperature is not None, BLOCK=CHECK_BLOCK,
        num_warps=CHECK_WARPS,
    )
    return flags
