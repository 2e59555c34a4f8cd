"""JAX advantage estimators: ``from ratiokl.jax import advantages``.

Signatures only: each function is one call into ``ratiokl._core.advantage_route``
(written once for both frameworks) with this binding's array adapter; GAE's scan is this
binding's own (:func:`_scan`: ``lax.associative_scan`` over ``T`` on every backend).
The docstrings are ``ratiokl._docs.advantages``'s, rendered for JAX. Every option is
static (a Python value); the arrays may be traced (``jax.jit``, ``vmap``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._core import advantage_route as _route
from ratiokl._core import advantages as _math
from ratiokl._docs.advantages import documented
from ratiokl.jax._arrays import XP
from ratiokl.jax._route import backend_name
from ratiokl.spec import BackendName
from ratiokl.spec.advantages import GroupScale, GroupStd, Singleton, Whitening
from ratiokl.spec.token_baselines import Align

__all__ = ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
           "reinforce_pp", "reinforce_pp_baseline", "rloo", "spread"]

Array = jax.Array
_documented = documented("jax")


@_documented
def grpo(scores: Array, group_ids: Optional[Array] = None, *,
         group_size: Optional[int] = None, valid: Optional[Array] = None,
         std: GroupStd = "unbiased", scale: GroupScale = "group", eps: float = 1e-6,
         singleton: Singleton = "score") -> Array:
    return _route.grpo(XP, scores, group_ids, group_size=group_size, valid=valid, std=std,
                       scale=scale, eps=eps, singleton=singleton)


@_documented
def rloo(scores: Array, group_ids: Optional[Array] = None, *,
         group_size: Optional[int] = None, valid: Optional[Array] = None,
         singleton: Singleton = "score") -> Array:
    return _route.rloo(XP, scores, group_ids, group_size=group_size, valid=valid,
                       singleton=singleton)


@_documented
def reinforce_pp_baseline(scores: Array, group_ids: Optional[Array] = None, *,
                          group_size: Optional[int] = None, valid: Optional[Array] = None,
                          lengths: Optional[Array] = None, whiten: Whitening = "unbiased",
                          singleton: Singleton = "score") -> Array:
    return _route.reinforce_pp_baseline(XP, scores, group_ids, group_size=group_size,
                                        valid=valid, lengths=lengths, whiten=whiten,
                                        singleton=singleton)


@_documented
def opo(scores: Array, group_ids: Optional[Array] = None, *,
        group_size: Optional[int] = None, valid: Optional[Array] = None,
        lengths: Optional[Array] = None) -> Array:
    return _route.opo(XP, scores, group_ids, group_size=group_size, valid=valid,
                      lengths=lengths)


@_documented
def grpo_passk(scores: Array, group_ids: Optional[Array] = None, *,
               group_size: Optional[int] = None, valid: Optional[Array] = None,
               std: GroupStd = "unbiased", scale: GroupScale = "group",
               eps: float = 1e-6) -> Array:
    return _route.grpo_passk(XP, scores, group_ids, group_size=group_size, valid=valid,
                             std=std, scale=scale, eps=eps)


@_documented
def gpg(scores: Array, group_ids: Optional[Array] = None, *,
        group_size: Optional[int] = None, valid: Optional[Array] = None,
        f_norm: float = 1.0) -> Array:
    return _route.gpg(XP, scores, group_ids, group_size=group_size, valid=valid,
                      f_norm=f_norm)


@_documented
def gdpo(scores: Array, group_ids: Optional[Array] = None, *,
         group_size: Optional[int] = None, valid: Optional[Array] = None,
         weights: Optional[Sequence[float]] = None, std: GroupStd = "unbiased",
         eps: float = 1e-6, singleton: Singleton = "score", lengths: Optional[Array] = None,
         whiten: Whitening = "unbiased") -> Array:
    return _route.gdpo(XP, scores, group_ids, group_size=group_size, valid=valid,
                       weights=weights, std=std, eps=eps, singleton=singleton,
                       lengths=lengths, whiten=whiten)


def _combine(later, current):
    """``lax.associative_scan``'s combine in reverse: ``later`` holds the composed maps of
    the later positions (applied first), ``current`` the map applied after them."""
    return _math.scan_combine(current, later)


def _scan(backend: str):
    """The raw ``(advantages, returns)`` of GAE's recursion: one ``lax.associative_scan``
    over ``T`` (``backend`` is checked as everywhere; XLA's scan serves every backend)."""
    backend_name(backend)

    def scan(rewards, values, mask, gamma: float, lam: float):
        elements = _math.gae_elements(XP, rewards, values, mask, gamma, lam)
        composed = lax.associative_scan(_combine, elements, reverse=True, axis=1)
        adv = jnp.where(mask, composed[3], 0.0)
        kept = jnp.where(mask, jnp.asarray(values, jnp.float32), 0.0)
        return adv, jnp.where(mask, adv + kept, 0.0)
    return scan


@_documented
def gae(rewards: Array, values: Array, mask: Array, gamma: float, lam: float, *,
        whiten: Whitening = "unbiased", backend: BackendName = "auto") -> Tuple[Array, Array]:
    return _route.gae(XP, _scan(backend), rewards, values, mask, gamma, lam, whiten=whiten)


@_documented
def reinforce_pp(rewards: Array, mask: Array, gamma: float, *,
                 whiten: Whitening = "unbiased",
                 backend: BackendName = "auto") -> Tuple[Array, Array]:
    return _route.reinforce_pp(XP, _scan(backend), rewards, mask, gamma, whiten=whiten)


@_documented
def optimal_token_baseline(rewards: Array, mask: Array, old_logps: Array,
                           sum_pi_squared: Array, group_ids: Optional[Array] = None, *,
                           group_size: Optional[int] = None, valid: Optional[Array] = None,
                           is_weights: Optional[Array] = None, align: Align = "position",
                           zero_tail: bool = True, eps: float = 1e-8,
                           backend: BackendName = "auto") -> Tuple[Array, Array]:
    return _route.optimal_token_baseline(
        XP, _scan(backend), rewards, mask, old_logps, sum_pi_squared, group_ids,
        group_size=group_size, valid=valid, is_weights=is_weights, align=align,
        zero_tail=zero_tail, eps=eps)


@_documented
def spread(advantages: Array, mask: Array) -> Array:
    return _route.spread(XP, advantages, mask)
