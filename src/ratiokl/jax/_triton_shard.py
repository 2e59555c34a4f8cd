"""One vocabulary block's log-probs with the kernels, inside ``shard_map`` (JAX's
``vocab_axis=`` on the ``"triton"`` / ``"interpret"`` backends).

A block's statistics from ``shard_stats_kernel``, one ``pmax`` and one ``psum``, and the
block's gradient from ``logp_backward_kernel`` with the global ``lse``. Each function
takes ``call`` first (``ratiokl.jax._route``'s backend table binds it).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._core.rows import bad_ids
from ratiokl.jax import _launch, _native
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._launch import TritonCall
from ratiokl.jax._varying import varies_over

__all__ = ["shard_logps", "shard_stats"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 9))
def _attach(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis: str, entropy: bool):
    """``(logp,)``, or ``(logp, H)`` with ``entropy`` (0 on inactive rows), differentiable
    w.r.t. this block ``policy`` (``ent``: the global entropy; a placeholder without it)."""
    del call, policy, local_ids, temp, axis
    active = mask_k != 0
    logp = jnp.where(active, z_a - lse, 0.0)
    return (logp, jnp.where(active, ent, 0.0)) if entropy else (logp,)


def _attach_fwd(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis, entropy):
    return _attach(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis, entropy), (
        policy, local_ids, mask_k, temp, lse, ent
    )


def _attach_bwd(call, axis, entropy, residuals, g):
    policy, local_ids, mask_k, temp, lse, ent = residuals
    # The kernel selects 0 on inactive rows (a NaN cotangent there stays out).
    coef = g[0].astype(jnp.float32)
    if entropy:  # the entropy's term rides in the kernel's KL slots (ENTROPY)
        grad = _launch.backward_op(call, (True, False, True), True)(
            policy, local_ids, mask_k, temp, lse, coef, lse, lse, g[1].astype(jnp.float32),
            ent)
    else:
        grad = _launch.backward_op(call, (True, False, False))(
            policy, local_ids, mask_k, temp, lse, coef, lse, lse, lse, lse)
    return grad.astype(policy.dtype), None, None, None, None, None, None


_attach.defvjp(_attach_fwd, _attach_bwd)


def shard_stats(call: TritonCall, blocks: Sequence[jax.Array], ids: jax.Array, mask: jax.Array,
                temp: jax.Array, axis: str, entropy: bool):
    """The global row values of this device's blocks ``[N, V_local]`` (no derivative):
    ``(z_a [k, N], lse [k, N], entropy [N], local ids [N])`` from ``shard_stats_kernel`` and
    one ``pmax`` and one ``psum`` (the entropy ``lse[0]`` without ``entropy``; the local ids
    ``a - start``, -1 where the action lies in another block). ``ids``, ``mask`` and
    ``temp`` as :func:`kernel_rows` makes them. An active id outside the global ``[0, V)``
    makes its row's ``lse`` and entropy NaN."""
    local_vocab = blocks[0].shape[-1]
    start = lax.axis_index(axis) * local_vocab
    stats = _launch.stats_op(call, len(blocks) > 1, entropy)(
        blocks[0], blocks[-1], ids, mask, temp, jnp.full((1,), start, ids.dtype)
    )
    lse_k, ref_lse_k, z_a, ref_z_a, mu = stats
    m = jnp.stack([lse_k, ref_lse_k][: len(blocks)])
    shift = _native.finite_or_zero(lax.pmax(m, axis))
    # A block's log-sum-exp is its (m, s) = (lse_k, 1).
    weights = jnp.exp(m - shift)
    terms = (weights, jnp.stack([z_a, ref_z_a][: len(blocks)]))
    if entropy:
        terms += (weights[0] * (mu - shift[0]),)
    s, z_sel, *h = lax.psum(terms, axis)
    bad = bad_ids(ids, mask, local_vocab * lax.axis_size(axis))
    # An out-of-range active id poisons its row; the NaN lse makes its gradient NaN too.
    lse = jnp.where(bad[None], jnp.nan, shift + jnp.log(s))
    ent = jnp.where(bad, jnp.nan, jnp.log(s[0]) - h[0] / s[0]) if entropy else lse[0]
    local = ids - start
    owned = mask & (local >= 0) & (local < local_vocab)
    return z_sel, lse, ent, jnp.where(owned, local, -1).astype(ids.dtype)


def shard_logps(
    call: TritonCall, shards: Sequence[jax.Array], ids: jax.Array, mask: jax.Array,
    temperature: Temperature, axis: str, entropy: bool = False,
) -> Tuple[List[jax.Array], Optional[jax.Array]]:
    """``logp`` float32 ``[N]`` per block in ``shards`` (policy, then optionally reference),
    and with ``entropy`` the policy's entropy ``[N]`` (else None).

    ``shards``: this device's ``[N, V_local]`` blocks; ``ids`` global, ``mask``
    bool, ``temperature`` a float or float32 ``[N]``, all replicated along
    ``axis``. The policy's ``logp`` and entropy are differentiable (the gradient is
    this block's slice of the unsharded one); the reference's is not. Inactive rows
    are 0 with a zero gradient; an active id outside the global ``[0, V)`` gives NaN
    (value and gradient). One ``pmax`` and one ``psum`` in all: the entropy adds one
    ``[N]`` term to the psum, ``W_k (mu_k - shift)`` (``W_k = exp(lse_k - shift)``,
    ``mu_k`` the block's mean ``z``), so ``H = log(S) - sum_k W_k (mu_k - shift) / S``.
    """
    if not varies_over(shards[0], axis):
        raise ValueError(
            f"backend='triton' / 'interpret' with vocab_axis={axis!r} needs the logits typed as "
            f"varying over {axis!r}: call it inside `jax.shard_map(..., check_vma=True)` (the default; with "
            "check_vma=False the gradient would be scaled by 1/axis_size), or use "
            "backend='native'"
        )
    ids_k, mask_k, temp = kernel_rows(ids, mask, temperature)
    z_sel, lse, ent, local_ids = shard_stats(
        call, [lax.stop_gradient(x) for x in shards], ids_k, mask_k, temp, axis, entropy)
    has_ref = len(shards) > 1
    policy_out = _attach(call, shards[0], z_sel[0], lse[0], ent, local_ids, mask_k, temp, axis,
                         entropy)
    out = [policy_out[0]]
    if has_ref:
        out.append(jnp.where(mask, z_sel[1] - lse[1], 0.0))
    return out, policy_out[1] if entropy else None
