"""Argument validation written once for PyTorch and JAX: the shape and dtype rules.

Every check here looks only at shapes, dtypes and Python scalars, so it costs no device
synchronisation and traces under ``torch.compile`` and ``jax.jit`` alike. Errors name
the argument and say how to fix it, in the framework's words. The checks that read
array values (the active ids and temperatures, on the host or traced) are each
framework's own (``ratiokl.<framework>._checks``).

``xp`` is the framework's array adapter (:mod:`ratiokl._core`); for validation it also
answers what kind of array a value is: ``is_array(value)`` (JAX also takes NumPy arrays and
tracers), ``as_array(x)`` (the framework's own array), ``is_floating`` / ``is_integer``
(bool excluded) / ``is_bool`` of a dtype, ``logit_dtypes`` (and ``wide_dtype``, float64,
which only the native backend takes), ``id_dtypes`` and their names
``id_dtype_names``; and the words: ``array_type`` (``"torch.Tensor"``), ``any_array`` (how
the "must be" error says it), ``noun`` (``"tensor"`` / ``"array"``) and ``casts``, the
fix's format for ``"float"``, ``"ids"`` and ``"bool"`` (``"{}.bool()"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from ratiokl._core.rows import bad_ids
from ratiokl._core.sequences import as_rows

__all__ = ["Rules", "TokenInputs", "bad_rows", "bind", "check_ids", "check_logits", "check_mask",
           "check_ref", "check_row_values", "check_temperature", "float64_backend",
           "poison_bad_temperature", "token_inputs", "valid_temperature"]

Shape = Tuple[int, ...]


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _require(xp, name: str, value: Any):
    if not xp.is_array(value):
        raise TypeError(f"`{name}` must be {xp.any_array}; got {type(value).__name__}")
    return value


def _check_lead_shape(name: str, value, lead: Shape) -> None:
    if tuple(value.shape) != lead:
        raise ValueError(
            f"`{name}` must have the logits' leading shape {list(lead)} (one value per "
            f"token); got {list(value.shape)}"
        )


def check_logits(xp, name: str, logits: Any, float64: bool = False):
    """``logits`` is a float32/float16/bfloat16 array ``[..., V]`` with ``V >= 1``; with
    ``float64`` (the logits ops) float64 too, which :func:`float64_backend` then keeps to
    the native backend."""
    logits = _require(xp, name, logits)
    if logits.dtype not in xp.logit_dtypes and not (float64 and logits.dtype == xp.wide_dtype):
        also = " (or float64, on backend='native')" if float64 else ""
        raise TypeError(
            f"`{name}` must be float32, float16 or bfloat16{also}; got {logits.dtype}. "
            f"Cast it, e.g. `{xp.casts['float'].format(name)}`"
        )
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"`{name}` must have shape [..., V] with a vocabulary axis V >= 1 last; "
            f"got shape {tuple(logits.shape)}"
        )
    return xp.as_array(logits)


def check_ids(xp, action_ids: Any, lead: Shape):
    """``action_ids`` is an int32 or int64 array of the leading shape."""
    ids = _require(xp, "action_ids", action_ids)
    if ids.dtype not in xp.id_dtypes:
        raise TypeError(
            f"`action_ids` must be {' or '.join(xp.id_dtype_names)}; got {ids.dtype}. "
            f"Cast it with `{xp.casts['ids'].format('action_ids')}`"
        )
    _check_lead_shape("action_ids", ids, lead)
    return xp.as_array(ids)


def check_mask(xp, mask: Any, lead: Shape):
    """``mask`` is a bool (or integer 0/1) array of the leading shape; returned as bool."""
    mask = _require(xp, "mask", mask)
    if not (xp.is_bool(mask.dtype) or xp.is_integer(mask.dtype)):
        raise TypeError(
            f"`mask` must be bool (or integer 0/1); got {mask.dtype}. "
            f"Pass `{xp.casts['bool'].format('mask')}` or `mask > 0`"
        )
    _check_lead_shape("mask", mask, lead)
    mask = xp.as_array(mask)
    return mask if xp.is_bool(mask.dtype) else mask != 0


def check_row_values(xp, name: str, values: Any, lead: Shape):
    """A per-token floating array (``old_logps``, ``ref_logps``) of the leading shape."""
    values = _require(xp, name, values)
    if not xp.is_floating(values.dtype):
        raise TypeError(
            f"`{name}` must be a floating {xp.noun} (float32 recommended); got {values.dtype}"
        )
    _check_lead_shape(name, values, lead)
    return xp.as_array(values)


def check_ref(xp, ref_logits: Any, ref_logps: Any, policy_shape: Shape):
    """Exactly one of ``ref_logits`` (the policy's shape ``[..., V]``) and ``ref_logps``
    (``[...]``); returns ``(ref_logits, ref_logps)``, the one not given None."""
    if (ref_logits is None) == (ref_logps is None):
        raise ValueError(
            "pass exactly one of `ref_logits` (reference-model logits [..., V]) and "
            "`ref_logps` (reference log-probs [...]); set the other to None"
        )
    if ref_logps is not None:
        return None, check_row_values(xp, "ref_logps", ref_logps, tuple(policy_shape[:-1]))
    ref = check_logits(xp, "ref_logits", ref_logits, float64=True)
    if tuple(ref.shape) != tuple(policy_shape):
        raise ValueError(
            f"`ref_logits` must have the shape of `policy_logits` {list(policy_shape)}; "
            f"got {list(ref.shape)}"
        )
    return ref, None


def float64_backend(xp, name: str, requested: str, sharded: Optional[str] = None,
                    **logits: Any) -> str:
    """The concrete backend for ``logits`` (by argument name; None skipped) given ``name``,
    the one ``requested`` resolved to: float64 logits run on ``"native"`` (in float64),
    which ``"auto"`` picks for them; an explicit Triton backend, or sharded logits
    (``sharded``: the call's ``vocab_group`` / ``vocab_axis`` keyword, None when not
    sharded), raise ``TypeError`` naming the argument (both compute in float32)."""
    wide = [arg for arg, x in logits.items() if x is not None and x.dtype == xp.wide_dtype]
    if not wide:
        return name
    cast = xp.casts["float"].format(wide[0])
    if sharded is not None:
        raise TypeError(
            f"`{wide[0]}` is float64, which `{sharded}` does not take: the vocabulary-"
            f"parallel path computes in float32. Cast it, e.g. `{cast}`, or pass the "
            f"unsharded logits with backend='native' (float64 math)"
        )
    if name == "native":
        return name
    if requested == "auto":
        return "native"
    raise TypeError(
        f"`{wide[0]}` is float64, which backend={name!r} does not take: its Triton kernels "
        f"compute in float32. Pass backend='native' (float64 math, e.g. for gradcheck) or "
        f"cast it, e.g. `{cast}`"
    )


def _positive_finite(name: str, value) -> None:
    # Comparisons, not math.isfinite: they also trace under torch.compile(dynamic=True).
    if not 0.0 < float(value) < math.inf:
        raise ValueError(f"`{name}` must be a positive finite number; got {value}")


def _python_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def check_temperature(xp, temperature: Any, lead: Shape):
    """A positive finite Python float, or a floating array of the leading shape (or 0-d,
    broadcast to it). An array is not inspected here (that would synchronise): the
    framework's ``ActiveCheck`` checks its active entries and, checked or not,
    :func:`poison_bad_temperature` makes a bad entry NaN, its row NaN on every backend."""
    if xp.is_array(temperature):
        if not xp.is_floating(temperature.dtype):
            raise TypeError(f"`temperature` {xp.noun} must be floating; got {temperature.dtype}")
        if temperature.ndim == 0:
            return xp.broadcast_to(temperature, lead)
        _check_lead_shape("temperature", temperature, lead)
        return xp.as_array(temperature)
    if not _python_number(temperature):
        raise TypeError(
            f"`temperature` must be a Python float or {_a(xp.noun)} of the leading shape; "
            f"got {type(temperature).__name__}"
        )
    value = float(temperature)
    _positive_finite("temperature", value)
    return value


def valid_temperature(temperature):
    """Bool: the entries of a temperature array inside ``(0, inf)``."""
    return (temperature > 0) & (temperature < math.inf)


def poison_bad_temperature(xp, temperature):
    """``temperature`` with every entry outside ``(0, inf)`` replaced by NaN (no sync).

    A zero, negative, infinite or NaN temperature has no valid softmax; as NaN it poisons
    its row (outputs and gradient) on every backend, while inactive rows replace their
    temperature with 1 before any arithmetic.
    """
    return xp.where(valid_temperature(temperature), temperature, math.nan)


def bad_rows(xp, ids, mask, vocab_size: Optional[int], temperature) -> Dict[str, Any]:
    """``{argument: bool rows}`` of the active rows whose id is outside ``[0, vocab_size)``
    (``vocab_size`` None: not asked) or whose temperature (an array) is bad."""
    bad = {}
    if vocab_size is not None:
        bad["action_ids"] = bad_ids(ids, mask, vocab_size)
    if xp.is_array(temperature):
        bad["temperature"] = mask & ~valid_temperature(temperature)
    return bad


# --- policy_loss's per-token inputs -------------------------------------------------------


@dataclass(frozen=True)
class TokenInputs:
    """``policy_loss``'s per-token inputs, validated, outside the gradient (detached /
    under stop-gradient), laid out ``[R, T]``; "float32" below is the compute dtype
    (float64 for float64 logits or log-probs)."""

    old_logps: Optional[Any]  # float32; None: on-policy
    advantages: Any  # float32, broadcast over tokens
    segment_ids: Optional[Any]  # integer
    importance_weights: Optional[Any]  # float32
    loss_normalizer: Any  # None, a Python float or a 0-d float32 array
    kl_entropy_normalizer: Any = None  # the denominator of kl_agg / entropy_agg terms
    sequence_advantages: Any = None  # float32 [R] as given per sequence; None: per token
    rollout_logps: Any = None  # float32; None: not given (no rollout correction)


def _floats(xp, x):
    """``x`` in the compute dtype (``xp.as_float``: float32, or float64) outside the
    gradient."""
    return xp.stop_gradient(xp.as_float(xp.as_array(x)))


def _check_advantages(xp, advantages: Any, lead: Shape):
    """Per token ``[...]``, or per sequence ``lead[:-1]`` / ``lead[:-1] + [1]``; out
    ``([R, T], [R] or None)``: the advantages per token (per sequence: broadcast over the
    tokens, a stride-0 view in PyTorch), and those given per sequence as they came."""
    if not (xp.is_array(advantages) and xp.is_floating(advantages.dtype)):
        got = advantages.dtype if xp.is_array(advantages) else type(advantages).__name__
        raise TypeError(f"`advantages` must be a floating {xp.array_type} (float32 "
                        f"recommended); got {got}. Cast it with "
                        f"`{xp.casts['float'].format('advantages')}`")
    shape = tuple(advantages.shape)
    if shape != lead and not (lead and shape in (lead[:-1], lead[:-1] + (1,))):
        raise ValueError(
            f"`advantages` must have shape {list(lead)} (per token) or {list(lead[:-1])} "
            f"(per sequence); got {list(shape)}"
        )
    adv = _floats(xp, advantages)
    if shape == lead:
        return as_rows(adv, lead), None
    return as_rows(xp.broadcast_to(adv.reshape(lead[:-1] + (1,)), lead), lead), adv.reshape(-1)


def _check_normalizer(xp, value: Any, name: str):
    """None, a positive finite Python number, or a 0-d floating array (not inspected)."""
    if value is None:
        return None
    if xp.is_array(value):
        if value.ndim != 0 or not xp.is_floating(value.dtype):
            raise ValueError(f"`{name}` {xp.noun} must be a 0-d floating {xp.noun}")
        return _floats(xp, value)
    if not _python_number(value):
        raise TypeError(f"`{name}` must be None, a Python number or a 0-d {xp.noun}")
    _positive_finite(name, value)
    return float(value)


def _check_segments(xp, segment_ids: Any, lead: Shape):
    if segment_ids is None:
        return None
    if not (xp.is_array(segment_ids) and xp.is_integer(segment_ids.dtype)):
        raise TypeError(f"`segment_ids` must be an integer {xp.array_type} (e.g. int32)")
    if tuple(segment_ids.shape) != lead:
        raise ValueError(
            f"`segment_ids` must have the leading shape {list(lead)}; "
            f"got {list(segment_ids.shape)}"
        )
    return as_rows(xp.as_array(segment_ids), lead)


def _row_floats(xp, name: str, values: Any, lead: Shape):
    """A per-token argument checked, as ``[R, T]`` in the compute dtype outside the gradient;
    None stays."""
    if values is None:
        return None
    return as_rows(_floats(xp, check_row_values(xp, name, values, lead)), lead)


def token_inputs(xp, lead: Shape, old_logps: Any, advantages: Any, segment_ids: Any,
                 importance_weights: Any, loss_normalizer: Any,
                 kl_entropy_normalizer: Any = None, rollout_logps: Any = None) -> TokenInputs:
    """Validate ``policy_loss``'s per-token arguments (errors name the argument);
    ``old_logps`` None (on-policy) and ``rollout_logps`` None stay None."""
    old = _row_floats(xp, "old_logps", old_logps, lead)
    weights = _row_floats(xp, "importance_weights", importance_weights, lead)
    adv, sequence_adv = _check_advantages(xp, advantages, lead)
    return TokenInputs(
        old_logps=old,
        advantages=adv,
        segment_ids=_check_segments(xp, segment_ids, lead),
        importance_weights=weights,
        loss_normalizer=_check_normalizer(xp, loss_normalizer, "loss_normalizer"),
        kl_entropy_normalizer=_check_normalizer(xp, kl_entropy_normalizer,
                                                "kl_entropy_normalizer"),
        sequence_advantages=sequence_adv,
        rollout_logps=_row_floats(xp, "rollout_logps", rollout_logps, lead),
    )


class Rules(NamedTuple):
    """The rules above bound to one framework's adapter (:func:`bind`)."""

    check_logits: Callable
    check_ids: Callable
    check_mask: Callable
    check_row_values: Callable
    check_ref: Callable
    check_temperature: Callable
    float64_backend: Callable
    poison_bad_temperature: Callable
    token_inputs: Callable
    bad_rows: Callable


def bind(xp) -> Rules:
    """:class:`Rules` taking ``xp`` first, e.g. ``bind(XP).check_ids(action_ids, lead)``."""
    return Rules(*(partial(globals()[name], xp) for name in Rules._fields))

