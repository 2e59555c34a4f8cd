"""The rollout correction in JAX: the arguments checked, then the framework-neutral
weights of ``ratiokl._core.rollout`` (``ratiokl.spec.rollout`` has the formulas) on JAX's
array adapter: ``jnp`` ops on every backend, which XLA fuses into a few elementwise kernels
and reductions under ``jit``. The options are static Python values; the arrays may be
traced."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._core import rollout as _core
from ratiokl._core.sequences import as_rows
from ratiokl.jax._arrays import XP
from ratiokl.jax._checks import TokenInputs, check_row_values
from ratiokl.spec import RolloutOptions

__all__ = ["correct"]


def correct(mask: jax.Array, lead: Tuple[int, ...], inputs: TokenInputs,
            rollout_logps: jax.Array, opts: RolloutOptions,
            log_ratio_bound: Optional[float]) -> Tuple[TokenInputs, Dict[str, jax.Array]]:
    """``inputs`` with the rollout weight folded into ``importance_weights``, and the
    rollout metrics (``ratiokl._core.rollout.correct``).

    ``mask``: the flattened bool ``[N]`` mask; ``lead``: the leading shape ``[...]``;
    ``opts``: ``spec.rollout_options`` of the call (called only where that is not None,
    i.e. where ``rollout_logps`` is given).
    """
    rollout = check_row_values("rollout_logps", rollout_logps, lead)
    rollout = as_rows(lax.stop_gradient(jnp.asarray(rollout, jnp.float32)), lead)
    return _core.correct(XP, as_rows(mask, lead), inputs, rollout, opts, log_ratio_bound)
