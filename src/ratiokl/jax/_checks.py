"""Argument validation for ``ratiokl.jax.loss``.

Every check here looks only at shapes, dtypes and Python scalars, so it
works on tracers and adds nothing to a compiled program. The one exception
is :class:`ActiveCheck`, the documented host check on concrete inputs
(``check_ids=False`` skips it), read after the call's kernels are queued. Errors name the argument and say how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from ratiokl._core.route import as_rows
from ratiokl.spec import LOGIT_DTYPE_NAMES, check_action_ids, check_temperatures

__all__ = [
    "LOGIT_DTYPES",
    "Normalizer",
    "Temperature",
    "TokenInputs",
    "token_inputs",
    "ActiveCheck",
    "check_bool_option",
    "check_ids",
    "check_logits",
    "check_mask",
    "check_ref",
    "check_row_values",
    "check_temperature",
    "kernel_rows",
    "poison_bad_temperature",
]

#: ``spec.LOGIT_DTYPE_NAMES`` as JAX dtypes.
LOGIT_DTYPES = tuple(jnp.dtype(name) for name in LOGIT_DTYPE_NAMES)

Temperature = Union[float, jax.Array]
Normalizer = Union[None, float, jax.Array]


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
    """``action_ids`` is an int32 or int64 array of the leading shape."""
    ids = _require_array("action_ids", action_ids)
    if ids.dtype not in (jnp.int32, jnp.int64):
        raise TypeError(
            f"`action_ids` must be int32 or int64; got {ids.dtype}. "
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
    :class:`ActiveCheck` (concrete inputs with ``check_ids``; a
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


class ActiveCheck:
    """The check of active ids (outside ``[0, V)``) and temperatures (outside ``(0, inf)``).

    ``ids``, ``mask`` and an array ``temperature`` have the leading shape.
    Concrete inputs with ``host_check``: the two booleans are queued at
    construction (JAX dispatches asynchronously) and read by
    :meth:`raise_if_bad` after the caller has queued its kernels, so the
    device never waits for the host; a bad entry raises ``ValueError`` naming
    the first bad position (the messages of :func:`ratiokl.spec.check_action_ids`
    and :func:`ratiokl.spec.check_temperatures`). Traced inputs (``jit``,
    ``vmap``): ``checkify.debug_check``s that raise only when the caller wraps
    the function in ``jax.experimental.checkify.checkify``; otherwise the
    backends poison the row with NaN. ``host_check=False`` skips the host
    read; the traced checks and the NaN poison stay. ``vocab_size`` None
    checks the temperature only (sharded logits check their ids globally).
    """

    def __init__(self, ids: jax.Array, mask: jax.Array, vocab_size: Optional[int],
                 host_check: bool, temperature: Optional[Temperature] = None) -> None:
        temp = None if isinstance(temperature, float) else temperature
        self._args = (ids, mask, vocab_size, temp)
        self._flags = None
        arrays = (ids, mask) if temp is None else (ids, mask, temp)
        if _is_concrete(*arrays):
            if host_check:
                # Concrete arrays closed over by a jit-traced caller are checked eagerly too.
                with jax.ensure_compile_time_eval():
                    self._flags = jnp.stack(_bad_flags(*self._args))
            return
        if vocab_size is not None:
            _traced_check(mask & ((ids < 0) | (ids >= vocab_size)), ids,
                          f"action_ids[{{}}] = {{}} is outside [0, {vocab_size}) on an active "
                          "row; fix the sampled ids or mark the row inactive in `mask`")
        if temp is not None:
            _traced_check(mask & ~_valid_temperature(temp), temp,
                          "temperature[{}] = {} on an active row; a temperature must be "
                          "positive and finite (e.g. the sampler's 1.0)")

    def raise_if_bad(self) -> None:
        """Raise ``ValueError`` if the host check found a bad entry (else return)."""
        if self._flags is None:
            return
        bad = np.asarray(self._flags)
        ids, mask, vocab_size, temp = self._args
        if vocab_size is not None and bad[0]:
            check_action_ids(np.asarray(ids), np.asarray(mask), vocab_size)
        if temp is not None and bad[-1]:
            check_temperatures(np.asarray(temp), np.asarray(mask))


def _bad_flags(ids, mask, vocab_size, temp):
    flags = [] if vocab_size is None else [jnp.any(mask & ((ids < 0) | (ids >= vocab_size)))]
    if temp is not None:
        flags.append(jnp.any(mask & ~_valid_temperature(temp)))
    return flags or [jnp.zeros((), bool)]


def _traced_check(bad: jax.Array, values: jax.Array, message: str) -> None:
    """A ``checkify.debug_check`` naming the first ``bad`` position and its value (no-op
    unless checkified). ``message`` has one ``{}`` for the index list, one for the value."""
    flat = jnp.argmax(bad.reshape(-1)) if bad.size else jnp.int32(0)
    pos = jnp.unravel_index(flat, bad.shape) if bad.ndim else ()
    value = values.reshape(-1)[flat] if bad.size else jnp.zeros((), values.dtype)
    index = ", ".join("{}" for _ in pos)
    head, tail = message.split("{}", 1)
    checkify.debug_check(~jnp.any(bad), head + index + tail, *pos, value)


# --- policy_loss's per-token inputs -------------------------------------------------------


_ARRAYS = (jax.Array, np.ndarray, jax.core.Tracer)


@dataclass(frozen=True)
class TokenInputs:
    """``policy_loss``'s per-token inputs, validated, under stop-gradient, laid out ``[R, T]``."""

    old_logps: Optional[jax.Array]  # float32; None: on-policy
    advantages: jax.Array  # float32, broadcast over tokens
    segment_ids: Optional[jax.Array]  # integer
    importance_weights: Optional[jax.Array]  # float32
    loss_normalizer: Normalizer
    kl_entropy_normalizer: Normalizer = None  # the denominator of kl_agg / entropy_agg terms


