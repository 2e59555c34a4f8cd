"""Every jax-triton launch of the JAX binding: one call function per kernel, vmap-ready.

Each ``*_call`` function launches ``ratiokl._kernels`` on ``[N, V]`` / ``[N]``
arrays through ``call``, a :data:`TritonCall`: ``ratiokl.jax._jax_triton.triton_call``
(the ``"triton"`` backend) or ``ratiokl.jax._interpret.triton_call`` (``"interpret"``:
the same launch through Triton's CPU interpreter). Each ``*_op`` factory, cached per
``call`` and static options, wraps one in a ``jax.custom_batching.custom_vmap``
(``triton_call`` has no batching rule): row-independent kernels fold batch dimensions
into rows (:func:`row_op`), the reductions over rows (weights, metrics) map the
framework ops instead. ``ratiokl.jax._triton`` gives them their derivatives
(``jax.custom_vjp``).

Launch details: block sizes come from ``ratiokl._kernels`` heuristics (no
autotuning, so CUDA-graph capture works); ``V`` and the strides are passed
as compile-time constants, which keeps the loads vectorised (jax-triton
gives runtime integers no alignment facts); the mask travels as bool; a
scalar temperature is a ``[1]`` array read with stride 0. ``jax_triton`` is
imported on the ``"triton"`` backend's first launch, through ``_jax_triton`` (versions
checked, the differences between 0.3.1 and 0.4 handled there); this module imports
neither it nor the interpreter. The kernels clamp ids and poison bad active rows with
NaN; nothing synchronises with the host.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence, Tuple

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
    shard_stats_kernel,
    split_plan,
    use_split_forward,
)
from ratiokl._kernels import loss_rows as row_kernels
from ratiokl._kernels.fused_loss import (
    PARTIAL_FIELDS,
    SCALE_WARPS,
    launch_plan,
    policy_loss_kernel,
    scale_block,
    scale_rows_kernel,
)
from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW
from ratiokl._core import objective as _objective
from ratiokl.jax._arrays import XP

__all__ = [
    "Static", "TritonCall", "backward_op", "forward_op", "fused_op", "metrics_op", "row_op",
    "native_weights", "scale_op", "stats_op", "weights_op",
]

#: A launch function with ``jax_triton.triton_call``'s signature (kernel, ``out_shape``,
#: grid and compile-time keywords): the one difference between the Triton backends.
TritonCall = Callable[..., Any]


# --- log-probs, ratio and KL -------------------------------------------------------------


def _forward_call(call: TritonCall, kl_code: int, has_ref: bool, entropy: bool, policy, ref,
                  ids, mask, old, ref_logps, temp):
    """``(logp, ratio, kl, dkl, lse)`` float32 ``[N]``: one launch, or partials + combine.

    ``entropy``: the kernels' ``ENTROPY`` mode (no reference, ``kl_code`` ``KL.NONE``): ``kl`` and
    ``dkl`` hold the entropy.

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
        stride_t=0 if temp.shape[0] == 1 else 1, HAS_REF=has_ref, ENTROPY=entropy,
    )
    if not use_split_forward(n_rows, plan):
        return tuple(call(
            policy, ref, ids, mask, old, ref_logps, temp,
            kernel=logp_forward_kernel, out_shape=[row] * 5, grid=(n_rows,),
            num_warps=config.num_warps, KL_CODE=kl_code,
            TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v, **sizes,
        ))
    parts = call(
        policy, ref, mask, temp,
        kernel=lse_partials_kernel,
        out_shape=jax.ShapeDtypeStruct((n_rows, plan.splits, 4), jnp.float32),
        grid=(n_rows, plan.splits), num_warps=config.num_warps, SPLITS=plan.splits,
        TILES_PER_SPLIT=plan.tiles_per_split, BLOCK_V=config.block_v, **sizes,
    )
    return tuple(call(
        policy, ref, ids, mask, old, ref_logps, temp, parts,
        kernel=logp_combine_kernel, out_shape=[row] * 5, grid=(n_rows,), num_warps=1,
        KL_CODE=kl_code, SPLITS=plan.splits, **sizes,
    ))


