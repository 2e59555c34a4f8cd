r"""The two ops from hidden states over a vocabulary-sharded lm_head (JAX, ``vocab_axis``).

Inside ``shard_map``, device ``k`` of mesh axis ``axis`` holds rows ``[k V_local, (k + 1)
V_local)`` of the lm_head, ``weight [V_local, H]`` and ``bias [V_local]`` (``in_specs``
``P(axis, None)`` / ``P(axis)``: an even split); the hidden states, ids, mask and
temperature are replicated along the axis. The chunk loop is
``ratiokl.jax._linear_logprobs``'s, run with the row operations of one vocabulary block
(:func:`native_rows`, :func:`kernel_rows`): per chunk the block's logits ``x_k [C,
V_local]``, their statistics from the sharded logits path (``_vocab_parallel.block_logps``,
or ``shard_stats_kernel`` through ``_triton_shard.shard_stats``) with its one ``pmax`` and one
``psum`` of ``[C]``-sized rows, giving the global ``lse``, ``logp`` and entropy on every
device; the backward's block gradient ``dx = (g (onehot(a) - p) - g_H p (log p + H)) / T``
from the global ``lse`` and ``H`` (the one-hot on the owning device only), no collective.

``d weight`` and ``d bias`` are the device's rows of the unsharded gradients. ``d hidden``:
replicated hidden states enter the op's ``custom_vjp`` invariant over the axis; its
backward casts them to varying (``pcast``), keeps the block's partial ``du_k W_k`` in
float32 (``[N, H]``) and takes one ``psum`` of ``[N, H]`` float32 over the axis, rounded
once to the hidden states' dtype: the full gradient on every device, invariant as the
hidden states are, rounded as the unsharded op rounds its one float32 sum
(``_linear_logprobs``, ``vocab_axis``). A ``pcast`` before the op, transposed by JAX, would
``psum`` partials already rounded to the hidden states' dtype. Hidden states already typed
as varying over the axis keep their partial, in their dtype, as JAX's typing asks. Other
mesh axes compose through ``_lm_head.vary_alike`` (rows split over a data-parallel axis:
the weight is cast along it, so JAX sums its gradient over it).

Collectives: one ``pmax`` and one ``psum`` of ``[C]``-sized rows per chunk, and in the
backward the one float32 ``psum`` of ``d hidden`` (none in the compiled program when
``hidden`` is not differentiated).

The ``jax.custom_vjp`` around the chunks holds the collectives, so the types must tell JAX
what varies: ``check_vma=True`` (``shard_map``'s default), ``weight`` / ``bias`` varying
over ``axis``; otherwise ``ValueError``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.jax import _linear_logprobs, _native
from ratiokl.jax._checks import Temperature
from ratiokl.jax._linear_logprobs import RowOps
from ratiokl.jax._varying import varies_over
from ratiokl.jax._vocab_parallel import _ownership, block_logps
from ratiokl.spec import LogitTransform

__all__ = ["kernel_rows", "native_rows", "selected_logprobs"]


def _native_forward(axis: str, x, ids, mask, temp, entropy: bool):
    (logp,), ent, lse = block_logps([x], ids, mask, jnp.broadcast_to(temp, mask.shape), axis,
                                    entropy)
    return logp, ent, lse[0]


def _native_backward(axis: str, x, ids, mask, temp, lse, ent, g_logp, g_ent):
    local_ids, owned, _ = _ownership(ids, mask, x.shape[-1], axis)
    onehot = owned[:, None] & (local_ids[:, None] == jnp.arange(x.shape[-1])[None, :])
    g_logp = jnp.zeros_like(lse) if g_logp is None else g_logp
    return _native.entropy_grad(x, onehot, mask, jnp.broadcast_to(temp, mask.shape), lse,
                                ent, g_logp, g_ent)


@functools.lru_cache(maxsize=None)
def native_rows(axis: str) -> RowOps:
    """One block's row operations on XLA's ops (the logits path's native statistics)."""
    return RowOps(functools.partial(_native_forward, axis),
                  functools.partial(_native_backward, axis))


@functools.lru_cache(maxsize=None)
def kernel_rows(call: Callable, axis: str) -> RowOps:
    """One block's row operations on the kernels launched through ``call``: the statistics
    from ``shard_stats_kernel`` (``_triton_shard.shard_stats``), the gradient from the unsharded
    rows' ``logp_backward_kernel`` given the block-local id (-1: no one-hot here)."""
    from ratiokl.jax import _triton_shard  # imports triton: only when a kernel backend runs

    rows = _linear_logprobs.triton_rows(call)

    def forward(x, ids, mask, temp, entropy):
        z_sel, lse, ent, _ = _triton_shard.shard_stats(call, [x], ids, mask, temp, axis, entropy)
        logp = jnp.where(mask, z_sel[0] - lse[0], 0.0)
        return logp, jnp.where(mask, ent, 0.0) if entropy else None, lse[0]

    def backward(x, ids, mask, temp, lse, ent, g_logp, g_ent):
        local = ids - lax.axis_index(axis) * x.shape[-1]
        owned = mask & (local >= 0) & (local < x.shape[-1])
        local_ids = jnp.where(owned, local, -1).astype(ids.dtype)
        return rows.backward(x, local_ids, mask, temp, lse, ent, g_logp, g_ent)

    return RowOps(forward, backward)


def selected_logprobs(axis: str, shard_rows: Optional[Callable], hidden: jax.Array,
                      weight: jax.Array, bias: Optional[jax.Array], ids: jax.Array,
                      mask: jax.Array, temperature: Temperature, transform: LogitTransform,
                      chunk_rows: int, entropy: bool):
    """``logp`` float32 ``[N]``, or ``(logp, entropy)``, of ``hidden [N, H]`` through this
    device's block of the head, ``weight [V_local, H]`` / ``bias [V_local]`` (module
    docstring); the same on every device of ``axis``. ``shard_rows``: the backend's kernel
    rows (``axis -> RowOps``), or None for the native math."""
    for name, x in (("weight", weight), ("bias", bias)):
        if x is not None and not varies_over(x, axis):
            spec = f"P({axis!r}, None)" if name == "weight" else f"P({axis!r})"
            raise ValueError(
                f"vocab_axis={axis!r}: `{name}` must be this device's block of the lm_head, "
                f"typed as varying over {axis!r}: pass it sharded (in_specs {spec}) to "
                "`jax.shard_map(..., check_vma=True)` (the default). With check_vma=False "
                "JAX cannot tell what varies and the gradients would be scaled wrongly"
            )
    ops = native_rows(axis) if shard_rows is None else shard_rows(axis)
    return _linear_logprobs.selected_logprobs(ops, hidden, weight, bias, ids, mask, temperature,
                                              transform, chunk_rows, entropy, axis)
