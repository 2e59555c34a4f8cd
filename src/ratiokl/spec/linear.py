"""The lm_head in front of the log-probs: options, shape rules, transform math, float64 reference.

Written once for both frameworks (NumPy only). With the last hidden states ``h [..., H]``,
the lm_head ``weight [V, H]`` and an optional ``bias [V]``, the logits the log-probs see are::

    u = h @ weight.T + bias                    (the GEMM; bias 0 when absent)
    z = u * logit_scale                        (Cohere / Granite logit scaling)
    x = softcap * tanh(z / softcap)            (Gemma's final softcap; x = z without one)
    logp, entropy of softmax(x / T)            (``ratiokl.spec.reference``)

in TRL's order (scale, then softcap, then temperature). Chained back to ``u``::

    d x / d u = logit_scale * (1 - (x / softcap)^2)      (1 - tanh^2 from the capped x)

so ``d hidden = du @ weight``, ``d weight = du.T @ where(mask, h, 0)`` and ``d bias =
sum_rows du``. Inactive rows (mask false) have their hidden states replaced by 0 before any
GEMM (whatever they hold, NaN included, it reaches no value or gradient) and their
outputs are neutral (``logp = 0``, ``entropy = 0``, ``d hidden`` exactly 0). A ``-inf``
bias entry masks a token: ``x = -inf`` (``-softcap`` with a softcap, whose slope is 0
there), which adds 0 to every value and gradient.

:func:`transform_logits` and :func:`transform_slope` are the formula both frameworks apply
(on NumPy, torch or JAX arrays: plain arithmetic plus the ``tanh`` given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, get_args

import numpy as np

from ratiokl.spec.reference import (
    ArrayLike,
    check_action_ids,
    entropy,
    entropy_grad,
    selected_logprobs,
    selected_logprobs_grad,
)

__all__ = [
    "CHUNK_BYTES",
    "Fp32Matmul",
    "GRAD_PIECES",
    "GradWeightAccum",
    "LogitTransform",
    "LogitsDtype",
    "check_chunk_rows",
    "chunk_rows_for",
    "head_dtypes",
    "check_head_shapes",
    "grad_weight_accumulator",
    "linear_grad_magnitudes",
    "linear_logits",
    "linear_selected_logprobs",
    "linear_selected_logprobs_grad",
    "logit_transform",
    "piece_pairs",
    "split_bf16",
    "split_pieces",
    "transform_logits",
    "transform_slope",
    "vocab_blocks",
]


#: ``logits_dtype``: ``"float32"`` (default) keeps each chunk's logits in float32 straight
#: from the GEMM's float32 accumulator (an fp32 head on the inputs' own values);
#: ``"input"`` rounds them to the inputs' dtype first (a bf16 head, as the GEMM of a bf16
#: ``F.linear`` / ``jnp.dot`` writes them).
LogitsDtype = Literal["float32", "input"]

#: ``fp32_matmul``: how a GEMM with a float32 operand runs on a GPU. ``"bf16x3"`` (default)
#: splits each float32 operand into three bfloat16 pieces (``x = hi + mid + lo``, 24
#: significant bits, exact up to float32's range) and sums the products whose pieces
#: carry at least float32's precision (``piece_pairs``) on the tensor cores, accumulated in
#: float32; ``"ieee"`` runs a float32 GEMM; ``"tf32"`` a TF32 one (10-bit mantissas). On a
#: CPU every float32 GEMM is a float32 one.
Fp32Matmul = Literal["bf16x3", "ieee", "tf32"]

#: ``grad_weight_accum``: the dtype in which ``d weight [V, H]`` is summed over the row chunks.
#: ``"float32"`` (default): a float32 ``[V, H]`` running sum, rounded once to the weight's
#: dtype at the end (``V * H * 4`` bytes: 2.3 GiB at V = 151,936, H = 4,096; with the rounded
#: copy beside it at the end, that much more at the peak than ``"weight"``); ``"weight"``: the
#: running sum in the weight's dtype, each chunk's GEMM adding its share with one rounding (a
#: bf16 weight: one bf16 rounding per chunk, ~57 at N = 65,536 with 1,152-row chunks).
#: Chosen by measurement (docs/performance.md, decision log).
GradWeightAccum = Literal["float32", "weight"]

#: The byte budget of one row chunk's logits and their gradient (``chunk_rows=None``):
#: float32 logits [C, V] plus the gradient [C, V] in the inputs' dtype, at most 1 GiB (1152
#: rows at V = 151,936). Chosen by measurement (H100, N = 8192, H = 4096, docs/api.md):
#: ``d weight`` is read and written once per chunk, so below about 1024 rows that traffic
#: outweighs its GEMM (256 rows: ``linear_policy_loss`` 1.62x the three GEMMs; 1024: 1.06x).
CHUNK_BYTES = 2 ** 30

#: Chunk sizes are multiples of this many rows (the GEMMs' row tiles), unless N is smaller.
_CHUNK_ALIGN = 64

_PIECES = {"bfloat16": 1, "float16": 2, "float32": 3}


@dataclass(frozen=True)
class LogitTransform:
    """The validated lm_head options (:func:`logit_transform`): ``x = softcap(u * scale)``,
    the logits' dtype and how float32 GEMMs run."""

    scale: float = 1.0  # logit_scale, positive and finite
    softcap: Optional[float] = None  # logit_softcap, positive and finite, or None (off)
    logits_dtype: str = "float32"  # LogitsDtype
    fp32_matmul: str = "bf16x3"  # Fp32Matmul
    grad_weight_accum: str = "float32"  # GradWeightAccum

    @property
    def identity(self) -> bool:
        """No scale, no softcap: ``x = u``."""
        return self.scale == 1.0 and self.softcap is None


