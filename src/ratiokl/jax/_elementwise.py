"""Per-token ratio and KL from per-token log-probs: ``[N]``-sized ``jnp`` ops.

Shared by every JAX backend that produces ``logp`` first and leaves the
per-token epilogue to JAX's autodiff (the math is in
``ratiokl.jax.loss.ratio_kl``). Inactive rows' inputs are replaced with
neutral values *before* any arithmetic, so a NaN ``old_logp`` or
``logp_ref`` on an inactive row never sits in an untaken ``jnp.where``
branch whose gradient would be ``0 * NaN``.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp

__all__ = ["ratio_kl"]


def _kl(d: jax.Array, kl_code: int) -> jax.Array:
    """Schulman's estimator on ``d = logp_ref - logp`` (codes from ``ratiokl.spec``)."""
    if kl_code == 1:
        return -d
    if kl_code == 2:
        return 0.5 * d * d
    return jnp.expm1(d) - d


def ratio_kl(
    logp: jax.Array,
    logp_ref: jax.Array,
    old_logps: jax.Array,
    mask: jax.Array,
    kl_code: int,
) -> Tuple[jax.Array, jax.Array]:
    """``(ratio, kl)`` float32 ``[N]`` from ``[N]`` log-probs and a bool ``[N]`` mask.

    Differentiable through ``logp`` only (the caller passes the others under
    ``lax.stop_gradient``). Inactive rows: ``ratio = 1``, ``kl = 0``, zero
    gradient. ``kl_code`` is a static Python int (1, 2, 3 for k1, k2, k3).
    """
    logp = jnp.where(mask, logp.astype(jnp.float32), 0.0)
    logp_ref = jnp.where(mask, logp_ref.astype(jnp.float32), 0.0)
    old = jnp.where(mask, old_logps.astype(jnp.float32), 0.0)
    ratio = jnp.exp(logp - old)
    kl = _kl(logp_ref - logp, kl_code)
    return jnp.where(mask, ratio, 1.0), jnp.where(mask, kl, 0.0)
