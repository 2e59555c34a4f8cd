"""The policy loss from the last hidden states and the lm_head, in row chunks (JAX).

The math and the chunk loop are ``ratiokl.torch._linear``'s (its docstring): per chunk of
``C`` rows, the logits ``x`` of ``where(mask, hidden_c, 0)`` (``_lm_head.head_logits``: the
bias, scale and softcap applied, in the weight's dtype, the GEMM at ``Precision.HIGHEST``),
the fused policy-loss kernel in its in-place mode (``_launch.fused_op``: the gradient ``g``
aliases the chunk's logits; not with a softcap, whose slope needs them), then the chunk's
share of ``d hidden``, ``d weight`` and ``d bias`` (``_lm_head.head_grads``); one metrics
launch over all rows after the chunks. The full chunks run in a ``lax.fori_loop`` (one
chunk's logits live at a time, whatever XLA's scheduler would do with an unrolled loop),
the remainder once after it. A ``jax.custom_vjp`` keeps the gradients as its residuals;
the backward scales them by the upstream value (``_launch.scale_op``: rows whose value is
exactly 1 are skipped on the device).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._kernels.loss_rows import METRIC_NAMES, PARITY_METRICS
from ratiokl.jax import _launch
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._launch import Static, TritonCall
from ratiokl.jax._lm_head import (add_grad_weight, chunk_size, grad_weight_zeros, head_grads,
                                  head_logits, vary_alike)
from ratiokl.jax._triton_loss import fused_static, kernel_coefficients
from ratiokl.spec import ROLLOUT_PARITY_NAMES, LogitTransform, PolicyLossOptions

__all__ = ["policy_loss"]


def _chunks(call: TritonCall, static: Static, transform: LogitTransform, chunk: int,
            want_grad: bool, hidden, weight, bias, ids, mask, old, ref_lp, temp, adv, iw, w,
            coefs, rollout):
    """``(loss, means, (d hidden, d weight, d bias | None) | None)`` from the chunk loop
    (``rollout``: the engine's log-probs ``[N]``, which add the parity fractions, or None)."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    # zeros_like: typed as the inputs are inside shard_map (the loop's carries must be).
    rows = tuple(jnp.zeros_like(hidden, jnp.int32 if i == 5 else jnp.float32, shape=(n_rows,))
                 for i in range(6))
    grads = (jnp.zeros_like(hidden), grad_weight_zeros(weight, transform),
             jnp.zeros_like(weight, jnp.float32, shape=(vocab,))) if want_grad else None
    if n_rows == 0:
        n_metrics = len(METRIC_NAMES) + (0 if rollout is None else PARITY_METRICS)
        return (jnp.zeros((), jnp.float32), jnp.zeros((n_metrics,), jnp.float32),
                _in_dtypes(grads, weight, bias))
    # In place (g aliases the logits) unless the softcap's slope needs the logits after.
    fused = _launch.fused_op(call, static, want_grad,
                             want_grad and transform.softcap is None)
    per_row_temp = temp.shape[0] == n_rows and n_rows > 1

    def step(start, size: int, carry):
        rows, grads = carry
        part = lambda x: lax.dynamic_slice_in_dim(x, start, size)  # noqa: E731
        mask_c = part(mask)
        kept = jnp.where(mask_c[:, None], part(hidden), jnp.zeros((), hidden.dtype))
        logits = head_logits(kept, weight, bias, transform)
        # The reference-logits slot is never read (no reference logits): any other array,
        # not the logits, whose buffer the gradient takes over (an operand passed twice
        # cannot be donated, and XLA would copy it).
        outs = fused(logits, weight, part(ids), mask_c, part(old), part(ref_lp),
                     part(temp) if per_row_temp else temp, part(adv), part(iw), part(w), coefs)
        rows = tuple(lax.dynamic_update_slice_in_dim(r, x, start, 0)
                     for r, x in zip(rows, outs[:6]))
        if want_grad:
            dh, dw, db = head_grads(outs[6], logits, kept, weight, transform)
            grads = (lax.dynamic_update_slice_in_dim(grads[0], dh.astype(hidden.dtype), start,
                                                     0),
                     add_grad_weight(grads[1], dw), grads[2] + db)
        return rows, grads

    full, rest = divmod(n_rows, chunk)
    carry = (rows, grads)
    if full:
        carry = lax.fori_loop(0, full, lambda i, c: step(i * chunk, chunk, c), carry)
    if rest:
        carry = step(full * chunk, rest, carry)
    (loss_rows, logp, ratio, kl, ent, bits), grads = carry
    stop = lax.stop_gradient
    on_policy = static[7]  # old is a placeholder: the metrics' old log-probs are logp
    means, total = _launch.metrics_op(call)(
        *(stop(x) for x in (mask, logp, ratio, kl, ent, bits, logp if on_policy else old,
                            loss_rows) + (() if rollout is None else (rollout,))))
    return total, means, _in_dtypes(grads, weight, bias)


