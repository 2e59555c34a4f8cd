"""The fused policy loss of the ``"triton"`` / ``"interpret"`` JAX backends, on flattened rows.

The fused kernel writes per row ``w * loss_t``, the metrics' values and the policy-logit
gradient of ``sum_t w_t * loss_t`` in one program; a ``jax.custom_vjp`` keeps that
gradient as its residual and its backward scales it by the cotangent
(``scale_rows_kernel``, aliased in place, skipped on the device where the cotangent is 1).
The primal (no derivative taken) skips the gradient sweep: one read of each row. The
coefficients (``kl_coef``, the clip bounds, ``entropy_coef``) are a run-time ``[5]``
array. Each function takes ``call`` first (``ratiokl.jax._route``'s backend table binds it).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._codes import KL
from ratiokl._core.route import uniform_weights
from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.jax import _launch
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._launch import Static, TritonCall
from ratiokl.spec import (ROLLOUT_METRIC_NAMES, ROLLOUT_PARITY_NAMES, PolicyLossOptions,
                          RolloutOptions)

__all__ = ["fused_static", "kernel_coefficients", "policy_loss", "rollout_weights",
           "token_weights"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 12, 13, 14))
def _fused(call, policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs, static: Static,
           inplace: bool, adv_rows: int):
    return _launch.fused_op(call, static, False, adv_rows=adv_rows)(
        policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs)[:-1]


def _fused_fwd(call, policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs, static,
               inplace, adv_rows):
    outs = _launch.fused_op(call, static, True, inplace, adv_rows)(
        policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs)
    return outs[:-1], (outs[-1], mask)


def _fused_bwd(call, static, inplace, adv_rows, residuals, cotangents):
    del static, inplace, adv_rows
    grad, mask = residuals
    g_loss = cotangents[0].astype(jnp.float32)
    return (_launch.scale_op(call)(grad, g_loss, mask),) + (None,) * 10


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_static(opts: PolicyLossOptions, ref_logits: bool, ref_logps: bool,
                 iw: bool, old: bool) -> Static:
    """The fused kernel's compile-time options for ``opts``: whether reference logits,
    reference log-probs (either gives the KL), importance weights and old log-probs (else
    on-policy) are given."""
    has_ref = ref_logits or ref_logps
    return (ref_logits, iw, opts.kl_code if has_ref else KL.NONE.value,
            opts.neg_cap is not None, opts.log_ratio_bound or 0.0, opts.objective_code,
            opts.uses_entropy, not old)


def kernel_coefficients(opts: PolicyLossOptions) -> jax.Array:
    """Float32 ``[5]`` the fused kernel reads at run time (no derivative): ``(kl_coef, ratio
    floor, ratio ceiling, negative-advantage cap, entropy_coef)``; traced values pass through."""
    return lax.stop_gradient(jnp.stack([
        jnp.asarray(c, jnp.float32) for c in (
            opts.kl_coef, opts.ratio_low, opts.ratio_high,
            jnp.inf if opts.neg_cap is None else opts.neg_cap, opts.entropy_coef)
    ]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows_total(rows: int, loss_rows: jax.Array, total: jax.Array) -> jax.Array:
    """``sum(loss_rows)``, given already summed (``total``): the sum's gradient, no reduction.

    The backward hands every row the upstream value (a broadcast).
    """
    del rows, loss_rows
    return total


def _rows_total_fwd(rows, loss_rows, total):
    del rows, loss_rows
    return total, None


def _rows_total_bwd(rows, _, g):
    return jnp.broadcast_to(g, (rows,)), jnp.zeros_like(g)


_rows_total.defvjp(_rows_total_fwd, _rows_total_bwd)


def token_weights(call: TritonCall, mask: jax.Array, opts: PolicyLossOptions,
                  normalizer: object, width: int) -> Optional[jax.Array]:
    """:func:`ratiokl._core.route.uniform_weights` on ``mask [N]`` (documented there)."""
    mask = mask.astype(jnp.bool_)
    return uniform_weights(opts, normalizer, width, lambda: _launch.weights_op(call)(mask),
                           lambda denom: _launch.native_weights(denom, False, mask))


def rollout_weights(call: TritonCall, mask: jax.Array, old: jax.Array, rollout: jax.Array,
                    seq: Optional[jax.Array], iw: Optional[jax.Array], opts: RolloutOptions,
                    bound: Optional[float]) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The rollout correction's ``w * iw`` (float32 ``[N]``, 0 on inactive rows) and its
    metrics, in one launch (``ratiokl.spec.rollout`` has the formulas).

    ``mask``, ``old``, ``rollout`` and ``iw`` (or None) are ``[N]``, without gradient;
    ``seq`` (sequence modes) the sequence log-weights, ``[R, 1]`` (one per row) or
    ``[R, T]`` (per token).
    """
    n = mask.shape[0]
    width = 1 if seq is None else n // max(seq.size, 1)
    op = _launch.rollout_op(call, opts, bound or 0.0, width, seq is not None, iw is not None)
    w, metrics = op(mask.astype(jnp.bool_), old, rollout,
                    old if seq is None else seq.reshape(-1), old if iw is None else iw)
    return w, {name: metrics[i] for i, name in enumerate(ROLLOUT_METRIC_NAMES)}


