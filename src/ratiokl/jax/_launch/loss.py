"""The fused policy loss's launches: loss + metrics' row values + gradient, the metrics'
means, and the gradient's row scaling.
"""

from __future__ import annotations

import functools
from typing import Callable, Tuple

import jax
import jax.numpy as jnp

from ratiokl._core import objective as _objective
from ratiokl._core import rollout as _rollout
from ratiokl._kernels import loss_rows as row_kernels
from ratiokl._kernels.fused_loss import policy_loss_kernel, scale_rows_kernel
from ratiokl._kernels.heuristics import SCALE_WARPS, launch_plan, scale_block
from ratiokl._kernels.meeting import PARTIAL_FIELDS
from ratiokl._kernels.objective import CLIP_CAPPED, CLIP_HIGH, CLIP_LOW
from ratiokl.jax._arrays import XP
from ratiokl.jax._launch.vmap import TritonCall, mapped, row_op
from ratiokl.spec import ROLLOUT_PARITY_NAMES, ROLLOUT_PARITY_TOLERANCES

__all__ = ["Static", "fused_op", "metrics_op", "scale_op"]


#: (has_ref, has_iw, kl_code, has_neg_cap, bound, objective code, entropy_grad, on_policy):
#: static (on_policy: no old log-probs, ``old`` is a placeholder the kernel never reads).
Static = Tuple[bool, bool, int, bool, float, int, bool, bool]


def _fused_call(call: TritonCall, static: Static, write_grad: bool, inplace: bool,
                adv_rows: int, policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs):
    """``(loss_rows, logp, ratio, kl, entropy, clip_bits, grad)`` from one launch; ``adv``
    holds one advantage per ``adv_rows`` rows.

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
        stride_t=0 if temp.shape[0] == 1 else 1, adv_rows=adv_rows,
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
def fused_op(call: TritonCall, static: Static, write_grad: bool, inplace: bool = False,
             adv_rows: int = 1) -> Callable:
    """The fused policy loss through ``call`` (see :func:`_fused_call`); under ``vmap`` the
    batch folds into rows, ``[B, N // adv_rows]`` advantages into ``B * N // adv_rows``."""
    launch = functools.partial(_fused_call, call, static, write_grad, inplace, adv_rows)
    return row_op(launch, temp_index=6, shared=(10,))


@functools.lru_cache(maxsize=None)
def scale_op(call: TritonCall) -> Callable:
    """The gradient's in-place row scaling through ``call`` (see :func:`_scale_call`)."""
    return row_op(functools.partial(_scale_call, call), temp_index=-1)


def _native_metrics(mask, logp, ratio, kl, ent, bits, old, loss_rows,
                    *rollout) -> Tuple[jax.Array, jax.Array]:
    """``policy_metrics_kernel``'s outputs (the means, the loss) from
    ``_objective.token_metrics`` (and with ``rollout``, ``_rollout.parity``)."""
    metrics = _objective.token_metrics(
        XP, mask, jnp.sum(mask, dtype=jnp.int32), (bits & CLIP_LOW.value) != 0,
        (bits & CLIP_HIGH.value) != 0, (bits & CLIP_CAPPED.value) != 0, ratio, kl,
        jnp.where(mask, old, 0.0) - logp, ent,
    )
    names = row_kernels.METRIC_NAMES
    if rollout:
        metrics.update(_rollout.parity(XP, mask, logp, rollout[0]))
        names = names + ROLLOUT_PARITY_NAMES
    total = jnp.sum(jnp.where(mask, loss_rows, 0.0))
    return jnp.stack([metrics[name] for name in names]), total


def _metrics_call(call: TritonCall, mask, logp, ratio, kl, ent, bits, old, loss_rows,
                  *rollout) -> Tuple[jax.Array, jax.Array]:
    n_metrics = len(row_kernels.METRIC_NAMES) + (row_kernels.PARITY_METRICS if rollout else 0)
    if not mask.shape[0]:
        return jnp.zeros((n_metrics,), jnp.float32), jnp.zeros((), jnp.float32)
    means, total = call(
        mask, logp, ratio, kl, ent, bits, old, loss_rows, rollout[0] if rollout else logp,
        kernel=row_kernels.policy_metrics_kernel,
        out_shape=[jax.ShapeDtypeStruct((n_metrics,), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.float32)], grid=(1,),
        num_warps=row_kernels.ROWS_WARPS, N=mask.shape[0], HAS_ROLLOUT=bool(rollout),
        **row_kernels.parity_constexprs(ROLLOUT_PARITY_TOLERANCES), BLOCK=row_kernels.ROWS_BLOCK,
    )
    return means, total


@functools.lru_cache(maxsize=None)
def metrics_op(call: TritonCall) -> Callable:
    """The metrics' means and the loss through ``call`` (a ninth argument, the engine's
    log-probs ``[N]``, adds the parity fractions); vmapped: the framework ops."""
    op = jax.custom_batching.custom_vmap(functools.partial(_metrics_call, call))
    op.def_vmap(functools.partial(mapped, _native_metrics))
    return op
