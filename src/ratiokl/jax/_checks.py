"""Argument validation for ``ratiokl.jax.loss``.

The shape and dtype rules are :mod:`ratiokl._core.checks`, bound here to JAX's adapter:
they look only at shapes, dtypes and Python scalars, so they work on tracers and add
nothing to a compiled program. JAX's own: :class:`ActiveCheck`, the documented host check
on concrete inputs (``check_ids=False`` skips it; a ``checkify`` check when traced), read
after the call's kernels are queued, and :func:`kernel_rows`.
"""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ratiokl._core import checks
from ratiokl._core.checks import TokenInputs
from ratiokl.jax._arrays import XP
from ratiokl.spec import check_action_ids, check_temperatures

__all__ = ["ActiveCheck", "check_ids", "check_logits", "check_mask",
           "check_ref", "check_row_values", "check_temperature", "float64_backend",
           "kernel_rows", "LOGIT_DTYPES", "Normalizer", "poison_bad_temperature",
           "Temperature", "token_inputs", "TokenInputs"]

#: ``spec.LOGIT_DTYPE_NAMES`` as JAX dtypes.
LOGIT_DTYPES = XP.logit_dtypes

Temperature = Union[float, jax.Array]
Normalizer = Union[None, float, jax.Array]

# The shape and dtype rules, in JAX's words: NumPy arrays in, jax.Arrays out.
(check_logits, check_ids, check_mask, check_row_values, check_ref, check_temperature,
 float64_backend, poison_bad_temperature, token_inputs, _bad_rows) = checks.bind(XP)


def _is_concrete(*arrays: jax.Array) -> bool:
    return not any(isinstance(a, jax.core.Tracer) for a in arrays)


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
                    flags = [jnp.any(b) for b in _bad_rows(*self._args).values()]
                    self._flags = jnp.stack(flags or [jnp.zeros((), bool)])
            return
        bad = _bad_rows(*self._args)
        if "action_ids" in bad:
            _traced_check(bad["action_ids"], ids,
                          f"action_ids[{{}}] = {{}} is outside [0, {vocab_size}) on an active "
                          "row; fix the sampled ids or mark the row inactive in `mask`")
        if "temperature" in bad:
            _traced_check(bad["temperature"], temp,
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


def _traced_check(bad: jax.Array, values: jax.Array, message: str) -> None:
    """A ``checkify.debug_check`` naming the first ``bad`` position and its value (no-op
    unless checkified). ``message`` has one ``{}`` for the index list, one for the value."""
    flat = jnp.argmax(bad.reshape(-1)) if bad.size else jnp.int32(0)
    pos = jnp.unravel_index(flat, bad.shape) if bad.ndim else ()
    value = values.reshape(-1)[flat] if bad.size else jnp.zeros((), values.dtype)
    index = ", ".join("{}" for _ in pos)
    head, tail = message.split("{}", 1)
    checkify.debug_check(~jnp.any(bad), head + index + tail, *pos, value)


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
