"""The row statistics' launches: the log-prob / ratio / KL / entropy forward and its backward.
"""

from __future__ import annotations

import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp

from ratiokl._kernels import (
    backward_plan,
    forward_plan,
    logp_backward_kernel,
    logp_combine_kernel,
    logp_forward_kernel,
    lse_partials_kernel,
)
from ratiokl.jax._launch.vmap import TritonCall, row_op

__all__ = ["backward_op", "forward_op"]


def _forward_call(call: TritonCall, kl_code: int, has_ref: bool, entropy: bool, policy, ref,
                  ids, mask, old, ref_logps, temp):
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]``: one launch, or partials + combine.

    ``entropy``: the kernels' ``ENTROPY`` mode (no reference, ``kl_code`` ``KL.NONE``): ``kl`` and
    ``dkl`` hold the entropy.

    Few rows (``forward_plan``'s ``split``) run a program per (row, vocabulary
    split) and a per-row combine; the bits are those of the one-launch path.
    """
    n_rows, vocab = policy.shape
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    if n_rows == 0:
        return tuple(jnp.zeros((0,), jnp.float32) for _ in range(5))
    plan = forward_plan(n_rows, vocab, policy.dtype.itemsize)
    config, spans = plan.config, plan.spans
    sizes = dict(
        V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1, HAS_REF=has_ref, ENTROPY=entropy,
    )
    if not plan.split:
        return tuple(call(
            policy, ref, ids, mask, old, ref_logps, temp,
            kernel=logp_forward_kernel, out_shape=[row] * 5, grid=(n_rows,),
            num_warps=config.num_warps, KL_CODE=kl_code,
            TILES_PER_SPLIT=spans.tiles_per_split, BLOCK_V=config.block_v, **sizes,
        ))
    parts = call(
        policy, ref, mask, temp,
        kernel=lse_partials_kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows, spans.splits, 4), jnp.float32),
        grid=(n_rows, spans.splits), num_warps=config.num_warps, SPLITS=spans.splits,
        TILES_PER_SPLIT=spans.tiles_per_split, BLOCK_V=config.block_v, **sizes,
    )
    return tuple(call(
        policy, ref, ids, mask, old, ref_logps, temp, parts,
        kernel=logp_combine_kernel, out_shape=[row] * 5, grid=(n_rows,), num_warps=1,
        KL_CODE=kl_code, SPLITS=spans.splits, **sizes,
    ))


def _backward_call(call: TritonCall, terms: Tuple[bool, bool, bool], entropy: bool, policy,
                   ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl):
    """Gradient ``[N, V]`` in the logits' dtype; grid ``(N, S)`` (``backward_plan``).

    The kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per row;
    ``terms`` says which of the three are present (an absent one's arrays are
    placeholders, never read). ``entropy``: ``g_kl`` / ``dkl`` are the entropy's
    upstream gradient and value (the kernel's ``ENTROPY`` term instead of the KL's).
    """
    n_rows, vocab = policy.shape
    if n_rows == 0:
        return jnp.zeros(policy.shape, policy.dtype)
    plan = backward_plan(n_rows, vocab, policy.dtype.itemsize)
    return call(
        policy, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl,
        kernel=logp_backward_kernel, out_shape=jax.ShapeDtypeStruct(policy.shape, policy.dtype),
        grid=plan.grid(n_rows), num_warps=plan.config.num_warps,
        V=vocab, stride_ln=vocab, stride_lv=1, stride_t=0 if temp.shape[0] == 1 else 1,
        stride_gl=1, stride_gr=1, stride_gk=1, tiles_per_prog=plan.tiles_per_program,
        HAS_G_LOGP=terms[0], HAS_G_RATIO=terms[1], HAS_G_KL=terms[2], ENTROPY=entropy,
        BLOCK_V=plan.config.block_v,
    )


@functools.lru_cache(maxsize=None)
def forward_op(call: TritonCall, kl_code: int, has_ref: bool, entropy: bool = False) -> Callable:
    """The row forward through ``call`` (see :func:`_forward_call`)."""
    return row_op(functools.partial(_forward_call, call, kl_code, has_ref, entropy),
                  temp_index=6)


@functools.lru_cache(maxsize=None)
def backward_op(call: TritonCall, terms: Tuple[bool, bool, bool],
                entropy: bool = False) -> Callable:
    """The backward kernel through ``call`` for these upstream terms (see
    :func:`_backward_call`)."""
    return row_op(functools.partial(_backward_call, call, terms, entropy), temp_index=3)
