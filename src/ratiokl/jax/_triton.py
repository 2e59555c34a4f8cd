"""The ``"triton"`` JAX backend: ``ratiokl._kernels`` launched through ``jax_triton``.

Implements the backend interface documented in ``ratiokl.jax._dispatch``
on flattened inputs (logits ``[N, V]``, per-row arrays ``[N]``) with the
very kernel functions that ``ratiokl.torch._triton`` launches:

* one ``jax.custom_vjp`` whose forward runs ``logp_forward_kernel`` (per
  row: ``logp``, ``ratio``, ``kl``, ``dkl/dlogp``, ``lse``; few rows:
  ``lse_partials_kernel`` + ``logp_combine_kernel``, the same bits) and whose
  backward runs ``logp_backward_kernel``, which forms ``c = g_logp + g_ratio *
  ratio + g_kl * dkl`` per row itself (0 on inactive rows), cast to the
  logits' dtype;
* each kernel call is a ``jax.custom_batching.custom_vmap`` that folds batch
  dimensions into rows (the op is row-independent; ``triton_call`` has no
  batching rule), so ``jit``, ``grad`` and ``vmap`` compose.

Launch details: block sizes come from ``ratiokl._kernels`` heuristics (no
autotuning, so CUDA-graph capture works); ``V`` and the strides are passed
as compile-time constants, which keeps the loads vectorised (jax-triton
gives runtime integers no alignment facts); the mask travels as bool; a
scalar temperature is a ``[1]`` array read with stride 0. ``jax_triton`` is
imported on first launch, restoring ``TRITON_CACHE_DIR`` (jax-triton 0.3.1
empties it on import, which breaks every later Triton compile in the
process, PyTorch's included). The kernels clamp ids and poison bad active
rows with NaN whatever ``check_ids`` says; nothing synchronises with the host.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Callable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp

from ratiokl._kernels import (
    backward_config,
    backward_splits,
    forward_config,
    logp_backward_kernel,
    logp_combine_kernel,
    logp_forward_kernel,
    lse_partials_kernel,
    split_plan,
    use_split_forward,
)

__all__ = ["import_jax_triton", "ratio_kl", "selected_logprobs"]

Temperature = Union[float, jax.Array]


def import_jax_triton() -> ModuleType:
    """``import jax_triton`` without letting it clear ``TRITON_CACHE_DIR`` for the process.

    An empty value (what jax-triton sets, also when something imported it
    earlier) is never usable, so it is removed rather than kept.
    """
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    finally:
        if saved:
            os.environ["TRITON_CACHE_DIR"] = saved
        else:
            os.environ.pop("TRITON_CACHE_DIR", None)
    return jax_triton


def _triton_call(*args, **kwargs):
    """``jax_triton.triton_call`` (the one launch point; tests may substitute it)."""
    return import_jax_triton().triton_call(*args, **kwargs)


# --- kernel calls on [N, V] / [N] arrays ---------------------------------------------------


def _forward_call(kl_code: int, has_ref: bool, policy, ref, ids, mask, old, ref_logps, temp):
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]``: one launch, or partials + combine.

    Few rows (``use_split_forward``) run a program per (row, vocabulary
    split) and a per-row combine; the bits are those of the one-launch path.
    """
    n_rows, vocab = policy.shape
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    if n_rows == 0:
        return tuple(jnp.zeros((0,), jnp.float32) for _ in range(5))
    config = forward_config(vocab, policy.dtype.itemsize)
    plan = split_plan(vocab, config.block_v)
    sizes = dict(
        V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1, HAS_REF=has_ref,
    )
    if not use_split_forward(n_rows, plan):
        return tuple(_triton_call(
            policy, ref, ids, mask, old, ref_logps, temp,
            kernel=logp_forward_kernel, out_shape=[row] * 5, grid=(n_rows,),
            num_warps=config.num_warps, KL_CODE=kl_code,
            TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v, **sizes,
        ))
    parts = _triton_call(
        policy, ref, mask, temp,
        kernel=lse_partials_kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows, plan.splits, 4), jnp.float32),
        grid=(n_rows, plan.splits), num_warps=config.num_warps, SPLITS=plan.splits,
        TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v, **sizes,
    )
    return tuple(_triton_call(
        policy, ref, ids, mask, old, ref_logps, temp, parts,
        kernel=logp_combine_kernel, out_shape=[row] * 5, grid=(n_rows,), num_warps=1,
        KL_CODE=kl_code, SPLITS=plan.splits, **sizes,
    ))