def _backward_call(call: TritonCall, terms: Tuple[bool, bool, bool], entropy: bool, policy,
                   ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl):
    """Gradient ``[N, V]`` in the logits' dtype; grid ``(N, S)``, ``S = backward_splits``.

    The kernel forms ``c = g_logp + g_ratio * ratio + g_kl * dkl`` per row;
    ``terms`` says which of the three are present (an absent one's arrays are
    placeholders, never read). ``entropy``: ``g_kl`` / ``dkl`` are the entropy's
    upstream gradient and value (the kernel's ``ENTROPY`` term instead of the KL's).
    """
    n_rows, vocab = policy.shape
    if n_rows == 0:
        return jnp.zeros(policy.shape, policy.dtype)
    config = backward_config(vocab, policy.dtype.itemsize)
    tiles = -(-vocab // config.block_v)
    per_prog = -(-tiles // backward_splits(n_rows, vocab, policy.dtype.itemsize))
    return call(
        policy, ids, mask, temp, lse, g_logp, g_ratio, ratio, g_kl, dkl,
        kernel=logp_backward_kernel, out_shape=jax.ShapeDtypeStruct(policy.shape, policy.dtype),
        grid=(n_rows, -(-tiles // per_prog)), num_warps=config.num_warps,
        V=vocab, stride_ln=vocab, stride_lv=1, stride_t=0 if temp.shape[0] == 1 else 1,
        stride_gl=1, stride_gr=1, stride_gk=1, tiles_per_prog=per_prog,
        HAS_G_LOGP=terms[0], HAS_G_RATIO=terms[1], HAS_G_KL=terms[2], ENTROPY=entropy,
        BLOCK_V=config.block_v,
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


def row_op(call: Callable, temp_index: int, shared: Tuple[int, ...] = ()) -> Callable:
    """``call`` (rows first in every argument) with a vmap rule that folds the batch into rows.

    ``shared``: positions of arguments that are not per row (the fused loss's
    coefficients): passed as they are, and not batchable.
    """
    op = jax.custom_batching.custom_vmap(call)

    @op.def_vmap
    def _rule(axis_size: int, in_batched: Sequence[bool], *args):
        rows = args[0].shape[1] if in_batched[0] else args[0].shape[0]
        if any(in_batched[i] for i in shared):
            raise ValueError(
                "policy_loss's coefficients (kl_coef, clip_eps, clip_eps_high) cannot be "
                "vmapped over on the triton backend; pass one value for the whole batch"
            )
        folded = [
            x if i in shared else _fold(axis_size, b, x, rows, i == temp_index)
            for i, (b, x) in enumerate(zip(in_batched, args))
        ]
        outs = op(*folded)
        unfold = lambda o: o.reshape((axis_size, rows) + o.shape[1:])  # noqa: E731
        unfolded = jax.tree_util.tree_map(unfold, outs)
        return unfolded, jax.tree_util.tree_map(lambda _: True, outs)

    return op


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


# --- the fused policy loss ----------------------------------------------------------------

#: (has_ref, has_iw, kl_code, has_neg_cap, bound, objective code, entropy_grad, on_policy):
#: static (on_policy: no old log-probs, ``old`` is a placeholder the kernel never reads).
Static = Tuple[bool, bool, int, bool, float, int, bool, bool]


def _fused_call(call: TritonCall, static: Static, write_grad: bool, inplace: bool, policy, ref,
                ids, mask, old, ref_lp, temp, adv, iw, w, coefs):
    """``(loss_rows, logp, ratio, kl, entropy, clip_bits, grad)`` from one launch.

    Without ``write_grad`` (the primal, no derivative taken) the kernel reads
    each row once and ``grad`` is an unwritten ``[N, 1]`` placeholder.
    ``inplace``: ``grad`` aliases ``policy``'s buffer (``input_output_aliases``;
    the kernel reads each tile before overwriting it). XLA honours it without a
    copy only where ``policy`` is not needed afterwards, e.g. donated to ``jit``.
    """
    n_rows, vocab = policy.shape
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    shapes = [row] * 5 + [
        jax.ShapeDtypeStruct((n_rows,), jnp.int32),
        jax.ShapeDtypeStruct((n_rows, vocab if write_grad else 1), policy.dtype),
    ]
    if n_rows == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
    has_ref, has_iw, kl_code, has_neg_cap, bound, objective, entropy_grad, on_policy = static
    plan = launch_plan(vocab, policy.dtype.itemsize, n_rows, write_grad)
    n_counters = plan.counters(n_rows)  # 0: none used, none zeroed (any buffer will do)
    scratch = [jax.ShapeDtypeStruct((n_rows, plan.spans.splits, PARTIAL_FIELDS.value),
                                    jnp.float32),
               jax.ShapeDtypeStruct((n_counters or 1,), jnp.int32)]  # partials; counters
    grad_out, counters_out = len(shapes) - 1, len(shapes) + 1
    aliases = {"input_output_aliases": {0: grad_out}} if inplace and write_grad else {}
    outs = call(
        policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs,
        kernel=policy_loss_kernel, out_shape=shapes + scratch,
        zeroed_outputs=(counters_out,) if n_counters else (),
        grid=(plan.programs(n_rows),), num_warps=plan.config.num_warps,
        N=n_rows, V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1, adv_rows=1,
        HAS_REF=has_ref, HAS_IW=has_iw, KL_CODE=kl_code, HAS_NEG_CAP=has_neg_cap, BOUND=bound,
        OBJECTIVE=objective, ON_POLICY=on_policy, ENTROPY_GRAD=entropy_grad,
        WRITE_GRAD=write_grad, SPLITS=plan.spans.splits, TILES_PER_SPLIT=plan.spans.tiles_per_split,
        SPANS=plan.spans_per_program, BLOCK_V=plan.config.block_v, **aliases,
    )
    return tuple(outs[:len(shapes)])


def _scale_call(call: TritonCall, grad, g, mask):
    """``grad[i] * g[i]`` on active rows with ``g[i] != 1``, in ``grad``'s (aliased) buffer."""
    n_rows, vocab = grad.shape
    if n_rows == 0:
        return grad
    return call(
        grad, g, mask,
        kernel=scale_rows_kernel, out_shape=jax.ShapeDtypeStruct(grad.shape, grad.dtype),
        grid=(n_rows,), num_warps=SCALE_WARPS, input_output_aliases={0: 0},
        V=vocab, stride_g=1, BLOCK_V=scale_block(vocab),
    )


@functools.lru_cache(maxsize=None)
def fused_op(call: TritonCall, static: Static, write_grad: bool,
             inplace: bool = False) -> Callable:
    """The fused policy loss through ``call`` (see :func:`_fused_call`)."""
    launch = functools.partial(_fused_call, call, static, write_grad, inplace)
    return row_op(launch, temp_index=6, shared=(10,))


@functools.lru_cache(maxsize=None)
def scale_op(call: TritonCall) -> Callable:
    """The gradient's in-place row scaling through ``call`` (see :func:`_scale_call`)."""
    return row_op(functools.partial(_scale_call, call), temp_index=-1)


# --- the row vectors around it: aggregation weights, metrics --------------------------------


def _vmapped(native, axis_size: int, in_batched: Sequence[bool], *args):
    """A ``custom_vmap`` rule: ``native`` mapped over the batched arguments."""
    del axis_size
    axes = [0 if b else None for b in in_batched]
    out = jax.vmap(native, in_axes=axes)(*args)
    return out, jax.tree_util.tree_map(lambda _: True, out)


def native_weights(denom: float, count: bool, mask: jax.Array) -> jax.Array:
    """``where(mask, 1 / D, 0)``, ``D`` the active count (at least 1) or ``denom``: what
    ``_objective.aggregation_weights`` computes where every active token weighs the same."""
    d = jnp.maximum(jnp.sum(mask, dtype=jnp.int32), 1) if count else denom
    return jnp.where(mask, 1.0 / d, 0.0).astype(jnp.float32)


def _weights_call(call: TritonCall, mask: jax.Array) -> jax.Array:
    """``token_weights_kernel``: ``D`` the active count."""
    if not mask.size:
        return jnp.zeros(mask.shape, jnp.float32)
    w = call(
        mask.reshape(-1), kernel=row_kernels.token_weights_kernel,
        out_shape=jax.ShapeDtypeStruct((mask.size,), jnp.float32), grid=(1,),
        num_warps=row_kernels.ROWS_WARPS, N=mask.size, BLOCK=row_kernels.ROWS_BLOCK,
    )
    return w.reshape(mask.shape)


@functools.lru_cache(maxsize=None)
def weights_op(call: TritonCall) -> Callable:
    """The token-mean weights through ``call`` (see :func:`_weights_call`); vmapped: the
    framework ops."""
    op = jax.custom_batching.custom_vmap(functools.partial(_weights_call, call))
    op.def_vmap(functools.partial(_vmapped, functools.partial(native_weights, 1.0, True)))
    return op


def _native_metrics(mask, logp, ratio, kl, ent, bits, old,
                    loss_rows) -> Tuple[jax.Array, jax.Array]:
    """``policy_metrics_kernel``'s outputs (the ``[8]`` means, the loss) from
    ``_objective.token_metrics``."""
    metrics = _objective.token_metrics(
        XP, mask, jnp.sum(mask, dtype=jnp.int32), (bits & CLIP_LOW.value) != 0,
        (bits & CLIP_HIGH.value) != 0, (bits & CLIP_CAPPED.value) != 0, ratio, kl,
        jnp.where(mask, old, 0.0) - logp, ent,
    )
    total = jnp.sum(jnp.where(mask, loss_rows, 0.0))
    return jnp.stack([metrics[name] for name in row_kernels.METRIC_NAMES]), total


def _metrics_call(call: TritonCall, mask, logp, ratio, kl, ent, bits, old,
                  loss_rows) -> Tuple[jax.Array, jax.Array]:
    n_metrics = len(row_kernels.METRIC_NAMES)
    if not mask.shape[0]:
        return jnp.zeros((n_metrics,), jnp.float32), jnp.zeros((), jnp.float32)
    means, total = call(
        mask, logp, ratio, kl, ent, bits, old, loss_rows,
        kernel=row_kernels.policy_metrics_kernel,
        out_shape=[jax.ShapeDtypeStruct((n_metrics,), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.float32)], grid=(1,),
        num_warps=row_kernels.ROWS_WARPS, N=mask.shape[0], BLOCK=row_kernels.ROWS_BLOCK,
    )
    return means, total


@functools.lru_cache(maxsize=None)
def metrics_op(call: TritonCall) -> Callable:
    """The metrics' means and the loss through ``call``; vmapped: the framework ops."""
    op = jax.custom_batching.custom_vmap(functools.partial(_metrics_call, call))
    op.def_vmap(functools.partial(_vmapped, _native_metrics))
    return op


# --- one vocabulary shard (vocab-parallel) -----------------------------------------------------


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


