"""Vocabulary-parallel JAX backend: inside ``shard_map``, the vocabulary mapped to a mesh axis.

Each device of mesh axis ``axis`` holds a contiguous, equal block of the
vocabulary (``shard_map`` splits a dimension evenly): device ``k`` of the axis
holds columns ``[k * V_local, (k + 1) * V_local)`` and the global vocabulary
is ``V = V_local * axis_size``. Action ids, mask, temperature and the other
per-token inputs are global (replicated along ``axis``).

Per row: ``M = pmax(max z)`` (under ``stop_gradient``; any shift gives the
same log-sum-exp), then one ``lax.psum`` of the stacked per-block sums
(policy and reference fused)::

    S   = psum(s),   s   = sum over the block of exp(z - shift(M))
    z_a = psum(z_a on the owning device, 0 elsewhere)
    logp = z_a - shift(M) - log(S)

so ``logp`` is the same on every device of the axis. The entropy
(``logprobs_entropy``: ``policy_loss``'s ``entropy_mean`` and ``entropy_coef``) adds
one ``[N]`` sum to the same psum, ``h = sum exp(z - shift) (z - shift)``, and
``H = log(S) - h / S`` (``= lse - E_p[z]``). The per-block sums are
one ``jax.custom_vjp`` (``_shard_sums``) whose backward is local: it saves
nothing but its inputs and writes the block's
``g_s * exp(z - shift) + g_h * exp(z - shift) (1 + z - shift) + g_z * onehot``
(one-hot on the owning device only), which with the psum's cotangents is the block
of ``g * (onehot(a) - softmax(z)) / T`` (and of ``-g_H p (log p + H) / T``). The psum
stays outside the custom rule so JAX transposes it itself: with ``check_vma=True`` (the default) into a
no-op ``pvary``, so the backward has no collective; with ``check_vma=False``
into a psum of the ``[N]`` cotangents, which cancels the ``1/axis_size``
JAX gives each device's cotangent of a replicated output. A gradient taken
outside the ``shard_map`` is exact in both modes (a custom rule that hid the
psum would be scaled by ``1/axis_size`` under ``check_vma=False``); one taken
inside the body is exact with ``check_vma=True`` and, as for any psum,
``axis_size`` times too large with ``check_vma=False``.

That is the native math (``backend="native"``, and ``"auto"`` without a
GPU). ``backend="triton"`` (and ``"auto"`` where jax-triton runs) and
``"interpret"`` compute the same statistics with the Triton kernels and the same one
pmax and one psum (their backend's ``shard_logps``: ``ratiokl.jax._triton_shard.shard_logps``);
they need ``check_vma=True``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._backend import Backend
from ratiokl._core import rows as _rows
from ratiokl.jax import _native
from ratiokl.jax._arrays import XP
from ratiokl.jax._checks import Temperature
from ratiokl.jax._varying import varies_over
from ratiokl.spec import vocab_blocks

__all__ = ["VocabParallel", "backend", "block_logps", "global_vocab"]


def _axis_size(axis: str) -> int:
    try:
        return lax.axis_size(axis)
    except NameError:
        raise ValueError(
            f"vocab_axis={axis!r} is not a mesh axis bound here: call the function inside "
            "`jax.shard_map` with the logits' vocabulary dimension mapped to that axis "
            "(in_specs=P(..., axis)), or drop `vocab_axis` to use the unsharded path"
        ) from None


def global_vocab(local_vocab: int, axis: Optional[str], argument: str = "logits") -> int:
    """The global vocabulary size ``V_local * axis_size`` (``local_vocab`` without an axis;
    ``ValueError`` naming ``argument``, the sharded array, for an empty block)."""
    if axis is None:
        return local_vocab
    return vocab_blocks([local_vocab] * _axis_size(axis), argument)[1]


def backend(per_block: Backend, axis: str, explicit: bool,
            linear_selected_logprobs: Callable) -> Backend:
    """The vocabulary-parallel backend over mesh axis ``axis`` (a static string).

    ``per_block``: the resolved backend; its ``shard_logps`` and ``shard_rows`` (the
    kernels), or the native math where it has none, compute each block's statistics.
    ``explicit``: it was asked for by name (not ``"auto"``).
    ``linear_selected_logprobs``: the op from hidden states, called with ``axis`` and
    ``per_block.shard_rows`` first (``ratiokl.jax._vocab_linear.selected_logprobs``, which
    builds on this module).
    """
    _axis_size(axis)
    parallel = VocabParallel(axis, per_block.shard_logps, explicit)
    linear = functools.partial(linear_selected_logprobs, axis, per_block.shard_rows)
    return Backend(parallel.selected_logprobs, parallel.ratio_kl, parallel.logprobs_entropy,
                   linear_selected_logprobs=linear)


def _ownership(ids: jax.Array, mask: jax.Array, local_vocab: int, axis: str):
    """``(local ids clamped into this block, owned [N], bad [N])`` for global ``ids``."""
    return _rows.ownership(XP, ids, mask, lax.axis_index(axis) * local_vocab, local_vocab,
                           local_vocab * _axis_size(axis))


def _shard_sums_fwd(logits, local_ids, owned, mask, temperature, shift, entropy):
    z, _ = _native.scaled_logits(logits, mask, temperature)
    e = jnp.exp(z - shift[:, None])
    s = jnp.sum(e, axis=-1)
    z_a = jnp.where(owned, jnp.take_along_axis(z, local_ids[:, None], axis=-1)[:, 0], 0.0)
    sums = (s, z_a)
    if entropy:  # a -inf logit (e = 0) adds exactly 0; a NaN (e NaN) stays NaN
        sums += (jnp.sum(jnp.where(e == 0.0, 0.0, e * (z - shift[:, None])), axis=-1),)
    return sums, (logits, local_ids, owned, mask, temperature, shift)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _shard_sums(logits, local_ids, owned, mask, temperature, shift, entropy: bool):
    """This block's ``s = sum exp(z - shift)``, owned ``z_a`` (0 elsewhere) and, with
    ``entropy``, ``h = sum exp(z - shift) (z - shift)``: float32 ``[N]`` each."""
    return _shard_sums_fwd(logits, local_ids, owned, mask, temperature, shift, entropy)[0]


def _shard_sums_bwd(entropy, residuals, cotangents):
    logits, local_ids, owned, mask, temperature, shift = residuals
    g_s, g_z = cotangents[:2]
    z, t = _native.scaled_logits(logits, mask, temperature)
    e = jnp.exp(z - shift[:, None])
    onehot = owned[:, None] & (local_ids[:, None] == jnp.arange(logits.shape[-1])[None, :])
    grad = g_s[:, None] * e + jnp.where(onehot, g_z[:, None], 0.0)
    if entropy:  # d/dz of e (z - shift) = e (1 + z - shift); 0 where e = 0 (a -inf logit)
        grad = grad + jnp.where(e == 0.0, 0.0,
                                cotangents[2][:, None] * e * (1.0 + z - shift[:, None]))
    grad = jnp.where(mask[:, None], grad / t[:, None], 0.0)
    # Nothing flows to the temperature or the (stop-gradient) shift.
    return grad.astype(logits.dtype), None, None, None, jnp.zeros_like(temperature), None


_shard_sums.defvjp(_shard_sums_fwd, _shard_sums_bwd)


def block_logps(shards, ids, mask, temperature, axis, entropy=False):
    """``logp`` float32 ``[N]`` per block in ``shards``, with ``entropy`` the policy's entropy
    (else None), and each block's global ``lse`` (``[k, N]``, NaN on a bad id's row); one
    pmax and one psum in all. ``temperature``: float32 ``[N]``."""
    local_ids, owned, bad = _ownership(ids, mask, shards[0].shape[-1], axis)
    z = [_native.scaled_logits(lax.stop_gradient(x), mask, temperature)[0] for x in shards]
    m = jnp.stack([jnp.max(zk, axis=-1) for zk in z])
    shift = lax.stop_gradient(_rows.finite_shift(XP, lax.pmax(m, axis)))
    sums = [_shard_sums(x, local_ids, owned, mask, temperature, shift[k], entropy and k == 0)
            for k, x in enumerate(shards)]
    terms = (jnp.stack([t[0] for t in sums]), jnp.stack([t[1] for t in sums]))
    s, z_a, *h = lax.psum(terms + sums[0][2:], axis)
    # An out-of-range active id poisons its row, value and gradient (NaN is added, not selected).
    s = s + jnp.where(bad, jnp.nan, 0.0)
    logps = [jnp.where(mask, z_a[k] - shift[k] - jnp.log(s[k]), 0.0) for k in range(len(shards))]
    ent = jnp.where(mask, _rows.shard_entropy(XP, s[0], h[0]), 0.0) if entropy else None
    return logps, ent, _rows.shard_lse(XP, shift, s)


class VocabParallel:
    """The backend interface of ``ratiokl.jax._route`` over a vocabulary-sharded mesh axis.

    Rows whose active id is outside the global ``[0, V)`` are always poisoned
    with NaN. ``shard_logps``: a Triton backend's per-block statistics
    (``ratiokl.jax._triton_shard.shard_logps`` bound to its launch), or None for the native
    math; ``explicit``: it was asked for by name. A resolved ``"auto"`` runs the
    Triton path only where it is exact (``check_vma=True``), else the native one.
    """

    def __init__(self, axis: str, shard_logps: Optional[Callable] = None,
                 explicit: bool = False) -> None:
        self.axis = axis
        self.shard_logps = shard_logps
        self.explicit = explicit

    def _logps(self, shards, ids, mask, temperature, entropy=False):
        """``([logp per block], entropy or None)``: the Triton or the native math."""
        # No rows: nothing to launch (the native math on [0, V] is free).
        if self.shard_logps is not None and shards[0].shape[0] > 0:
            if self.explicit or varies_over(shards[0], self.axis):
                return self.shard_logps(shards, ids, mask, temperature, self.axis, entropy)
        t = _native.row_temperature(temperature, shards[0].shape[0])
        return block_logps(shards, ids, mask, t, self.axis, entropy)[:2]

    def selected_logprobs(
        self,
        logits: jax.Array,
        ids: jax.Array,
        mask: jax.Array,
        temperature: Temperature,
    ) -> jax.Array:
        """Float32 ``logp[N]`` from this device's block ``logits[N, V_local]``."""
        return self._logps([logits], ids, mask, temperature)[0][0]

    def logprobs_entropy(
        self,
        logits: jax.Array,
        ids: jax.Array,
        mask: jax.Array,
        temperature: Temperature,
    ) -> Tuple[jax.Array, jax.Array]:
        """Float32 ``(logp[N], entropy[N])`` from this device's block, both differentiable;
        the entropy adds one ``[N]`` term to the psum."""
        (logp,), ent = self._logps([logits], ids, mask, temperature, entropy=True)
        return logp, ent

    def ratio_kl(
        self,
        policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array, mask: jax.Array,
        old_logps: jax.Array, ref_logps: Optional[jax.Array], kl_code: int,
        temperature: Temperature,
    ) -> Tuple[jax.Array, jax.Array]:
        """Float32 ``(ratio[N], kl[N])``; one pmax and one psum for policy and reference."""
        shards = [policy] + ([] if ref is None else [lax.stop_gradient(ref)])
        logp, *logp_ref = self._logps(shards, ids, mask, temperature)[0]
        return _rows.ratio_kl(XP, logp, lambda: logp_ref[0], ref_logps, old_logps, mask,
                              kl_code)
