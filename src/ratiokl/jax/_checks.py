"""Argument validation for ``ratiokl.jax.loss``.

Every check here looks only at shapes, dtypes and Python scalars, so it
works on tracers and adds nothing to a compiled program. The one exception
is :func:`check_active_ids`, the documented host check on concrete inputs
(``check_ids=False`` skips it). Errors name the argument and say how to fix it.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ratiokl.spec import check_action_ids, check_temperatures

__all__ = [
    "LOGIT_DTYPES",
    "Temperature",
    "check_active_ids",
    "check_bool_option",
    "check_ids",
    "check_logits",
    "check_mask",
    "check_ref",
    "check_row_values",
    "check_temperature",
    "poison_bad_temperature",
]

#: Logit dtypes every backend accepts; math is float32 whatever the input.
LOGIT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

Temperature = Union[float, jax.Array]


def _require_array(name: str, value: Any) -> Any:
    """``value`` itself if it is a JAX or NumPy array (dtype not yet converted)."""
    if not isinstance(value, (jax.Array, np.ndarray, jax.core.Tracer)):
        raise TypeError(
            f"`{name}` must be a jax.Array (or a NumPy array); got {type(value).__name__}"
        )
    return value


def _check_lead_shape(name: str, value: jax.Array, lead: Tuple[int, ...]) -> None:
    if tuple(value.shape) != lead:
        raise ValueError(
            f"`{name}` must have the logits' leading shape {list(lead)} (one value per "
            f"token); got {list(value.shape)}"
        )


def check_logits(name: str, logits: Any) -> jax.Array:
    """``logits`` is a float32/float16/bfloat16 array ``[..., V]`` with ``V >= 1``."""
    logits = _require_array(name, logits)
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"`{name}` must be float32, float16 or bfloat16; got {logits.dtype}. "
            f"Cast it, e.g. `{name}.astype(jnp.float32)`"
        )
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"`{name}` must have shape [..., V] with a vocabulary axis V >= 1 last; "
            f"got shape {tuple(logits.shape)}"
        )
    return jnp.asarray(logits)


def check_ids(action_ids: Any, lead: Tuple[int, ...]) -> jax.Array:
    """``action_ids`` is an integer array of the leading shape."""
    ids = _require_array("action_ids", action_ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(
            f"`action_ids` must have an integer dtype (int32 or int64); got {ids.dtype}. "
            "Cast it with `action_ids.astype(jnp.int32)`"
        )
    _check_lead_shape("action_ids", ids, lead)
    return jnp.asarray(ids)


def check_mask(mask: Any, lead: Tuple[int, ...]) -> jax.Array:
    """``mask`` is a bool (or integer 0/1) array of the leading shape; returned as bool."""
    mask = _require_array("mask", mask)
    if mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.integer):
        raise TypeError(
            f"`mask` must be bool (or integer 0/1); got {mask.dtype}. "
            "Pass `mask.astype(bool)` or `mask > 0`"
        )
    _check_lead_shape("mask", mask, lead)
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0


def check_row_values(name: str, values: Any, lead: Tuple[int, ...]) -> jax.Array:
    """A per-token floating array (``old_logps``, ``ref_logps``) of the leading shape."""
    values = _require_array(name, values)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating array (float32 recommended); got {values.dtype}"
        )
    _check_lead_shape(name, values, lead)
    return jnp.asarray(values)


def check_ref(
    ref_logits: Any, ref_logps: Any, policy_shape: Tuple[int, ...]
) -> Tuple[Optional[jax.Array], Optional[jax.Array]]:
    """Exactly one of ``ref_logits`` (``[..., V]``) or ``ref_logps`` (``[...]``) is given."""
    if (ref_logits is None) == (ref_logps is None):
        raise ValueError(
            "pass exactly one of `ref_logits` (reference-model logits [..., V]) and "
            "`ref_logps` (reference log-probs [...]); set the other to None"
        )
    if ref_logps is not None:
        return None, check_row_values("ref_logps", ref_logps, policy_shape[:-1])
    ref = check_logits("ref_logits", ref_logits)
    if tuple(ref.shape) != policy_shape:
        raise ValueError(
            f"`ref_logits` must have the shape of `policy_logits` {list(policy_shape)}; "
            f"got {list(ref.shape)}"
        )
    return ref, None


def check_temperature(temperature: Any, lead: Tuple[int, ...]) -> Temperature:
    """A positive finite Python float, or a floating array of the leading shape (or 0-d).

    An array is not inspected here: its entries are checked on active rows by
    :func:`check_active_ids` (concrete inputs with ``check_ids``; a
    ``checkify`` check when traced) and, checked or not,
    :func:`poison_bad_temperature` makes a bad entry NaN so that its row is
    NaN on every backend.
    """
    if isinstance(temperature, (jax.Array, np.ndarray, jax.core.Tracer)):
        if not jnp.issubdtype(temperature.dtype, jnp.floating):
            raise TypeError(f"`temperature` array must be floating; got {temperature.dtype}")
        if temperature.ndim == 0:
            return jnp.broadcast_to(temperature, lead)
        _check_lead_shape("temperature", temperature, lead)
        return jnp.asarray(temperature)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            "`temperature` must be a Python float or an array of the leading shape; "
            f"got {type(temperature).__name__}"
        )
    value = float(temperature)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"`temperature` must be a positive finite number; got {value}")
    return value


def check_bool_option(name: str, value: Any) -> bool:
    """A static Python bool option (``check_ids``)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a Python bool; got {type(value).__name__}")
    return value