def _positive(name: str, value: object, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be a Python number ({hint}); got "
                        f"{type(value).__name__}")
    if not 0.0 < float(value) < math.inf:
        raise ValueError(f"`{name}` must be positive and finite ({hint}); got {value}")
    return float(value)


def _choice(name: str, value: object, options: Any) -> str:
    allowed = get_args(options)
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}; "
                         f"got {value!r}")
    return str(value)


def logit_transform(logit_scale: object = 1.0, logit_softcap: object = None,
                    logits_dtype: object = "float32", fp32_matmul: object = "bf16x3",
                    grad_weight_accum: object = "float32") -> LogitTransform:
    """The checked ``logit_scale``, ``logit_softcap``, ``logits_dtype``, ``fp32_matmul``
    and ``grad_weight_accum`` (``ValueError`` / ``TypeError`` naming the argument): static
    Python values, as a model's config holds them."""
    scale = _positive("logit_scale", logit_scale, "the model's logit multiplier, e.g. 0.0625")
    softcap = None if logit_softcap is None else _positive(
        "logit_softcap", logit_softcap, "e.g. Gemma 2's final_logit_softcapping 30.0; None: off")
    return LogitTransform(scale, softcap, _choice("logits_dtype", logits_dtype, LogitsDtype),
                          _choice("fp32_matmul", fp32_matmul, Fp32Matmul),
                          _choice("grad_weight_accum", grad_weight_accum, GradWeightAccum))


def check_chunk_rows(chunk_rows: object) -> Optional[int]:
    """``chunk_rows``: None (sized by :data:`CHUNK_BYTES`) or a positive Python int
    (``ValueError`` naming it otherwise)."""
    if chunk_rows is None:
        return None
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"`chunk_rows` must be a positive int, or None to size the chunk by "
                         f"bytes; got {chunk_rows!r}")
    return chunk_rows


def head_dtypes(hidden_dtype: str, weight_dtype: str, transform: LogitTransform,
                gpu: bool) -> Tuple[str, str]:
    """``(logits, gradient)`` dtype names of a row chunk (dtypes by name).

    The logits: float32, or with ``logits_dtype="input"`` the inputs' common dtype (float32
    when they differ). The gradient ``d loss / d x`` as the kernels write it for the
    gradient GEMMs: on a GPU the inputs' half-precision dtype when they share one (as every
    fused head does), else float32 (split into bfloat16 pieces for ``fp32_matmul="bf16x3"``:
    :data:`GRAD_PIECES`); on a CPU, where every GEMM of a float32 chunk is a float32 one, the
    logits' dtype.
    """
    same = hidden_dtype == weight_dtype
    logits = hidden_dtype if transform.logits_dtype == "input" and same else "float32"
    if not gpu:
        return logits, logits
    return logits, hidden_dtype if same and hidden_dtype != "float32" else "float32"