def policy_loss(
    call: TritonCall, policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array,
    mask: jax.Array,
    old: Optional[jax.Array], ref_logps: Optional[jax.Array], adv: jax.Array,
    iw: Optional[jax.Array], weights: jax.Array, temperature: Temperature,
    opts: PolicyLossOptions, inplace_grad: bool, *, adv_rows: int = 1,
    rollout: Optional[jax.Array] = None,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The fused ``(loss, metrics)`` of flattened rows: one kernel for the loss, the
    metrics' row values and the policy-logit gradient, one for the means.

    ``old``, ``iw`` (or None), ``ref_logps`` (or None) and the aggregation ``weights``
    are float32 ``[N]`` (``old`` None: on-policy, the kernel's ``ON_POLICY``); ``adv``
    float32 ``[N // adv_rows]`` (one advantage per ``adv_rows`` rows: per-sequence
    advantages reach the kernel as given); ``rollout`` (the engine's log-probs ``[N]``, or
    None) adds the parity fractions (``ROLLOUT_PARITY_NAMES``) to the metrics; ``policy``
    ``[N, V]`` is the only
    differentiable input. ``inplace_grad``: the gradient's buffer aliases
    ``policy``'s (``input_output_aliases``; without a copy where XLA may, e.g.
    ``policy`` donated to ``jit``). Returns the float32 0-d loss (``loss_agg="none"``: the
    rows' losses ``[N]``, 0 on inactive rows, each row's gradient scaled by its own
    cotangent) and the stop-gradient metrics.
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    stop = lax.stop_gradient
    adv, weights = stop(adv), stop(weights)
    static = fused_static(opts, ref is not None, ref_logps is not None, iw is not None,
                          old is not None)
    old_in = weights if old is None else stop(old)  # on-policy: a placeholder, never read
    coefs = kernel_coefficients(opts)
    # Without reference logits their slot is never read: any array but the logits, whose
    # buffer the in-place gradient takes over (an operand passed twice cannot be donated).
    ref_in = weights if ref is None else stop(ref)
    ref_lp = weights if ref_logps is None else stop(ref_logps)
    loss_rows, logp, ratio, kl, ent, bits = _fused(
        call, policy, ref_in, ids, mask_k, old_in, ref_lp, temp, adv,
        weights if iw is None else stop(iw), weights, coefs, static, inplace_grad, adv_rows,
    )
    rows = (mask_k, logp, ratio, kl, ent, bits, logp if old is None else old_in, loss_rows) + (
        () if rollout is None else (rollout,))
    means, total = _launch.metrics_op(call)(*(stop(x) for x in rows))  # no derivative: none asked
    # "none" (weights 1): the rows' losses themselves, whose [N] cotangent scales each row.
    loss = loss_rows if opts.loss_agg == "none" else _rows_total(loss_rows.shape[0], loss_rows,
                                                                 total)
    return loss, {name: means[i] for i, name in enumerate(
        METRIC_NAMES + (() if rollout is None else ROLLOUT_PARITY_NAMES))}