def _backward_call(terms: Tuple[bool, bool, bool], policy, ids, mask, temp, lse, g_logp,
                   g_ratio, ratio, g_kl, dkl):
    """Gradient ``[N, V]`` in the logits' dtype; grid ``(N, S)``, ``S = backward_splits``.

    The kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per row;
    ``terms`` says which of the three are present (an absent one's arrays are
    placeholders, never read).
    """
    n_rows, vocab = policy.shape
    if n_rows == 0:
        return jnp.zeros(policy.shape, policy.dtype)
    config = backward_config(vocab, policy.dtype.itemsize)
    tiles = -(-vocab // config.block_v)
    per_prog = -(-tiles // backward_splits(n_rows, vocab, policy.dtype.itemsize))
    return _triton_call(
        policy, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl,
        kernel=logp_backward_kernel, out_shape=jax.ShapeDtypeStruct(policy.shape, policy.dtype),
        grid=(n_rows, -(-tiles // per_prog)), num_warps=config.num_warps,
        V=vocab, stride_ln=vocab, stride_lv=1, stride_t=0 if temp.shape[0] == 1 else 1,
        stride_gl=1, stride_gr=1, stride_gk=1, tiles_per_prog=per_prog,
        HAS_G_LOGP=terms[0], HAS_G_RATIO=terms[1], HAS_G_KL=terms[2], BLOCK_V=config.block_v,
    )


# --- vmap: fold batch dimensions into rows -------------------------------------------------


def _fold(axis_size: int, batched: bool, x: jax.Array, rows: int, is_temp: bool) -> jax.Array:
    """``x`` (``[B, ...]`` if batched) as rows ``[B * rows, ...]``.

    An unbatched scalar temperature (``[1]``, read with stride 0) stays as it is.
    """
    if is_temp and not batched and x.shape == (1,):
        return x
    x = x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
    if is_temp and x.shape[1] == 1:
        x = jnp.broadcast_to(x, (axis_size, rows))
    return x.reshape((axis_size * x.shape[1],) + x.shape[2:])


def _row_op(call: Callable, temp_index: int) -> Callable:
    """``call`` (rows first in every argument) with a vmap rule that folds the batch into rows."""
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size: int, in_batched: Sequence[bool], *args):
        rows = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        folded = [
            _fold(axis_size, b, x, rows, i == temp_index)
            for i, (b, x) in enumerate(zip(in_batched, args))
        ]
        outs = op(*folded)
        unfold = lambda o: o.reshape((axis_size, rows) + o.shape[1:])  # noqa: E731
        unfolded = jax.tree_util.tree_map(unfold, outs)
        return unfolded, jax.tree_util.tree_map(lambda _: True, outs)

    return op


@functools.lru_cache(maxsize=None)
def _forward_op(kl_code: int, has_ref: bool) -> Callable:
    return _row_op(functools.partial(_forward_call, kl_code, has_ref), temp_index=6)


@functools.lru_cache(maxsize=None)
def backward_op(terms: Tuple[bool, bool, bool]) -> Callable:
    """The backward kernel call for these upstream terms (see :func:`_backward_call`)."""
    return _row_op(functools.partial(_backward_call, terms), temp_index=3)


# --- differentiation -----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _op(policy, ref, ids, mask, old, ref_logps, temp, kl_code: int, has_ref: bool):
    logp, ratio, kl, _, _ = _forward_op(kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return logp, ratio, kl


def _op_fwd(policy, ref, ids, mask, old, ref_logps, temp, kl_code, has_ref):
    logp, ratio, kl, dkl, lse = _forward_op(kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return (logp, ratio, kl), (policy, ids, mask, temp, lse, ratio, dkl)


def _op_bwd(kl_code, has_ref, residuals, cotangents):
    del kl_code, has_ref  # the forward's ratio and dkl carry what the estimator needs
    policy, ids, mask, temp, lse, ratio, dkl = residuals
    g_logp, g_ratio, g_kl = (g.astype(jnp.float32) for g in cotangents)
    # The kernel forms c = g_logp + g_ratio * ratio + g_kl * dkl, selecting 0 on inactive
    # rows (never multiplying: a NaN cotangent there stays out).
    grad = backward_op((True, True, True))(policy, ids, mask, temp, lse, g_logp, g_ratio,
                                           ratio, g_kl, dkl)
    # custom_vjp does not force the cotangent's dtype: keep the logits' dtype.
    return grad.astype(policy.dtype), None, None, None, None, None, None


_op.defvjp(_op_fwd, _op_bwd)


# --- backend interface ---------------------------------------------------------------------


def _rows(ids: jax.Array, mask: jax.Array, temperature: Temperature):
    """Kernel-ready ids (int32/int64), bool mask and float32 temperature (``[1]`` or ``[N]``).

    The kernels read the bool mask as it is (one byte per row, as torch's), so
    no conversion runs on the device.
    """
    if ids.dtype not in (jnp.int32, jnp.int64):
        ids = ids.astype(jnp.int32)
    if isinstance(temperature, (int, float)):
        temp = jnp.full((1,), temperature, dtype=jnp.float32)
    else:
        temp = jnp.asarray(temperature, dtype=jnp.float32)
    return ids, mask.astype(jnp.bool_), temp


def selected_logprobs(
    logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: Temperature,
    check_ids: bool,
) -> jax.Array:
    """Float32 ``logp[N]`` of ``logits[N, V]``; 0 on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``logits`` (gradient in its dtype). ``check_ids``
    is accepted for the interface; the kernel poisons bad ids regardless.
    """
    del check_ids
    ids, mask_k, temp = _rows(ids, mask, temperature)
    # Placeholders, never read (KL_CODE = 0): an existing array, so nothing is computed.
    logp, _, _ = _op(logits, logits, ids, mask_k, temp, temp, temp, 0, False)
    return logp


def ratio_kl(
    policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array, mask: jax.Array,
    old_logps: jax.Array, ref_logps: Optional[jax.Array], kl_code: int,
    temperature: Temperature, check_ids: bool,
) -> Tuple[jax.Array, jax.Array]:
    """Float32 ``(ratio[N], kl[N])``: ``(1, 0)`` on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``policy`` only. ``check_ids`` as in :func:`selected_logprobs`.
    """
    del check_ids
    ids, mask_k, temp = _rows(ids, mask, temperature)
    old = jax.lax.stop_gradient(old_logps.astype(jnp.float32))
    if ref is None:
        ref_in, has_ref = policy, False  # placeholder, never read (HAS_REF = False)
        ref_lp = jax.lax.stop_gradient(ref_logps.astype(jnp.float32))
    else:
        ref_in, has_ref = jax.lax.stop_gradient(ref), True
        ref_lp = old  # placeholder, never read (HAS_REF: the kernel computes it)
    _, ratio, kl = _op(policy, ref_in, ids, mask_k, old, ref_lp, temp, kl_code, has_ref)
    return ratio, kl