def _floats(x: jax.Array, lead: Tuple[int, ...]) -> jax.Array:
    return as_rows(lax.stop_gradient(jnp.asarray(x, jnp.float32)), lead)


def _check_advantages(advantages: Any, lead: Tuple[int, ...]) -> jax.Array:
    """Per token ``[...]``, or per sequence ``lead[:-1]`` / ``lead[:-1] + [1]``; ``[R, T]`` out."""
    if not isinstance(advantages, _ARRAYS) or not jnp.issubdtype(advantages.dtype, jnp.floating):
        got = (advantages.dtype if isinstance(advantages, _ARRAYS)
               else type(advantages).__name__)
        raise TypeError(f"`advantages` must be a floating jax.Array (float32 recommended); "
                        f"got {got}. Cast it with `advantages.astype(jnp.float32)`")
    shape = tuple(advantages.shape)
    if shape != lead and not (lead and shape in (lead[:-1], lead[:-1] + (1,))):
        raise ValueError(
            f"`advantages` must have shape {list(lead)} (per token) or {list(lead[:-1])} "
            f"(per sequence); got {list(shape)}"
        )
    adv = jnp.asarray(advantages)
    if shape != lead:
        adv = jnp.broadcast_to(adv.reshape(lead[:-1] + (1,)), lead)
    return _floats(adv, lead)


def _check_normalizer(value: Any, name: str = "loss_normalizer") -> Normalizer:
    """None, a positive finite Python number, or a 0-d floating array (not inspected)."""
    if value is None:
        return None
    if isinstance(value, _ARRAYS):
        if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(f"`{name}` array must be a 0-d floating array")
        return lax.stop_gradient(jnp.asarray(value, jnp.float32))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be None, a Python number or a 0-d array")
    if not (math.isfinite(float(value)) and float(value) > 0.0):
        raise ValueError(f"`{name}` must be a positive finite number; got {value}")
    return float(value)


def _check_segments(segment_ids: Any, lead: Tuple[int, ...]) -> Optional[jax.Array]:
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, _ARRAYS) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError("`segment_ids` must be an integer jax.Array (e.g. int32)")
    if tuple(segment_ids.shape) != lead:
        raise ValueError(
            f"`segment_ids` must have the leading shape {list(lead)}; "
            f"got {list(segment_ids.shape)}"
        )
    return as_rows(jnp.asarray(segment_ids), lead)


def token_inputs(
    lead: Tuple[int, ...],
    old_logps: Any,
    advantages: Any,
    segment_ids: Any,
    importance_weights: Any,
    loss_normalizer: Any,
    kl_entropy_normalizer: Any = None,
) -> TokenInputs:
    """Validate ``policy_loss``'s per-token arguments (errors name the argument);
    ``old_logps`` None (on-policy) stays None."""
    old = None if old_logps is None else check_row_values("old_logps", old_logps, lead)
    weights = None
    if importance_weights is not None:
        weights = check_row_values("importance_weights", importance_weights, lead)
        weights = _floats(weights, lead)
    return TokenInputs(
        old_logps=None if old is None else _floats(old, lead),
        advantages=_check_advantages(advantages, lead),
        segment_ids=_check_segments(segment_ids, lead),
        importance_weights=weights,
        loss_normalizer=_check_normalizer(loss_normalizer),
        kl_entropy_normalizer=_check_normalizer(kl_entropy_normalizer, "kl_entropy_normalizer"),
    )


def kernel_rows(ids: jax.Array, mask: jax.Array, temperature: Temperature):
    """Kernel-ready ids (int32/int64), bool mask and float32 temperature (``[1]`` or ``[N]``).

    The kernels read the bool mask as it is (one byte per row, as torch's), so
    no conversion runs on the device.
    """
    if ids.dtype not in (jnp.int32, jnp.int64):
        ids = ids.astype(jnp.int32)
    if isinstance(temperature, (int, float)):
        temp = jnp.full((1,), temperature, dtype=jnp.float32)
    else:
        temp = jnp.asarray(temperature, dtype=jnp.float32)
    return ids, mask.astype(jnp.bool_), temp