def _is_concrete(*arrays: jax.Array) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def poison_bad_temperature(temperature: jax.Array) -> jax.Array:
    """``temperature`` with every entry outside ``(0, inf)`` replaced by NaN.

    A zero, negative, infinite or NaN temperature has no valid softmax; as NaN
    it poisons its row (outputs and gradient) on every backend, while inactive
    rows replace their temperature with 1 before any arithmetic.
    """
    return jnp.where(_valid_temperature(temperature), temperature, jnp.nan)


def _valid_temperature(temperature: jax.Array) -> jax.Array:
    return (temperature > 0) & (temperature < jnp.inf)


def check_active_ids(ids: jax.Array, mask: jax.Array, vocab_size: int, host_check: bool,
                     temperature: Optional[Temperature] = None) -> bool:
    """Reject active ids outside ``[0, V)`` (and active temperatures outside ``(0, inf)``).

    ``ids``, ``mask`` and an array ``temperature`` have the leading shape.
    Concrete inputs with ``host_check``: one host synchronisation on two
    booleans, then ``ValueError`` naming the first bad position (the messages
    of :func:`ratiokl.spec.check_action_ids` and
    :func:`ratiokl.spec.check_temperatures`). Traced inputs (``jit``,
    ``vmap``): ``checkify.debug_check``s that raise only when the caller
    wraps the function in ``jax.experimental.checkify.checkify``; otherwise
    the backends poison the row with NaN. ``host_check=False`` skips the host
    synchronisation; the traced checks and the NaN poison stay.

    Returns True when the host check ran and passed (every active id is in
    range), False when nothing was verified.
    """
    temp = None if isinstance(temperature, float) else temperature
    arrays = (ids, mask) if temp is None else (ids, mask, temp)
    if _is_concrete(*arrays):
        if not host_check:
            return False
        # Concrete arrays closed over by a jit-traced caller are still checked eagerly.
        with jax.ensure_compile_time_eval():
            flags = [jnp.any(mask & ((ids < 0) | (ids >= vocab_size)))]
            if temp is not None:
                flags.append(jnp.any(mask & ~_valid_temperature(temp)))
            any_bad = np.asarray(jnp.stack(flags))
        if any_bad[0]:
            check_action_ids(np.asarray(ids), np.asarray(mask), vocab_size)
        if any_bad[-1] and temp is not None:
            check_temperatures(np.asarray(temp), np.asarray(mask))
        return True
    _traced_check(mask & ((ids < 0) | (ids >= vocab_size)), ids,
                  f"action_ids[{{}}] = {{}} is outside [0, {vocab_size}) on an active row; "
                  "fix the sampled ids or mark the row inactive in `mask`")
    if temp is not None:
        _traced_check(mask & ~_valid_temperature(temp), temp,
                      "temperature[{}] = {} on an active row; a temperature must be positive "
                      "and finite (e.g. the sampler's 1.0)")
    return False


def _traced_check(bad: jax.Array, values: jax.Array, message: str) -> None:
    """A ``checkify.debug_check`` naming the first ``bad`` position and its value (no-op
    unless checkified). ``message`` has one ``{}`` for the index list, one for the value."""
    flat = jnp.argmax(bad.reshape(-1)) if bad.size else jnp.int32(0)
    pos = jnp.unravel_index(flat, bad.shape) if bad.ndim else ()
    value = values.reshape(-1)[flat] if bad.size else jnp.zeros((), values.dtype)
    index = ", ".join("{}" for _ in pos)
    head, tail = message.split("{}", 1)
    checkify.debug_check(~jnp.any(bad), head + index + tail, *pos, value)
