"""Per-token log-probs (and entropy) from the last hidden states and the lm_head, in row
chunks (JAX).

The math and the chunk loop are ``ratiokl.torch._linear_logprobs``'s (its docstring): per
chunk of ``C`` rows, the logits ``x`` of ``where(mask, h, 0)`` (``_lm_head.head_logits``,
one ``[C, V]`` array in the weight's dtype), then the backend's row statistics (``logp``,
the entropy, ``lse``). A ``jax.custom_vjp`` keeps ``lse`` and the entropy (O(N)) beside its
inputs; the backward recomputes each chunk's logits, takes the backend's row gradient ``dx``
of ``(g_logp, g_entropy)`` and adds the chunk's share of ``d hidden``, ``d weight`` and ``d
bias`` (``_lm_head.head_grads``). The first chunk runs on its own, typing the carries
inside ``shard_map``, the other full chunks in a ``lax.fori_loop`` (one chunk's logits live
at a time), the remainder once after it. A cotangent nothing produced (the entropy's, when
only ``logp`` is differentiated) drops its term (symbolic zeros).

The row statistics and gradient come from a :class:`RowOps`: the shared Triton kernels
through a launch function (:func:`triton_rows`: ``"triton"``, ``"interpret"``), XLA's ops
(:data:`NATIVE_ROWS`), or one vocabulary block's with ``vocab_axis``
(``ratiokl.jax._vocab_linear``). Inside ``shard_map`` the hidden states, weight and bias
are cast to vary over every mesh axis any input varies over (``_lm_head.vary_alike``), so
each gradient is summed over the axes its input was replicated on. Over a vocabulary-sharded
head (``vocab_axis``) replicated hidden states are cast inside the backward instead: each
device's partial ``d hidden`` is kept in float32 (``[N, H]``), one ``psum`` over the axis
sums the partials and the total is rounded once to the hidden states' dtype, as the
unsharded op rounds its one float32 sum (a ``pcast`` outside would sum partials already
rounded to that dtype).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ratiokl._codes import KL
from ratiokl.jax import _native
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._lm_head import (add_grad_weight, chunk_size, grad_weight_zeros, head_grads,
                                  head_logits, vary_alike)
from ratiokl.jax._vocab_parallel import varies_over
from ratiokl.spec import LogitTransform

if TYPE_CHECKING:
    from ratiokl.jax._launch import TritonCall

__all__ = ["NATIVE_ROWS", "RowOps", "selected_logprobs", "triton_rows"]


class RowOps(NamedTuple):
    """A backend's row statistics and row gradient of a chunk's logits ``x [C, V]``
    (``temp``: float32 ``[C]``, or ``[1]`` for every row)."""

    #: ``(x, ids, mask, temp, entropy) -> (logp, entropy | None, lse)``, float32 ``[C]``
    forward: Callable
    #: ``(x, ids, mask, temp, lse, entropy | None, g_logp | None, g_entropy | None) -> dx``
    backward: Callable


def _native_forward(x, ids, mask, temp, entropy):
    return _native.rows_forward(x, ids, mask, jnp.broadcast_to(temp, mask.shape), entropy)


def _native_backward(x, ids, mask, temp, lse, ent, g_logp, g_ent):
    return _native.rows_backward(x, ids, mask, jnp.broadcast_to(temp, mask.shape), lse, ent,
                                 g_logp, g_ent)


NATIVE_ROWS = RowOps(_native_forward, _native_backward)


@functools.lru_cache(maxsize=None)
def triton_rows(call: "TritonCall") -> RowOps:
    """The row kernels launched through ``call`` (one :class:`RowOps` per launch function;
    ``_launch`` imported here: the native rows need no Triton)."""
    from ratiokl.jax import _launch  # imports triton: only when a kernel backend runs

    def forward(x, ids, mask, temp, entropy):
        logp, _, ent, _, lse = _launch.forward_op(call, KL.NONE.value, False, entropy)(
            x, x, ids, mask, temp, temp, temp)  # no reference: placeholders, never read
        return logp, ent if entropy else None, lse

    def backward(x, ids, mask, temp, lse, ent, g_logp, g_ent):
        entropy = g_ent is not None
        # Absent terms' arrays are placeholders the kernel never reads.
        return _launch.backward_op(call, (g_logp is not None, False, entropy), entropy)(
            x, ids, mask, temp, lse, lse if g_logp is None else g_logp, lse, lse,
            g_ent if entropy else lse, ent if entropy else lse)

    return RowOps(forward, backward)


class _Static(NamedTuple):
    """The hashable options of one call."""

    ops: RowOps
    transform: LogitTransform
    chunk: int
    entropy: bool
    summed: Tuple[str, ...]  # axes over which the backward psums d hidden, in float32


def _kept(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """``where(mask, hidden, 0)``: an inactive row's state (NaN, inf) enters no GEMM."""
    return jnp.where(mask[:, None], hidden, jnp.zeros((), hidden.dtype))


def _loop(n_rows: int, chunk: int, step: Callable, carry):
    """``step(start, size, carry)`` over the row chunks: the first on its own, which types
    the carry as the chunks' values are typed (inside ``shard_map``: the mesh axes they vary
    over, which the zeros it starts from do not know), then the other full ones in a
    ``fori_loop``, the remainder last."""
    full, rest = divmod(n_rows, chunk)
    if full:
        carry = step(0, chunk, carry)
    if full > 1:
        carry = lax.fori_loop(1, full, lambda i, c: step(i * chunk, chunk, c), carry)
    if rest:
        carry = step(full * chunk, rest, carry)
    return carry