def grad_weight_accumulator(weight_dtype: str, transform: LogitTransform) -> str:
    """The dtype name of ``d weight``'s running sum over the row chunks (weight dtype by
    name): float32 with ``grad_weight_accum="float32"`` (or a float32 weight), else the
    weight's own. The same on every backend and device."""
    return "float32" if transform.grad_weight_accum == "float32" else weight_dtype


def chunk_rows_for(chunk_rows: Optional[int], n_rows: int, vocab: int,
                   bytes_per_logit: int) -> int:
    """Rows per chunk: ``chunk_rows`` when given, else as many rows as keep a chunk's
    ``[C, V]`` buffers (``bytes_per_logit`` bytes per entry: the logits' and the gradient's)
    within :data:`CHUNK_BYTES`, a multiple of 64 (at least 64); never more than ``n_rows``
    (at least 1)."""
    if chunk_rows is None:
        rows = CHUNK_BYTES // max(1, vocab * bytes_per_logit)
        chunk_rows = max(_CHUNK_ALIGN, rows - rows % _CHUNK_ALIGN)
    return max(1, min(chunk_rows, n_rows))


def split_pieces(dtype: str) -> int:
    """How many bfloat16 pieces hold a ``dtype`` operand exactly: 1 (bfloat16), 2 (float16:
    11 significant bits), 3 (float32: 24)."""
    return _PIECES[dtype]


#: ``fp32_matmul="bf16x3"``'s gradient GEMMs: ``d loss / d x`` and each float32 operand in
#: two bfloat16 pieces (16 significant bits, as a gradient needs), the products of
#: ``piece_pairs(..., depth=1)``.
GRAD_PIECES = 2


def piece_pairs(pieces_a: int, pieces_b: int, depth: int = 2) -> Tuple[Tuple[int, int], ...]:
    """The products ``a_i @ b_j`` a split GEMM sums (``fp32_matmul="bf16x3"``): piece ``i``
    of ``a`` is about ``2^(-8 i)`` of it, so the pairs with ``i + j <= depth`` carry every
    term down to ``2^(-8 (depth + 1))`` and drop the smaller ones. ``depth=2`` (the
    logits): float32's precision, three GEMMs for a bfloat16 operand against a float32
    one, six for two float32 operands (BF16x6); ``depth=1`` (the gradients, two pieces a
    side): three GEMMs."""
    return tuple((i, j) for i in range(pieces_a) for j in range(pieces_b) if i + j <= depth)


def split_bf16(x: Any, pieces: int, to_bf16: Callable[[Any], Any],
               to_f32: Callable[[Any], Any]) -> Tuple[Any, ...]:
    """``pieces`` bfloat16 arrays whose float32 sum is ``x`` (float32, or float16) to
    ``8 * pieces`` significant bits: ``hi = bf16(x)``, ``mid = bf16(x - hi)``, ``lo =
    bf16(x - hi - mid)`` (each remainder exact in float32), on any array type."""
    out = []
    rest = to_f32(x)
    for _ in range(pieces):
        piece = to_bf16(rest)
        out.append(piece)
        rest = rest - to_f32(piece)
    return tuple(out)


