"""The native JAX backend: ``jnp`` ops compiled by XLA, with an analytic backward.

The selected log-prob is one ``jax.custom_vjp``. Its forward is
:mod:`ratiokl._core.rows`'s row math (the statistics ``m``, ``s``, ``z_a`` and
their combine ``lse = shift(m) + log s``, ``logp = z_a - lse``, the entropy).
The backward saves only the per-row ``lse`` (O(N)) beside the input logits and
recomputes ``softmax(z) = exp(z - lse)``::

    dlogits[v] = g * (onehot(a)[v] - softmax(z)[v]) / T

Inactive rows are isolated by construction: their logits and temperature
are replaced with ``jnp.where`` (never a multiplication) before any
arithmetic, their ids are clamped before the gather, and their gradient is
selected to exactly 0. An active row whose id is outside ``[0, V)`` reads
the clamped id and is poisoned, checked or not: its ``lse`` is NaN, so its
outputs and its gradient are NaN. All math is float32, except for float64
logits (under ``jax_enable_x64``), which are computed in float64; the
gradient is cast to the logits' dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ratiokl._core import rows as _rows
from ratiokl.jax._arrays import XP
from ratiokl.jax._checks import Temperature

__all__ = [
    "compute_dtype", "entropy_grad", "finite_or_zero", "logprobs_entropy", "ratio_kl",
    "row_temperature", "rows_backward", "rows_forward", "scaled_logits", "selected_logprobs",
]


def compute_dtype(logits: jax.Array):
    """The dtype the rows are computed in: float64 for float64 logits, else float32."""
    return XP.for_dtype(logits.dtype).float_dtype


def row_temperature(temperature: Temperature, rows: int, dtype=jnp.float32) -> jax.Array:
    """Temperature as ``[N]`` of ``dtype`` (the compute dtype; a Python float is
    broadcast)."""
    if isinstance(temperature, float):
        return jnp.full((rows,), temperature, dtype=dtype)
    return temperature.astype(dtype)


def scaled_logits(
    logits: jax.Array, mask: jax.Array, temperature: jax.Array
) -> Tuple[jax.Array, jax.Array]:
    """``(z = logits / T, T)`` in the compute dtype (:func:`compute_dtype`); inactive rows
    hold ``z = 0``, ``T = 1``."""
    t = jnp.where(mask, temperature, 1.0)
    x = jnp.where(mask[:, None], logits.astype(compute_dtype(logits)), 0.0)
    return x / t[:, None], t


def finite_or_zero(m: jax.Array) -> jax.Array:
    """:func:`ratiokl._core.rows.finite_shift` (the Triton shard path's shift too)."""
    return _rows.finite_shift(XP, m)


def _forward(logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: jax.Array,
             entropy: bool = False) -> Tuple[jax.Array, jax.Array, Optional[jax.Array]]:
    """``(logp, lse, entropy | None)`` ``[N]`` in the compute dtype; ``logp`` (and the
    entropy) 0 on inactive rows, NaN on poisoned rows."""
    safe, bad = _rows.safe_ids(XP, ids, mask, logits.shape[-1])
    z, _ = scaled_logits(logits, mask, temperature)
    return _rows.finish(XP, mask, bad, *_rows.row_values(XP, z, safe, entropy))


@jax.custom_vjp
def _logp(logits: jax.Array, ids: jax.Array, mask: jax.Array,
          temperature: jax.Array) -> jax.Array:
    return _forward(logits, ids, mask, temperature)[0]


def _logp_fwd(logits, ids, mask, temperature):
    logp, lse, _ = _forward(logits, ids, mask, temperature)
    return logp, (logits, ids, mask, temperature, lse)


def _logp_bwd(residuals, g):
    # A poisoned row's NaN lse makes its gradient NaN.
    logits, ids, mask, temperature, lse = residuals
    safe, _ = _rows.safe_ids(XP, ids, mask, logits.shape[-1])
    z, t = scaled_logits(logits, mask, temperature)
    softmax = jnp.exp(z - lse[:, None])
    onehot = safe[:, None] == jnp.arange(logits.shape[-1])[None, :]
    coef = jnp.where(mask, g, 0.0) / t
    grad = jnp.where(mask[:, None], coef[:, None] * (onehot - softmax), 0.0)
    # Nothing flows to the temperature: the contract differentiates the policy logits only.
    return grad.astype(logits.dtype), None, None, jnp.zeros_like(temperature)


_logp.defvjp(_logp_fwd, _logp_bwd)


def selected_logprobs(
    logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: Temperature
) -> jax.Array:
    """``logp`` ``[N]`` (float32; float64 for float64 logits) from logits ``[N, V]``, ids
    ``[N]``, bool mask ``[N]``.

    Differentiable with respect to ``logits`` (gradient in its dtype).
    Inactive rows: ``logp = 0`` and exactly zero gradient.
    """
    t = row_temperature(temperature, logits.shape[0], compute_dtype(logits))
    return _logp(logits, ids, mask, t)


def _entropy_forward(logits, ids, mask, temperature):
    logp, lse, ent = _forward(logits, ids, mask, temperature, entropy=True)
    return (logp, ent), (logits, ids, mask, temperature, lse, ent)


@jax.custom_vjp
def _logp_entropy(logits, ids, mask, temperature):
    return _entropy_forward(logits, ids, mask, temperature)[0]


def _logp_entropy_fwd(*primals):
    # symbolic_zeros: each argument comes as a CustomVJPPrimal (its value, whether perturbed).
    return _entropy_forward(*(p.value for p in primals))


def _logp_entropy_bwd(residuals, cotangents):
    logits, ids, mask, temperature, lse, ent = residuals
    g_logp, g_ent = cotangents
    if isinstance(g_logp, SymbolicZero):
        g_logp = jnp.zeros_like(lse)
    if isinstance(g_ent, SymbolicZero):  # the entropy only logged (policy_loss's entropy_mean)
        return _logp_bwd((logits, ids, mask, temperature, lse), g_logp)
    grad = _entropy_grad(logits, ids, mask, temperature, lse, ent, g_logp, g_ent)
    return grad, None, None, jnp.zeros_like(temperature)


def _entropy_grad(logits, ids, mask, temperature, lse, ent, g_logp, g_ent) -> jax.Array:
    """``(g_logp (onehot - p) - g_ent p (log p + H)) / T`` in the logits' dtype; 0 on
    inactive rows."""
    safe, _ = _rows.safe_ids(XP, ids, mask, logits.shape[-1])
    onehot = safe[:, None] == jnp.arange(logits.shape[-1])[None, :]
    return entropy_grad(logits, onehot, mask, temperature, lse, ent, g_logp, g_ent)


def entropy_grad(logits, onehot, mask, temperature, lse, ent, g_logp, g_ent) -> jax.Array:
    """:func:`_entropy_grad` with each row's one-hot ``[N, V]`` given (bool; a vocabulary
    block's, all false on the rows whose action lies in another block); ``g_ent`` None:
    no entropy term."""
    z, t = scaled_logits(logits, mask, temperature)
    p, p_log_p = _rows.entropy_terms(XP, z, lse)
    c_logp = jnp.where(mask, g_logp, 0.0) / t
    grad = c_logp[:, None] * (onehot - p)
    if g_ent is not None:
        c_ent = jnp.where(mask, g_ent, 0.0) / t
        grad = grad - c_ent[:, None] * (p_log_p + p * ent[:, None])
    return jnp.where(mask[:, None], grad, 0.0).astype(logits.dtype)


# Symbolic zeros: a cotangent nothing produced (the entropy of policy_loss with
# entropy_coef=0, only averaged under stop_gradient) drops its backward term.
_logp_entropy.defvjp(_logp_entropy_fwd, _logp_entropy_bwd, symbolic_zeros=True)


def logprobs_entropy(
    logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: Temperature
) -> Tuple[jax.Array, jax.Array]:
    """``(logp, entropy)`` ``[N]`` each (float32; float64 for float64 logits);
    differentiable w.r.t. ``logits`` through both.

    Inactive rows: 0 and exactly zero gradient; ``-inf`` logits contribute 0 to both.
    """
    t = row_temperature(temperature, logits.shape[0], compute_dtype(logits))
    return _logp_entropy(logits, ids, mask, t)


def rows_forward(logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: jax.Array,
                 entropy: bool) -> Tuple[jax.Array, Optional[jax.Array], jax.Array]:
    """``(logp, entropy | None, lse)`` float32 ``[N]`` of ``logits [N, V]`` (``temperature``
    float32 ``[N]``), with no derivative rule: the linear op's chunks, whose gradient is
    :func:`rows_backward`."""
    logp, lse, ent = _forward(logits, ids, mask, temperature, entropy)
    return logp, ent, lse


def rows_backward(logits: jax.Array, ids: jax.Array, mask: jax.Array, temperature: jax.Array,
                  lse: jax.Array, ent: Optional[jax.Array], g_logp: Optional[jax.Array],
                  g_ent: Optional[jax.Array]) -> jax.Array:
    """``d / d logits`` of ``sum(g_logp * logp + g_ent * entropy)`` (None: a zero term) in
    the logits' dtype, from :func:`rows_forward`'s ``lse`` and entropy."""
    g_logp = jnp.zeros_like(lse) if g_logp is None else g_logp
    if g_ent is None:
        return _logp_bwd((logits, ids, mask, temperature, lse), g_logp)[0]
    return _entropy_grad(logits, ids, mask, temperature, lse, ent, g_logp, g_ent)


def ratio_kl(
    policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array, mask: jax.Array,
    old_logps: jax.Array, ref_logps: Optional[jax.Array], kl_code: int,
    temperature: Temperature,
) -> Tuple[jax.Array, jax.Array]:
    """``(ratio, kl)`` ``[N]`` (float32; float64 for float64 ``policy``); differentiable
    with respect to ``policy`` only.

    The reference log-prob comes from ``ref`` logits ``[N, V]`` or is given
    as ``ref_logps`` ``[N]`` (exactly one is not None).
    """
    t = row_temperature(temperature, policy.shape[0], compute_dtype(policy))
    logp = _logp(policy, ids, mask, t)
    return _rows.ratio_kl(
        XP.for_dtype(policy.dtype), logp,
        lambda: _forward(lax.stop_gradient(ref), ids, mask, lax.stop_gradient(t))[0],
        ref_logps, old_logps, mask, kl_code)
