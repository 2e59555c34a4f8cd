"""Triton launches for one vocabulary shard (``ratiokl.torch._vocab_parallel``).

Two ops per backend, the same split as ``ratiokl.torch._triton``:

* ``"triton"`` (CUDA): ``torch.library.triton_op`` + ``wrap_triton``;
* ``"interpret"`` (CPU): the interpreter twin inside a ``custom_op``.

:func:`shard_lse` runs ``shard_stats_kernel`` without its selected-logit
part (a rank learns where its shard starts only from the first all-reduce,
which needs these statistics first): per row, the shard's natural-log
log-sum-exp of the policy and, in the same pass, of the reference.
:func:`shard_grad` runs ``logp_backward_kernel`` with the *global*
log-sum-exp and shard-local ids (``a - vocab_start``; outside ``[0, V_local)``
on the ranks that do not own the action, where the kernel sets no one-hot).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import numpy as np
import torch
from torch.library import custom_op, triton_op, wrap_triton

from ratiokl._kernels import forward_config, interpreted, shard_stats_kernel
from ratiokl.torch._triton import _interpret_backward, _triton_backward, kernel_temperature

__all__ = ["kernel_temperature", "shard_grad", "shard_lse"]


def _launch_stats(
    kernel: Callable, policy: torch.Tensor, ref: Optional[torch.Tensor], mask: torch.Tensor,
    temp: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lse, ref_lse)`` float32 ``[N]`` (``ref_lse`` is 0 without ``ref``); 0 on inactive rows."""
    n_rows, vocab = policy.shape
    lse, ref_lse = (torch.empty(n_rows, dtype=torch.float32, device=policy.device)
                    for _ in range(2))
    if n_rows == 0:
        return lse, ref_lse
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    config = forward_config(vocab, policy.element_size())
    # ids, start and the selected-logit outputs are untouched with SELECT=False.
    kernel[(n_rows,)](
        policy, ref_t, mask, mask, temp, mask,
        lse, ref_lse, lse, lse,
        vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
        0 if temp.numel() == 1 else temp.stride(0),
        HAS_REF=ref is not None, SELECT=False, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    return lse, ref_lse


@triton_op("ratiokl::triton_shard_stats", mutates_args=())
def _triton_stats(
    policy: torch.Tensor, ref: Optional[torch.Tensor], mask: torch.Tensor, temp: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _launch_stats(wrap_triton(shard_stats_kernel), policy, ref, mask, temp)


@custom_op("ratiokl::interpret_shard_stats", mutates_args=(), device_types="cpu")
def _interpret_stats(
    policy: torch.Tensor, ref: Optional[torch.Tensor], mask: torch.Tensor, temp: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    with np.errstate(all="ignore"):  # NaN/inf rows are data here, not accidents
        return _launch_stats(interpreted(shard_stats_kernel), policy, ref, mask, temp)


@_interpret_stats.register_fake
def _(policy, ref, mask, temp):
    return tuple(policy.new_empty(policy.shape[0], dtype=torch.float32) for _ in range(2))




def shard_lse(
    policy: torch.Tensor, ref: Optional[torch.Tensor], mask: torch.Tensor, temp: torch.Tensor
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """This shard's log-sum-exp of ``policy / T`` (and of ``ref / T``), float32 ``[N]``.

    ``policy``/``ref``: ``[N, V_local]``, detached, any strides; ``temp`` from
    :func:`kernel_temperature`. Inactive rows are 0 and none of their logits
    is read. CUDA tensors run on the GPU, CPU tensors through the interpreter.
    """
    op = _triton_stats if policy.device.type == "cuda" else _interpret_stats
    lse, ref_lse = op(policy, ref, mask, temp)
    return lse, None if ref is None else ref_lse


def shard_grad(
    logits: torch.Tensor, local_ids: torch.Tensor, mask: torch.Tensor, temp: torch.Tensor,
    lse: torch.Tensor, coef: torch.Tensor,
) -> torch.Tensor:
    """This shard's ``coef * (onehot(local_ids) - exp(z - lse)) / T``, ``[N, V_local]`` row-major.

    ``lse`` is the global log-sum-exp (float32 ``[N]``); ``local_ids`` are
    ``a - vocab_start`` (no one-hot where outside ``[0, V_local)``); ``coef``
    float32 ``[N]``. In the logits' dtype, exact 0 on inactive rows.
    """
    op = _triton_backward if logits.device.type == "cuda" else _interpret_backward
    return op(logits, local_ids, mask, temp, lse, coef, None, lse, None, lse)
