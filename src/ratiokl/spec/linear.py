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
from typing import Any, Callable, Optional, Sequence, Tuple

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
    "LogitTransform",
    "check_chunk_rows",
    "check_head_shapes",
    "linear_grad_magnitudes",
    "linear_logits",
    "linear_selected_logprobs",
    "linear_selected_logprobs_grad",
    "logit_transform",
    "transform_logits",
    "transform_slope",
    "vocab_blocks",
]


@dataclass(frozen=True)
class LogitTransform:
    """The validated logit options (:func:`logit_transform`): ``x = softcap(u * scale)``."""

    scale: float = 1.0  # logit_scale, positive and finite
    softcap: Optional[float] = None  # logit_softcap, positive and finite, or None (off)

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


def logit_transform(logit_scale: object = 1.0,
                    logit_softcap: object = None) -> LogitTransform:
    """The checked ``logit_scale`` and ``logit_softcap`` (``ValueError`` / ``TypeError``
    naming the argument): static Python numbers, as a model's config holds them."""
    scale = _positive("logit_scale", logit_scale, "the model's logit multiplier, e.g. 0.0625")
    softcap = None if logit_softcap is None else _positive(
        "logit_softcap", logit_softcap, "e.g. Gemma 2's final_logit_softcapping 30.0; None: off")
    return LogitTransform(scale, softcap)


def check_chunk_rows(chunk_rows: object) -> int:
    """``chunk_rows``, a positive Python int (``ValueError`` naming it otherwise)."""
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"`chunk_rows` must be a positive int; got {chunk_rows!r}")
    return chunk_rows


def check_head_shapes(hidden_shape: Sequence[int], hidden_dtype: str,
                      weight_shape: Sequence[int], weight_dtype: str,
                      bias_shape: Optional[Sequence[int]] = None,
                      bias_dtype: Optional[str] = None) -> Tuple[int, ...]:
    """The leading shape ``[...]`` of ``hidden [..., H]``, after checking ``weight [V, H]``
    and ``bias [V]`` against it (one float dtype for all three; dtypes by name, e.g.
    ``"bfloat16"``). Raises ``ValueError`` (shapes) or ``TypeError`` (dtypes) naming the
    argument."""
    width = hidden_shape[-1]
    if len(weight_shape) != 2 or weight_shape[1] != width:
        raise ValueError(
            f"`weight` must be the lm_head weight [V, H] with H = hidden.shape[-1] = {width}; "
            f"got shape {list(weight_shape)}"
        )
    if weight_dtype != hidden_dtype:
        raise TypeError(
            f"`hidden` ({hidden_dtype}) and `weight` ({weight_dtype}) must share a dtype: the "
            "logits are their product; cast one, e.g. `hidden.to(weight.dtype)`"
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
