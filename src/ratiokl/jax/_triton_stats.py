"""Triton path of the vocabulary-parallel JAX backend (``vocab_axis=``, ``backend="triton"``).

Inside ``shard_map``, device ``k`` of mesh axis ``axis`` holds the block
``[k * V_local, (k + 1) * V_local)``. Per call:

1. one ``shard_stats_kernel`` launch on the block (policy and reference in
   one pass): the block's natural-log log-sum-exp ``lse_k`` and the selected
   logit ``z_a`` where the global id falls in the block (0 elsewhere);
2. ``M = pmax(lse_k)`` and one ``psum`` of ``(exp(lse_k - shift(M)), z_a)``,
   so ``lse = shift(M) + log S`` and ``logp = z_a - lse`` on every device;
3. the gradient: one ``jax.custom_vjp`` attaches ``logp`` to the block and
   runs ``logp_backward_kernel`` with the global ``lse`` and block-local ids
   (``a - k * V_local``; -1 where another device owns the action: no one-hot).

All statistics are computed under ``stop_gradient``; the custom rule carries
the whole gradient, so the backward has no collective. jax-triton types its
outputs as invariant across ``shard_map``'s manual axes although each device
computed its own: every kernel output is ``pcast`` to varying over ``axis``
(left as it was if already varying), else ``pmax``/``psum`` would treat the
per-device values as replicated. Because the custom rule hides the ``psum``,
the cotangent it receives is exact only under ``check_vma=True`` (with
``check_vma=False`` JAX would hand each device ``1/axis_size`` of it), so
:func:`logps` refuses blocks that are not typed varying over ``axis``.
"""

from __future__ import annotations

import functools
from typing import List, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._kernels import forward_config, shard_stats_kernel
from ratiokl.jax import _native, _triton
from ratiokl.jax._checks import Temperature

__all__ = ["logps", "varies_over"]


def varies_over(x: jax.Array, axis: str) -> bool:
    """Whether ``x`` is typed as varying over mesh ``axis`` (never with ``check_vma=False``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # JAX < 0.9 spelling
    if vma is None:
        vma = aval.manual_axis_type.varying
    return axis in vma


def _varying(x: jax.Array, axis: str) -> jax.Array:
    """``x`` typed as varying over ``axis`` (jax-triton outputs come back invariant)."""
    return x if varies_over(x, axis) else lax.pcast(x, axis, to="varying")


def _stats_call(has_ref: bool, policy, ref, ids, mask, temp, start):
    """``(lse, ref_lse, z_a, ref_z_a)`` float32 ``[N]`` from one ``shard_stats_kernel`` launch."""
    n_rows, vocab = policy.shape
    if n_rows == 0:
        return tuple(jnp.zeros((0,), jnp.float32) for _ in range(4))
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    config = forward_config(vocab, policy.dtype.itemsize)
    return tuple(_triton._triton_call(
        policy, ref, ids, mask, temp, start,
        kernel=shard_stats_kernel, out_shape=[row] * 4, grid=(n_rows,),
        num_warps=config.num_warps,
        V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1,
        HAS_REF=has_ref, SELECT=True, BLOCK_V=config.block_v,
    ))


@functools.lru_cache(maxsize=None)
def _stats_op(has_ref: bool):
    return _triton._row_op(functools.partial(_stats_call, has_ref), temp_index=4)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attach(policy, z_a, lse, local_ids, mask_k, temp, axis: str):
    """``logp = z_a - lse`` (0 on inactive rows), differentiable w.r.t. this block ``policy``."""
    del policy, local_ids, temp, axis
    return jnp.where(mask_k != 0, z_a - lse, 0.0)


def _attach_fwd(policy, z_a, lse, local_ids, mask_k, temp, axis):
    return _attach(policy, z_a, lse, local_ids, mask_k, temp, axis), (
        policy, local_ids, mask_k, temp, lse
    )


def _attach_bwd(axis, residuals, g):
    policy, local_ids, mask_k, temp, lse = residuals
    # The kernel selects 0 on inactive rows (a NaN cotangent there stays out).
    coef = g.astype(jnp.float32)
    grad = _triton.backward_op((True, False, False))(
        policy, local_ids, mask_k, temp, lse, coef, lse, lse, lse, lse)
    return _varying(grad.astype(policy.dtype), axis), None, None, None, None, None


_attach.defvjp(_attach_fwd, _attach_bwd)


def logps(
    shards: Sequence[jax.Array], ids: jax.Array, mask: jax.Array, temperature: Temperature,
    axis: str,
) -> List[jax.Array]:
    """``logp`` float32 ``[N]`` per block in ``shards`` (policy, then optionally reference).

    ``shards``: this device's ``[N, V_local]`` blocks; ``ids`` global, ``mask``
    bool, ``temperature`` a float or float32 ``[N]``, all replicated along
    ``axis``. The policy's ``logp`` is differentiable (the gradient is this
    block's slice of the unsharded one); the reference's is not. Inactive rows
    are 0 with a zero gradient; an active id outside the global ``[0, V)``
    gives NaN (value and gradient). One ``pmax`` and one ``psum`` in all.
    """
    if not varies_over(shards[0], axis):
        raise ValueError(
            f"backend='triton' with vocab_axis={axis!r} needs the logits typed as varying over "
            f"{axis!r}: call it inside `jax.shard_map(..., check_vma=True)` (the default; with "
            "check_vma=False the gradient would be scaled by 1/axis_size), or use "
            "backend='native'"
        )
    local_vocab = shards[0].shape[-1]
    ids_k, mask_k, temp = _triton._rows(ids, mask, temperature)
    start = lax.axis_index(axis) * local_vocab
    has_ref = len(shards) > 1
    blocks = [lax.stop_gradient(x) for x in shards]
    stats = _stats_op(has_ref)(
        blocks[0], blocks[-1], ids_k, mask_k, temp, jnp.full((1,), start, ids_k.dtype)
    )
    lse_k, ref_lse_k, z_a, ref_z_a = (_varying(o, axis) for o in stats)
    m = jnp.stack([lse_k, ref_lse_k][: len(shards)])
    shift = _native._finite_or_zero(lax.pmax(m, axis))
    # A block's log-sum-exp is its (m, s) = (lse_k, 1).
    s, z_sel = lax.psum((jnp.exp(m - shift), jnp.stack([z_a, ref_z_a][: len(shards)])), axis)
    bad = mask & ((ids < 0) | (ids >= local_vocab * lax.axis_size(axis)))
    # An out-of-range active id poisons its row; the NaN lse makes its gradient NaN too.
    lse = jnp.where(bad[None], jnp.nan, shift + jnp.log(s))
    local = ids_k - start
    owned = mask & (local >= 0) & (local < local_vocab)
    local_ids = jnp.where(owned, local, -1).astype(ids_k.dtype)
    out = [_attach(shards[0], z_sel[0], lse[0], local_ids, mask_k, temp, axis)]
    if has_ref:
        out.append(jnp.where(mask, z_sel[1] - lse[1], 0.0))
    return out
