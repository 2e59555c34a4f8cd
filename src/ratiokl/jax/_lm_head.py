"""The linear ops' own GEMMs (JAX): a row chunk's logits from hidden states, their gradients.

The transform is ``ratiokl.spec.linear``'s (``x = softcap((h @ W.T + b) * scale)``, slope
``scale * (1 - (x / softcap)^2)``), applied in float32 to the GEMM's float32 result, which
is the chunk's logits (``logits_dtype="float32"``, the default) or is rounded once to the
inputs' dtype (``logits_dtype="input"``). The precision rules are the spec's
(:func:`~ratiokl.spec.linear.head_dtypes`) and PyTorch's (``ratiokl.torch._lm_head``): on
a GPU a float32 operand is split into bfloat16 pieces (``fp32_matmul="bf16x3"``) whose
products are summed in float32, ``d loss / d x`` enters the gradient GEMMs in the inputs'
half-precision dtype; on a CPU every GEMM of float32 logits is a float32 one. With
``logits_dtype="input"`` the rounding is a ``reduce_precision``: on the GPU, XLA may drop a float32 ->
bfloat16 -> float32 round trip inside a fusion (excess precision), which gave one consumer
(the entropy) unrounded logits beside another's (the log-prob) rounded ones (a float16
logit below 2^-14 in magnitude, a subnormal, becomes 0). Every ``dot_general`` here runs
at ``Precision.HIGHEST`` with float32 accumulation: float32 inputs get float32 GEMMs
whatever JAX's default matmul precision (TF32-class on GPUs), as the PyTorch op's
(``ratiokl.torch._lm_head.ieee_fp32``).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.jax._varying import varying_axes
from ratiokl.spec import (GRAD_PIECES, LogitTransform, chunk_rows_for, grad_weight_accumulator,
                          head_dtypes, piece_pairs, split_bf16, split_pieces, transform_logits,
                          transform_slope)

__all__ = ["add_grad_weight", "chunk_size", "grad_weight_zeros", "head_dtypes_of", "head_grads",
           "head_logits", "matmul", "vary_alike"]


def matmul(a: jax.Array, b: jax.Array, contract: Tuple[int, int],
           precision=lax.Precision.HIGHEST) -> jax.Array:
    """float32 ``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``
    (2-d operands), at ``precision`` (``Precision.HIGHEST``: float32 operands in float32),
    operands of two dtypes in the wider one."""
    if a.dtype != b.dtype:
        common = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(common), b.astype(common)
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def head_dtypes_of(kept: jax.Array, weight: jax.Array, transform: LogitTransform):
    """``(logits, gradient)`` dtypes of a chunk (``ratiokl.spec.head_dtypes``; a GPU when JAX's
    default backend is one)."""
    names = head_dtypes(str(kept.dtype), str(weight.dtype), transform,
                        jax.default_backend() == "gpu")
    return tuple(jnp.dtype(n) for n in names)


def chunk_size(chunk_rows: Optional[int], hidden: jax.Array, weight: jax.Array,
               transform: LogitTransform) -> int:
    """Rows per chunk (static): ``chunk_rows``, or the spec's byte budget for a chunk's
    logits and their gradient (``ratiokl.spec.chunk_rows_for``)."""
    logits, grad = head_dtypes_of(hidden, weight, transform)
    return chunk_rows_for(chunk_rows, hidden.shape[0], weight.shape[0],
                          logits.itemsize + grad.itemsize)


def grad_weight_zeros(weight: jax.Array, transform: LogitTransform) -> jax.Array:
    """``d weight``'s running sum over the chunks, zeros ``[V, H]`` in
    :func:`~ratiokl.spec.linear.grad_weight_accumulator`'s dtype (float32 with
    ``grad_weight_accum="float32"``, else the weight's), typed as ``weight`` inside
    ``shard_map``."""
    return jnp.zeros_like(weight, grad_weight_accumulator(str(weight.dtype), transform))


def add_grad_weight(total: jax.Array, dw: jax.Array) -> jax.Array:
    """``total + dw`` (a chunk's float32 share) in float32, rounded once to ``total``'s
    dtype, as a GEMM's epilogue adds into a narrower output (PyTorch's ``addmm_``)."""
    return (total.astype(jnp.float32) + dw).astype(total.dtype)


def _to_bf16(x: jax.Array) -> jax.Array:
    """``x`` rounded to bfloat16 for certain: XLA may drop a float32 -> bfloat16 -> float32
    round trip inside a fusion (excess precision), which would leave a split's remainder 0;
    ``reduce_precision`` rounds whatever the fusion."""
    return lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7).astype(jnp.bfloat16)


def _split(x: jax.Array, pieces: int) -> Tuple[jax.Array, ...]:
    """``x`` as bfloat16 pieces (``ratiokl.spec.split_bf16``; a bfloat16 ``x`` itself)."""
    if x.dtype == jnp.bfloat16:
        return (x,)
    return split_bf16(x, pieces, _to_bf16, lambda t: t.astype(jnp.float32))


def _split_mode(kept: jax.Array, weight: jax.Array, transform: LogitTransform) -> bool:
    """Whether the GEMMs run on bfloat16 pieces: a float32 operand on a GPU, ``"bf16x3"``."""
    return (jnp.float32 in (kept.dtype, weight.dtype) and jax.default_backend() == "gpu"
            and transform.fp32_matmul == "bf16x3")


def _products(a, b, pairs, contract: Tuple[int, int]) -> jax.Array:
    """float32 ``sum over pairs (i, j) of a[i] @ b[j]`` (bfloat16 pieces, float32 sums)."""
    terms = [matmul(a[i], b[j], contract, lax.Precision.DEFAULT) for i, j in pairs]
    return functools.reduce(lambda x, y: x + y, terms)


def _precision(kept: jax.Array, weight: jax.Array, transform: LogitTransform):
    """``Precision.HIGH`` (TF32) for float32 operands with ``"tf32"`` on a GPU, else
    ``HIGHEST``."""
    if (transform.fp32_matmul == "tf32" and jnp.float32 in (kept.dtype, weight.dtype)
            and jax.default_backend() == "gpu"):
        return lax.Precision.HIGH
    return lax.Precision.HIGHEST


def _product(kept: jax.Array, weight: jax.Array, transform: LogitTransform) -> jax.Array:
    """float32 ``kept @ weight.T``: the bfloat16 pieces' products (``fp32_matmul="bf16x3"``
    with a float32 operand, on a GPU; ``piece_pairs``), else one GEMM with float32
    accumulation (``_precision``)."""
    if _split_mode(kept, weight, transform):
        h = _split(kept, split_pieces(str(kept.dtype)))
        w = _split(weight, split_pieces(str(weight.dtype)))
        return _products(h, w, piece_pairs(len(h), len(w)), (1, 1))
    return matmul(kept, weight, (1, 1), _precision(kept, weight, transform))


def _logits(kept: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
            transform: LogitTransform) -> jax.Array:
    u = _product(kept, weight, transform)
    if bias is not None:
        u = u + bias.astype(jnp.float32)
    x = transform_logits(u, transform, jnp.tanh)
    logits, _ = head_dtypes_of(kept, weight, transform)
    if logits != jnp.float32:  # logits_dtype="input": a half-precision head
        info = jnp.finfo(logits)
        x = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(logits)


def vary_alike(hidden: jax.Array, weight: jax.Array, bias: Optional[jax.Array], *others,
               summed: Tuple[str, ...] = ()):
    """``hidden``, ``weight`` and ``bias`` typed as varying over every mesh axis that any
    argument varies over (inside ``shard_map``; nothing changes outside it), ``hidden``
    except over the axes in ``summed``. Their gradients, sums over rows and vocabulary, vary over
    all of them; JAX transposes each ``pcast`` into the ``psum`` over the axes the input did
    not vary over, in the gradient's dtype: the whole ``d weight`` of a weight replicated
    over data-parallel rows. ``summed``: axes whose ``psum`` of ``d hidden`` the caller's
    backward takes itself (in float32, over a vocabulary-sharded head)."""
    arrays = (hidden, weight, bias)
    axes = frozenset().union(*(varying_axes(x) for x in arrays + others if x is not None))
    wanted = (axes - frozenset(summed), axes, axes)
    return tuple(x if x is None or want <= varying_axes(x) else
                 lax.pcast(x, tuple(sorted(want - varying_axes(x))), to="varying")
                 for x, want in zip(arrays, wanted))


def head_logits(kept: jax.Array, weight: jax.Array, bias: Optional[jax.Array],
                transform: LogitTransform) -> jax.Array:
    """``x = softcap((kept @ weight.T + bias) * scale)`` ``[C, V]``, float32 (with
    ``logits_dtype="input"``: the inputs' dtype) (``kept`` has inactive rows zeroed already). Differentiable, through :func:`head_grads`
    (float32 accumulation): JAX's own transpose of a half-precision ``dot_general``
    accumulates ``d hidden`` in that precision (over the whole vocabulary: a float16
    ``d hidden`` 20 % off at V = 262,144 on the native route). Inside ``shard_map`` the
    three are cast alike first (:func:`vary_alike`), so each gradient is typed as its
    input."""
    return _head_logits(*vary_alike(kept, weight, bias), transform)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_logits(kept, weight, bias, transform: LogitTransform) -> jax.Array:
    return _logits(kept, weight, bias, transform)


def _head_logits_fwd(kept, weight, bias, transform):
    x = _logits(kept, weight, bias, transform)
    return x, (kept, weight, bias, x if transform.softcap is not None else None)


def _head_logits_bwd(transform, residuals, dx):
    kept, weight, bias, x = residuals
    dh, dw, db = head_grads(dx, x, kept, weight, transform)
    return (dh.astype(kept.dtype), dw.astype(weight.dtype),
            None if bias is None else db.astype(bias.dtype))


_head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


def head_grads(dx: jax.Array, x: Optional[jax.Array], kept: jax.Array, weight: jax.Array,
               transform: LogitTransform) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """float32 ``(du @ weight, du.T @ kept, column sums of du)`` with ``du = dx *
    slope(x)`` (``dx = d / d x`` ``[C, V]``; ``x`` may be None without a softcap), ``du``
    and the operands in the gradient's dtype for the GEMMs (``head_dtypes``: the inputs'
    half-precision dtype on a GPU when they share one), or ``GRAD_PIECES`` bfloat16 pieces
    of each (a float32 operand with ``"bf16x3"`` on a GPU), as the PyTorch op's."""
    du = dx.astype(jnp.float32) * transform_slope(
        None if x is None else x.astype(jnp.float32), transform)
    if _split_mode(kept, weight, transform):
        d, w, h = (_split(a, GRAD_PIECES) for a in (du, weight, kept))
        return (_products(d, w, piece_pairs(len(d), len(w), depth=1), (1, 0)),
                _products(d, h, piece_pairs(len(d), len(h), depth=1), (0, 0)),
                jnp.sum(du, axis=0))
    _, grad = head_dtypes_of(kept, weight, transform)
    du_k, w_k, h_k = du.astype(grad), weight.astype(grad), kept.astype(grad)
    precision = _precision(kept, weight, transform)
    return (matmul(du_k, w_k, (1, 0), precision), matmul(du_k, h_k, (0, 0), precision),
            jnp.sum(du, axis=0))
