"""One vocabulary shard's launch (vocab-parallel): its log-sum-exps and entropy statistic.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ratiokl._kernels import forward_config, shard_stats_kernel
from ratiokl.torch._launch.op import KernelOp, row_outputs, row_stride

__all__ = ["SHARD_STATS", "shard_stats"]

Tensor = torch.Tensor


def shard_stats(kernels: Callable, policy: Tensor, ref: Optional[Tensor], mask: Tensor,
                temp: Tensor, entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """``(lse, ref_lse, mu)`` float32 ``[N]`` of this shard (``ref_lse`` 0 without ``ref``;
    ``mu``, the mean ``x / T`` under the shard's softmax, only with ``entropy``, else
    unwritten).

    ``shard_stats_kernel`` without its selected-logit part (a rank learns where
    its shard starts only from the first all-reduce); 0 on inactive rows.
    """
    n_rows, vocab = policy.shape
    lse, ref_lse, mu = row_outputs(n_rows, policy.device, 3)
    if n_rows == 0:
        return lse, ref_lse, mu
    ref_t = policy if ref is None else ref  # never read when absent (HAS_REF is False)
    config = forward_config(vocab, policy.element_size())
    # ids, start and the selected-logit outputs are untouched with SELECT=False.
    kernels(shard_stats_kernel)[(n_rows,)](
        policy, ref_t, mask, mask, temp, mask, lse, ref_lse, lse, lse, mu,
        vocab, policy.stride(0), policy.stride(1), ref_t.stride(0), ref_t.stride(1),
        row_stride(temp),
        HAS_REF=ref is not None, SELECT=False, ENTROPY=entropy, BLOCK_V=config.block_v,
        num_warps=config.num_warps,
    )
    return lse, ref_lse, mu


SHARD_STATS = KernelOp(shard_stats, fake=lambda policy, *_: tuple(
    policy.new_empty(policy.shape[0], dtype=torch.float32) for _ in range(3)))