def check_head_shapes(hidden_shape: Sequence[int], hidden_dtype: str,
                      weight_shape: Sequence[int], weight_dtype: str,
                      bias_shape: Optional[Sequence[int]] = None,
                      bias_dtype: Optional[str] = None) -> Tuple[int, ...]:
    """The leading shape ``[...]`` of ``hidden [..., H]``, after checking ``weight [V, H]``
    and ``bias [V]`` against it (dtypes by name, e.g. ``"bfloat16"``: the bias in the weight's
    dtype; the hidden states in it or in float32, or float32 ones with a half-precision
    weight). Raises ``ValueError`` (shapes) or ``TypeError`` (dtypes) naming the
    argument."""
    width = hidden_shape[-1]
    if len(weight_shape) != 2 or weight_shape[1] != width:
        raise ValueError(
            f"`weight` must be the lm_head weight [V, H] with H = hidden.shape[-1] = {width}; "
            f"got shape {list(weight_shape)}"
        )
    if weight_dtype != hidden_dtype and "float32" not in (weight_dtype, hidden_dtype):
        raise TypeError(
            f"`hidden` ({hidden_dtype}) and `weight` ({weight_dtype}): a half-precision "
            "weight takes hidden states of its own dtype or float32; cast one, e.g. "
            "`hidden.to(weight.dtype)`"
        )
    if bias_shape is not None:
        if tuple(bias_shape) != (weight_shape[0],):
            raise ValueError(f"`bias` must have shape [V] = [{weight_shape[0]}] (the lm_head's "
                             f"rows); got {list(bias_shape)}")
        if bias_dtype != weight_dtype:
            raise TypeError(f"`bias` ({bias_dtype}) must have the weight's dtype "
                            f"({weight_dtype}); cast it, e.g. `bias.to(weight.dtype)`")
    return tuple(hidden_shape[:-1])


def vocab_blocks(widths: Sequence[int], argument: str) -> Tuple[Tuple[int, ...], int]:
    """``(starts, V)`` of a vocabulary split over ranks in contiguous blocks, in rank order.

    Rank ``r`` holds ids ``[starts[r], starts[r] + widths[r])`` (its rows of a sharded
    ``weight [V_r, H]``, or its columns of sharded logits ``[..., V_r]``); ``V = sum(widths)``
    is the range the action ids are checked against. Raises ``ValueError`` naming
    ``argument`` (the sharded array) when a rank's block is empty.
    """
    empty = [r for r, width in enumerate(widths) if width < 1]
    if empty:
        raise ValueError(
            f"`{argument}`: every rank's vocabulary block needs at least one token; rank(s) "
            f"{', '.join(map(str, empty))} hold none (block widths by rank: {list(widths)}). "
            "Split the vocabulary over at most V ranks"
        )
    starts = tuple(int(sum(widths[:r])) for r in range(len(widths)))
    return starts, int(sum(widths))


def transform_logits(u: Any, transform: LogitTransform, tanh: Callable[[Any], Any]) -> Any:
    """``x = softcap * tanh(u * scale / softcap)`` (``u * scale`` without a softcap; ``u``
    itself for the identity), on any array type with ``tanh`` its elementwise tanh."""
    z = u if transform.scale == 1.0 else u * transform.scale
    if transform.softcap is None:
        return z
    return transform.softcap * tanh(z / transform.softcap)


def transform_slope(x: Any, transform: LogitTransform) -> Any:
    """``d x / d u`` from the transformed logits ``x``: ``scale * (1 - (x / softcap)^2)``
    (``scale`` alone without a softcap, a Python float)."""
    if transform.softcap is None:
        return transform.scale
    r = x / transform.softcap
    return transform.scale * (1.0 - r * r)


