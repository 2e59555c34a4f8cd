"""The policy loss from the last hidden states and the lm_head weight, in row chunks (JAX).

The math and the chunk loop are ``ratiokl.torch._linear``'s (its docstring): per chunk of
``C`` rows, ``logits = hidden_c @ weight.T`` in the weight's dtype, the fused policy-loss
kernel in its in-place mode (``_launch.fused_op``: the gradient ``g`` aliases the chunk's
logits), ``g @ weight`` into the chunk's rows of ``d hidden`` and ``g.T @ where(mask,
hidden_c, 0)`` added to ``d weight``; one metrics launch over all rows after the chunks.
The full chunks run in a ``lax.fori_loop`` (one chunk's logits live at a time, whatever
XLA's scheduler would do with an unrolled loop), the remainder once after it. A
``jax.custom_vjp`` keeps both gradients as its residuals; the backward scales them by the
upstream value (``_launch.scale_op``: rows whose value is exactly 1 are skipped on the
device).
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.jax import _launch
from ratiokl.jax._checks import Temperature
from ratiokl.jax._launch import Static, TritonCall
from ratiokl.jax._triton import fused_static, kernel_coefficients, kernel_rows
from ratiokl.spec import PolicyLossOptions

__all__ = ["policy_loss"]


def _chunks(call: TritonCall, static: Static, chunk: int, want_grad: bool, hidden, weight,
            ids, mask, old, ref_lp, temp, adv, iw, w, coefs):
    """``(loss, means, d hidden | None, d weight | None)`` from the chunk loop."""
    n_rows, width = hidden.shape
    vocab = weight.shape[0]
    rows = tuple(jnp.zeros((n_rows,), jnp.int32 if i == 5 else jnp.float32) for i in range(6))
    grad_hidden = jnp.zeros((n_rows, width), hidden.dtype) if want_grad else None
    grad_weight = jnp.zeros((vocab, width), weight.dtype) if want_grad else None
    if n_rows == 0:
        return (jnp.zeros((), jnp.float32), jnp.zeros((len(METRIC_NAMES),), jnp.float32),
                grad_hidden, grad_weight)
    fused = _launch.fused_op(call, static, want_grad, want_grad)  # in place: g is the logits
    per_row_temp = temp.shape[0] == n_rows and n_rows > 1

    def step(start, size: int, carry):
        rows, grad_hidden, grad_weight = carry
        part = lambda x: lax.dynamic_slice_in_dim(x, start, size)  # noqa: E731
        h = part(hidden)
        mask_c = part(mask)
        logits = jnp.matmul(h, weight.T).astype(weight.dtype)
        # The reference-logits slot is never read (no reference logits): any other array,
        # not the logits, whose buffer the gradient takes over (an operand passed twice
        # cannot be donated, and XLA would copy it).
        outs = fused(logits, weight, part(ids), mask_c, part(old), part(ref_lp),
                     part(temp) if per_row_temp else temp, part(adv), part(iw), part(w), coefs)
        rows = tuple(lax.dynamic_update_slice_in_dim(r, x, start, 0)
                     for r, x in zip(rows, outs[:6]))
        if want_grad:
            g = outs[6]
            grad_hidden = lax.dynamic_update_slice_in_dim(
                grad_hidden, jnp.matmul(g, weight).astype(hidden.dtype), start, 0)
            kept = jnp.where(mask_c[:, None], h, jnp.zeros((), h.dtype))
            grad_weight = grad_weight + jnp.matmul(g.T, kept).astype(weight.dtype)
        return rows, grad_hidden, grad_weight

    carry = (rows, grad_hidden, grad_weight)
    full, rest = divmod(n_rows, chunk)
    if full:
        carry = lax.fori_loop(0, full, lambda i, c: step(i * chunk, chunk, c), carry)
    if rest:
        carry = step(full * chunk, rest, carry)
    (loss_rows, logp, ratio, kl, ent, bits), grad_hidden, grad_weight = carry
    stop = lax.stop_gradient
    on_policy = static[7]  # old is a placeholder: the metrics' old log-probs are logp
    means, total = _launch.metrics_op(call)(
        *(stop(x) for x in (mask, logp, ratio, kl, ent, bits, logp if on_policy else old,
                            loss_rows)))
    return total, means, grad_hidden, grad_weight


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 12, 13))
def _linear(call, hidden, weight, ids, mask, old, ref_lp, temp, adv, iw, w, coefs,
            static: Static, chunk: int):
    loss, means, _, _ = _chunks(call, static, chunk, False, hidden, weight, ids, mask, old,
                                ref_lp, temp, adv, iw, w, coefs)
    return loss, means


def _linear_fwd(call, hidden, weight, ids, mask, old, ref_lp, temp, adv, iw, w, coefs, static,
                chunk):
    loss, means, grad_hidden, grad_weight = _chunks(call, static, chunk, True, hidden, weight,
                                                    ids, mask, old, ref_lp, temp, adv, iw, w,
                                                    coefs)
    return (loss, means), (grad_hidden, grad_weight, mask)


def _linear_bwd(call, static, chunk, residuals, cotangents):
    del static, chunk
    grad_hidden, grad_weight, mask = residuals
    g = cotangents[0].astype(jnp.float32)
    scale = _launch.scale_op(call)
    every_row = jnp.ones((grad_weight.shape[0],), jnp.bool_)
    return (scale(grad_hidden, jnp.broadcast_to(g, mask.shape), mask),
            scale(grad_weight, jnp.broadcast_to(g, every_row.shape), every_row)) + (None,) * 9


_linear.defvjp(_linear_fwd, _linear_bwd)


def policy_loss(call: TritonCall, hidden: jax.Array, weight: jax.Array, ids: jax.Array,
                mask: jax.Array, old: Optional[jax.Array], ref_logps: Optional[jax.Array],
                adv: jax.Array, iw: Optional[jax.Array], weights: jax.Array,
                temperature: Temperature, opts: PolicyLossOptions,
                chunk_rows: int) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``(loss, metrics)`` of ``hidden [N, H]`` and ``weight [V, H]`` (same dtype),
    ``chunk_rows`` rows at a time; the other inputs as the backends' fused ``policy_loss``
    takes them, all ``[N]`` (``old`` None: on-policy). Differentiable w.r.t. ``hidden``
    and ``weight``."""
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    stop = lax.stop_gradient
    adv, weights = stop(adv), stop(weights)
    static = fused_static(opts, False, ref_logps is not None, iw is not None, old is not None)
    old = weights if old is None else stop(old)  # on-policy: a placeholder, never read
    ref_lp = weights if ref_logps is None else stop(ref_logps)  # a placeholder when absent
    loss, means = _linear(
        call, hidden, weight, ids, mask_k, old, ref_lp, temp, adv,
        weights if iw is None else stop(iw), weights, kernel_coefficients(opts), static,
        min(chunk_rows, max(hidden.shape[0], 1)),
    )
    return loss, {name: means[i] for i, name in enumerate(METRIC_NAMES)}
