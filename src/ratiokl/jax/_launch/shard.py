"""One vocabulary shard's launch (vocab-parallel): its log-sum-exps, selected logits and
entropy statistic.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ratiokl._kernels import forward_config, shard_stats_kernel
from ratiokl.jax._launch.vmap import TritonCall, row_op

__all__ = ["stats_op"]


def _stats_call(call: TritonCall, has_ref: bool, entropy: bool, policy, ref, ids, mask, temp,
                start):
    """``(lse, ref_lse, z_a, ref_z_a, mu)`` float32 ``[N]`` from one ``shard_stats_kernel``
    launch (``mu``, the mean ``z`` under the block's softmax, only with ``entropy``)."""
    n_rows, vocab = policy.shape
    if n_rows == 0:
        return tuple(jnp.zeros((0,), jnp.float32) for _ in range(5))
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    config = forward_config(vocab, policy.dtype.itemsize)
    return tuple(call(
        policy, ref, ids, mask, temp, start,
        kernel=shard_stats_kernel, out_shape=[row] * 5, grid=(n_rows,),
        num_warps=config.num_warps,
        V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1,
        HAS_REF=has_ref, SELECT=True, ENTROPY=entropy, BLOCK_V=config.block_v,
    ))


@functools.lru_cache(maxsize=None)
def stats_op(call: TritonCall, has_ref: bool, entropy: bool = False) -> Callable:
    """One vocabulary shard's statistics through ``call`` (see :func:`_stats_call`)."""
    return row_op(functools.partial(_stats_call, call, has_ref, entropy), temp_index=4)