def _in_dtypes(grads, weight, bias):
    """``grads`` with ``d weight`` and ``d bias`` in their inputs' dtypes (``d bias`` None
    without a bias)."""
    if grads is None:
        return None
    return (grads[0], grads[1].astype(weight.dtype),
            None if bias is None else grads[2].astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 13, 14, 15))
def _linear(call, hidden, weight, bias, ids, mask, old, ref_lp, temp, adv, iw, w, coefs,
            static: Static, transform: LogitTransform, chunk: int, rollout):
    loss, means, _ = _chunks(call, static, transform, chunk, False, hidden, weight, bias, ids,
                             mask, old, ref_lp, temp, adv, iw, w, coefs, rollout)
    return loss, means


def _linear_fwd(call, hidden, weight, bias, ids, mask, old, ref_lp, temp, adv, iw, w, coefs,
                static, transform, chunk, rollout):
    loss, means, grads = _chunks(call, static, transform, chunk, True, hidden, weight, bias,
                                 ids, mask, old, ref_lp, temp, adv, iw, w, coefs, rollout)
    return (loss, means), (grads, mask)


def _linear_bwd(call, static, transform, chunk, residuals, cotangents):
    del static, transform, chunk
    (grad_hidden, grad_weight, grad_bias), mask = residuals
    g = cotangents[0].astype(jnp.float32)
    scale = _launch.scale_op(call)

    def every_row(grad):
        rows = jnp.ones((grad.shape[0],), jnp.bool_)
        return scale(grad, jnp.broadcast_to(g, rows.shape), rows)

    bias_grad = None if grad_bias is None else every_row(grad_bias[None])[0]
    return (scale(grad_hidden, jnp.broadcast_to(g, mask.shape), mask), every_row(grad_weight),
            bias_grad) + (None,) * 10


_linear.defvjp(_linear_fwd, _linear_bwd)


def policy_loss(call: TritonCall, hidden: jax.Array, weight: jax.Array,
                bias: Optional[jax.Array], transform: LogitTransform, ids: jax.Array,
                mask: jax.Array, old: Optional[jax.Array], ref_logps: Optional[jax.Array],
                adv: jax.Array, iw: Optional[jax.Array], weights: jax.Array,
                temperature: Temperature, opts: PolicyLossOptions,
                chunk_rows: int, rollout: Optional[jax.Array] = None,
                ) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``(loss, metrics)`` of ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` (or None;
    one dtype) through ``transform``, ``chunk_rows`` rows at a time; the other inputs as the
    backends' fused ``policy_loss`` takes them, all ``[N]`` (``old`` None: on-policy;
    ``rollout``, the engine's log-probs, or None: see :func:`_chunks`).
    Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``."""
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    hidden, weight, bias = vary_alike(hidden, weight, bias, ids, mask_k, temp, adv, weights)
    stop = lax.stop_gradient
    adv, weights = stop(adv), stop(weights)
    static = fused_static(opts, False, ref_logps is not None, iw is not None, old is not None)
    old = weights if old is None else stop(old)  # on-policy: a placeholder, never read
    ref_lp = weights if ref_logps is None else stop(ref_logps)  # a placeholder when absent
    loss, means = _linear(
        call, hidden, weight, bias, ids, mask_k, old, ref_lp, temp, adv,
        weights if iw is None else stop(iw), weights, kernel_coefficients(opts), static,
        transform, chunk_size(chunk_rows, hidden, weight, transform),
        None if rollout is None else stop(rollout),
    )
    names = METRIC_NAMES + (() if rollout is None else ROLLOUT_PARITY_NAMES)
    return loss, {name: means[i] for i, name in enumerate(names)}
