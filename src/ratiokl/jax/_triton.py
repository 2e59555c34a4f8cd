"""The ``"triton"`` and ``"interpret"`` JAX backends on flattened rows: the kernels'
launches with derivatives.

The functions ``ratiokl.jax._route`` calls with validated ``[N, V]`` logits
and ``[N]`` per-row arrays, on the very kernels ``ratiokl.torch`` launches
(``ratiokl.jax._launch`` holds the launches and their ``vmap`` rules). Each takes
``call`` first, the launch function (:data:`ratiokl.jax._launch.TritonCall`), and
``ratiokl.jax._route``'s backend table binds them to one: ``jax_triton.triton_call`` for
``"triton"``, the interpreter's stand-in (``ratiokl.jax._interpret``) for
``"interpret"``, each through :func:`typed_call`. The rest is
one code path for both. Here ``selected_logprobs`` / ``ratio_kl`` /
``logprobs_entropy``: one ``jax.custom_vjp`` whose forward runs the row forward (per row
``logp``, ``ratio``, ``kl``, ``dkl/dlogp``, ``lse``; few rows: partials + combine, the
same bits) and whose backward runs ``logp_backward_kernel``, which forms ``c = g_logp +
g_ratio * ratio + g_kl * dkl`` per row itself (0 on inactive rows), in the logits' dtype.
The fused ``policy_loss`` is ``ratiokl.jax._triton_loss``'s, ``shard_logps``
(``vocab_axis=``) ``ratiokl.jax._triton_shard``'s, the ops from hidden states
``ratiokl.jax._linear``'s and ``_linear_logprobs``'s: the same table binds them all.

The kernels clamp ids and poison bad active rows with NaN; nothing
synchronises with the host.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ratiokl._codes import KL
from ratiokl.jax import _launch
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._launch import TritonCall
from ratiokl.jax._varying import varying_axes

__all__ = ["logprobs_entropy", "ratio_kl", "selected_logprobs", "typed_call"]


@functools.lru_cache(maxsize=None)
def typed_call(call: TritonCall) -> TritonCall:
    """``call`` with its results typed as varying over every ``shard_map`` axis one of its
    arrays varies over. jax-triton's and the interpreter's launches type their results
    invariant; inside ``shard_map`` over rows (data parallelism) a loss typed invariant
    made ``pmean`` a no-op whose transpose multiplied the gradients by the axis size, and a
    ``custom_vjp`` whose backward returned invariant gradients for varying inputs failed to
    trace."""

    @functools.wraps(call)
    def typed(*args, **keywords):
        axes = frozenset().union(*(varying_axes(a) for a in args if isinstance(a, jax.Array)))
        out = call(*args, **keywords)
        if not axes:
            return out
        return jax.tree.map(lambda x: x if axes <= varying_axes(x) else lax.pcast(
            x, tuple(sorted(axes - varying_axes(x))), to="varying"), out)

    return typed


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 9))
def _op(call, policy, ref, ids, mask, old, ref_logps, temp, kl_code: int, has_ref: bool):
    logp, ratio, kl, _, _ = _launch.forward_op(call, kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return logp, ratio, kl


def _op_fwd(call, policy, ref, ids, mask, old, ref_logps, temp, kl_code, has_ref):
    logp, ratio, kl, dkl, lse = _launch.forward_op(call, kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return (logp, ratio, kl), (policy, ids, mask, temp, lse, ratio, dkl)


def _op_bwd(call, kl_code, has_ref, residuals, cotangents):
    del kl_code, has_ref  # the forward's ratio and dkl carry what the estimator needs
    policy, ids, mask, temp, lse, ratio, dkl = residuals
    g_logp, g_ratio, g_kl = (g.astype(jnp.float32) for g in cotangents)
    # The kernel forms c = g_logp + g_ratio * ratio + g_kl * dkl, selecting 0 on inactive
    # rows (never multiplying: a NaN cotangent there stays out).
    grad = _launch.backward_op(call, (True, True, True))(policy, ids, mask, temp, lse, g_logp,
                                                         g_ratio, ratio, g_kl, dkl)
    # custom_vjp does not force the cotangent's dtype: keep the logits' dtype.
    return grad.astype(policy.dtype), None, None, None, None, None, None


_op.defvjp(_op_fwd, _op_bwd)


def selected_logprobs(
    call: TritonCall, logits: jax.Array, ids: jax.Array, mask: jax.Array,
    temperature: Temperature,
) -> jax.Array:
    """Float32 ``logp[N]`` of ``logits[N, V]``; 0 on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``logits`` (gradient in its dtype).
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    # Placeholders, never read (KL_CODE = 0): an existing array, so nothing is computed.
    logp, _, _ = _op(call, logits, logits, ids, mask_k, temp, temp, temp, KL.NONE.value, False)
    return logp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _entropy_op(call, policy, ids, mask, temp):
    logp, _, ent, _, _ = _launch.forward_op(call, KL.NONE.value, False, True)(
        policy, policy, ids, mask, temp, temp, temp)
    return logp, ent