def _rows_in(hidden, mask) -> Tuple[np.ndarray, np.ndarray]:
    """float64 ``where(mask, hidden, 0)`` and the bool mask (all true when None)."""
    hidden = np.asarray(hidden, dtype=np.float64)
    lead = hidden.shape[:-1]
    mask = np.ones(lead, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    return np.where(mask[..., None], hidden, 0.0), mask


def linear_logits(hidden: np.ndarray, weight: np.ndarray, bias: Optional[np.ndarray] = None, *,
                  logit_scale: float = 1.0, logit_softcap: Optional[float] = None) -> np.ndarray:
    """float64 ``x [..., V]`` of ``hidden [..., H]`` (the module docstring's transform)."""
    u = np.asarray(hidden, dtype=np.float64) @ np.asarray(weight, dtype=np.float64).T
    if bias is not None:
        u = u + np.asarray(bias, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return transform_logits(u, logit_transform(logit_scale, logit_softcap), np.tanh)


def linear_selected_logprobs(
    hidden: np.ndarray, weight: np.ndarray, action_ids: np.ndarray,
    mask: Optional[np.ndarray] = None, *, bias: Optional[np.ndarray] = None,
    temperature: ArrayLike = 1.0, logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None, return_entropy: bool = False,
):
    """``logp`` (float64 ``[...]``), or ``(logp, entropy)``, of the logits of ``hidden``:
    :func:`~ratiokl.spec.reference.selected_logprobs` (and ``entropy``) of
    :func:`linear_logits` with inactive rows' hidden states zeroed first."""
    kept, mask = _rows_in(hidden, mask)
    x = linear_logits(kept, weight, bias, logit_scale=logit_scale, logit_softcap=logit_softcap)
    logp = selected_logprobs(x, action_ids, mask, temperature=temperature)
    if not return_entropy:
        return logp
    return logp, entropy(x, mask, temperature=temperature)


def _head_grads(hidden, weight, action_ids, mask, grad_logp, grad_entropy, bias, temperature,
                logit_scale, logit_softcap):
    """float64 ``(du [..., V], where(mask, hidden, 0), weight, mask)`` of the gradient."""
    kept, mask = _rows_in(hidden, mask)
    check_action_ids(action_ids, mask, np.shape(weight)[0])
    transform = logit_transform(logit_scale, logit_softcap)
    x = linear_logits(kept, weight, bias, logit_scale=logit_scale, logit_softcap=logit_softcap)
    dx = selected_logprobs_grad(x, action_ids, mask, grad_logp, temperature=temperature)
    if grad_entropy is not None:
        dx = dx + entropy_grad(x, mask, grad_entropy, temperature=temperature)
    with np.errstate(invalid="ignore", over="ignore"):
        du = np.where(mask[..., None], dx * transform_slope(x, transform), 0.0)
    return du, kept, np.asarray(weight, dtype=np.float64), mask


def _products(du, kept, weight, mask, with_bias: bool):
    rows_du, rows_h = du.reshape(-1, du.shape[-1]), kept.reshape(-1, kept.shape[-1])
    d_hidden = np.where(mask[..., None], du @ weight, 0.0)
    return d_hidden, rows_du.T @ rows_h, rows_du.sum(axis=0) if with_bias else None


def linear_selected_logprobs_grad(
    hidden: np.ndarray, weight: np.ndarray, action_ids: np.ndarray, mask: Optional[np.ndarray],
    grad_logp: np.ndarray, grad_entropy: Optional[np.ndarray] = None, *,
    bias: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0, logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """float64 ``(d hidden, d weight, d bias)`` of ``sum(grad_logp * logp + grad_entropy *
    entropy)`` (``d bias`` None without a bias). Inactive rows' ``d hidden`` is exactly 0
    and they add nothing to ``d weight`` / ``d bias``."""
    du, kept, w, mask = _head_grads(hidden, weight, action_ids, mask, grad_logp, grad_entropy,
                                    bias, temperature, logit_scale, logit_softcap)
    return _products(du, kept, w, mask, bias is not None)


def linear_grad_magnitudes(
    hidden: np.ndarray, weight: np.ndarray, action_ids: np.ndarray, mask: Optional[np.ndarray],
    grad_logp: np.ndarray, grad_entropy: Optional[np.ndarray] = None, *,
    bias: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0, logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
) -> Tuple[float, float, Optional[float]]:
    """The largest entry of ``|du| @ |weight|``, ``|du|.T @ |hidden|`` and ``sum_rows |du|``:
    what a gradient's rounding errors are relative to (each term of its sum rounds on its
    own; the sum may cancel), for ``ratiokl.spec.linear_grad_tolerance``. Finite entries
    only; 0 where there are none."""
    du, kept, w, mask = _head_grads(hidden, weight, action_ids, mask, grad_logp, grad_entropy,
                                    bias, temperature, logit_scale, logit_softcap)
    du = np.where(np.isfinite(du), np.abs(du), 0.0)
    products = _products(du, np.abs(kept), np.abs(w), mask, bias is not None)
    return tuple(None if p is None else float(p.max(initial=0.0)) for p in products)