def _forward(static: _Static, hidden, weight, bias, ids, mask, temp):
    """``(logp, entropy, lse)`` float32 ``[N]`` (the entropy 0 without ``static.entropy``)."""
    n_rows = hidden.shape[0]
    rows = tuple(jnp.zeros((n_rows,), jnp.float32) for _ in range(3))
    per_row_temp = temp.shape[0] == n_rows and n_rows > 1

    def step(start, size: int, rows):
        part = lambda x: lax.dynamic_slice_in_dim(x, start, size)  # noqa: E731
        mask_c = part(mask)
        x = head_logits(_kept(part(hidden), mask_c), weight, bias, static.transform)
        out = static.ops.forward(x, part(ids), mask_c, part(temp) if per_row_temp else temp,
                                 static.entropy)
        return tuple(r if o is None else lax.dynamic_update_slice_in_dim(r, o, start, 0)
                     for r, o in zip(rows, out))

    return _loop(n_rows, static.chunk, step, rows)


def _backward(static: _Static, hidden, weight, bias, ids, mask, temp, lse, ent, g_logp,
              g_ent):
    """``(d hidden, d weight, d bias | None)`` in the inputs' dtypes."""
    n_rows, dtype = hidden.shape[0], hidden.dtype
    per_row_temp = temp.shape[0] == n_rows and n_rows > 1
    if static.summed:  # this device's partial d hidden, in float32 until summed
        hidden = lax.pcast(hidden, static.summed, to="varying")
    grad_dtype = jnp.float32 if static.summed else dtype
    # zeros_like: typed as the inputs are inside shard_map (a vocabulary-sharded weight's
    # gradient varies over the axis).
    carry = (jnp.zeros_like(hidden, grad_dtype), grad_weight_zeros(weight, static.transform),
             jnp.zeros_like(weight, jnp.float32, shape=weight.shape[:1]))

    def step(start, size: int, carry):
        grad_hidden, grad_weight, grad_bias = carry

        def part(x):
            return None if x is None else lax.dynamic_slice_in_dim(x, start, size)

        mask_c = part(mask)
        kept = _kept(part(hidden), mask_c)
        x = head_logits(kept, weight, bias, static.transform)
        dx = static.ops.backward(x, part(ids), mask_c, part(temp) if per_row_temp else temp,
                                 part(lse), part(ent), part(g_logp), part(g_ent))
        dh, dw, db = head_grads(dx, x, kept, weight, static.transform)
        return (lax.dynamic_update_slice_in_dim(grad_hidden, dh.astype(grad_dtype), start, 0),
                add_grad_weight(grad_weight, dw), grad_bias + db)

    if g_logp is not None or g_ent is not None:
        carry = _loop(n_rows, static.chunk, step, carry)
    grad_hidden, grad_weight, grad_bias = carry
    if static.summed:  # the float32 partials summed, rounded once
        grad_hidden = lax.psum(grad_hidden, static.summed).astype(dtype)
    return (grad_hidden, grad_weight.astype(weight.dtype),
            None if bias is None else grad_bias.astype(bias.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _linear(static: _Static, hidden, weight, bias, ids, mask, temp):
    logp, ent, _ = _forward(static, hidden, weight, bias, ids, mask, temp)
    return (logp, ent) if static.entropy else logp


def _linear_fwd(static, *primals):
    # symbolic_zeros: each array comes as a CustomVJPPrimal (its value, whether perturbed).
    hidden, weight, bias, ids, mask, temp = (
        None if p is None else p.value for p in primals)
    logp, ent, lse = _forward(static, hidden, weight, bias, ids, mask, temp)
    out = (logp, ent) if static.entropy else logp
    return out, (hidden, weight, bias, ids, mask, temp, lse, ent)


def _linear_bwd(static, residuals, cotangents):
    hidden, weight, bias, ids, mask, temp, lse, ent = residuals
    if not static.entropy:
        cotangents = (cotangents, None)
    g_logp, g_ent = (None if g is None or isinstance(g, SymbolicZero) else g.astype(jnp.float32)
                     for g in cotangents)
    grads = _backward(static, hidden, weight, bias, ids, mask, temp, lse, ent, g_logp, g_ent)
    return (*grads, None, None, None)


_linear.defvjp(_linear_fwd, _linear_bwd, symbolic_zeros=True)


def selected_logprobs(ops: RowOps, hidden: jax.Array, weight: jax.Array,
                      bias: Optional[jax.Array], ids: jax.Array, mask: jax.Array,
                      temperature: Temperature, transform: LogitTransform, chunk_rows: int,
                      entropy: bool, vocab_axis: Optional[str] = None):
    """``logp`` float32 ``[N]``, or ``(logp, entropy)``, of ``hidden [N, H]`` through the
    head ``weight [V, H]`` / ``bias [V]`` (one dtype), ``chunk_rows`` rows at a time
    (static); ``ids``, ``mask`` and a per-row ``temperature`` are ``[N]``. Differentiable
    w.r.t. ``hidden``, ``weight`` and ``bias``. ``vocab_axis``: the mesh axis the head's
    rows are sharded over, whose ``psum`` of ``d hidden`` the backward takes in float32
    (module docstring)."""
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    summed = () if vocab_axis is None or varies_over(hidden, vocab_axis) else (vocab_axis,)
    static = _Static(ops, transform, chunk_size(chunk_rows, hidden, weight, transform), entropy,
                     summed)
    hidden, weight, bias = vary_alike(hidden, weight, bias, ids, mask_k, temp, summed=summed)
    return _linear(static, hidden, weight, bias, ids, mask_k, lax.stop_gradient(temp))