def _entropy_op_fwd(call, *primals):
    # symbolic_zeros: each array comes as a CustomVJPPrimal (its value, whether perturbed).
    policy, ids, mask, temp = (p.value for p in primals)
    logp, _, ent, _, lse = _launch.forward_op(call, KL.NONE.value, False, True)(
        policy, policy, ids, mask, temp, temp, temp)
    return (logp, ent), (policy, ids, mask, temp, lse, ent)


def _entropy_op_bwd(call, residuals, cotangents):
    policy, ids, mask, temp, lse, ent = residuals
    # A symbolic-zero cotangent (an output nothing differentiates: the entropy of
    # policy_loss with entropy_coef=0) is a term the kernel leaves out.
    g_logp, g_ent = (None if isinstance(g, SymbolicZero) else g.astype(jnp.float32)
                     for g in cotangents)
    if g_logp is None and g_ent is None:
        return jnp.zeros_like(policy), None, None, None
    # The entropy's term rides in the kernel's KL slots (ENTROPY): -g_ent p (log p + H) / T.
    grad = _launch.backward_op(call, (g_logp is not None, False, g_ent is not None),
                               g_ent is not None)(
        policy, ids, mask, temp, lse, lse if g_logp is None else g_logp, lse, lse,
        lse if g_ent is None else g_ent, ent)
    return grad.astype(policy.dtype), None, None, None


_entropy_op.defvjp(_entropy_op_fwd, _entropy_op_bwd, symbolic_zeros=True)


def logprobs_entropy(
    call: TritonCall, logits: jax.Array, ids: jax.Array, mask: jax.Array,
    temperature: Temperature,
) -> Tuple[jax.Array, jax.Array]:
    """Float32 ``(logp[N], entropy[N])`` from one read of ``logits[N, V]``; 0 on inactive
    rows, NaN on bad-id rows. Differentiable w.r.t. ``logits`` through both."""
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    return _entropy_op(call, logits, ids, mask_k, temp)


def ratio_kl(
    call: TritonCall, policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array, ref_logps: Optional[jax.Array], kl_code: int,
    temperature: Temperature,
) -> Tuple[jax.Array, jax.Array]:
    """Float32 ``(ratio[N], kl[N])``: ``(1, 0)`` on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``policy`` only.
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    old = jax.lax.stop_gradient(old_logps.astype(jnp.float32))
    if ref is None:
        ref_in, has_ref = policy, False  # placeholder, never read (HAS_REF = False)
        ref_lp = jax.lax.stop_gradient(ref_logps.astype(jnp.float32))
    else:
        ref_in, has_ref = jax.lax.stop_gradient(ref), True
        ref_lp = old  # placeholder, never read (HAS_REF: the kernel computes it)
    _, ratio, kl = _op(call, policy, ref_in, ids, mask_k, old, ref_lp, temp, kl_code, has_ref)
    return ratio, kl
