"""Backend table for ``ratiokl.jax.loss`` and the resolution of ``"auto"``.

A backend module takes flattened, validated inputs and returns flattened
float32 outputs. Every backend module exposes::

    selected_logprobs(logits, ids, mask, temperature, check_ids) -> logp
    ratio_kl(policy, ref, ids, mask, old_logps, ref_logps, kl_code, temperature,
             check_ids) -> (ratio, kl)

with

    logits, policy, ref   [N, V] float32 / float16 / bfloat16 (``ref`` may be None)
    ids                   [N] integer, NOT range-checked (clamp before any read;
                          an active row with an id outside [0, V) is NaN)
    mask                  [N] bool
    old_logps, ref_logps  [N] floating (``ref_logps`` is None exactly when ``ref``
                          is not)
    kl_code               static Python int from ``ratiokl.spec.KL_ESTIMATORS``
    temperature           a positive Python float, or float32 [N] (inactive rows
                          may hold anything, including 0 or NaN)
    check_ids             static Python bool. True: ``loss`` verified on the host
                          that every active id is in [0, V), so the backend may
                          skip poisoning. False: nothing was verified (traced
                          inputs, or ``check_ids=False``); an active row with an
                          out-of-range id must give NaN outputs and NaN gradient.
    logp, ratio, kl       [N] float32

Both functions are differentiable with respect to the policy logits only
(a ``jax.custom_vjp`` with the analytic backward), write the gradient in the
logits' dtype, and keep inactive rows neutral by construction (``logp = 0``,
``ratio = 1``, ``kl = 0``, gradient exactly 0). The host id check and its
``checkify`` counterpart run in ``loss`` before dispatch, never in a backend;
a backend never synchronises with the host.

Backends: ``"native"`` (XLA, runs everywhere) and ``"triton"`` (the shared
Triton kernels launched through ``jax_triton``; GPU only). ``"auto"`` picks
``"triton"`` when JAX's default backend is a GPU and ``jax_triton`` imports,
else ``"native"``. ``"interpret"`` (Triton's CPU interpreter) exists only in
``ratiokl.torch``.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Mapping

import jax

from ratiokl.spec import BACKENDS

__all__ = ["BACKEND_MODULES", "resolve"]

#: Backend name -> module path (imported on first use).
BACKEND_MODULES: Mapping[str, str] = {
    "native": "ratiokl.jax._native",
    "triton": "ratiokl.jax._triton",
}


@functools.lru_cache(maxsize=None)
def _jax_triton_error() -> str:
    """Why ``jax_triton`` cannot run here, or ``""`` when it can."""
    if jax.default_backend() != "gpu":
        return f"JAX's default backend is {jax.default_backend()!r}, not a GPU"
    try:
        # Through the backend's helper: a bare `import jax_triton` empties
        # TRITON_CACHE_DIR, after which every new Triton compile fails.
        importlib.import_module("ratiokl.jax._triton").import_jax_triton()
    except ImportError as err:
        return f"`import jax_triton` failed ({err})"
    return ""


def _resolve_name(backend: str) -> str:
    if backend not in BACKENDS:
        choices = ", ".join(repr(b) for b in BACKENDS if b != "interpret")
        raise ValueError(f"`backend` must be one of {choices}; got {backend!r}")
    if backend == "interpret":
        raise ValueError(
            "`backend='interpret'` (Triton's CPU interpreter) is available only in "
            "ratiokl.torch; in JAX use backend='native' on CPU or 'triton' on a GPU"
        )
    if backend == "auto":
        return "native" if _jax_triton_error() else "triton"
    if backend == "triton":
        reason = _jax_triton_error()
        if reason:
            raise RuntimeError(
                f"backend='triton' cannot run here: {reason}. It needs a CUDA build of "
                "jaxlib and `pip install ratiokl[triton]`; use backend='native' or 'auto'"
            )
    return backend


def resolve(backend: str) -> ModuleType:
    """The backend module for ``backend`` (a static Python string).

    ``"auto"`` never fails for want of a GPU; an explicit backend that
    cannot run here raises ``RuntimeError`` saying why, an unknown name
    ``ValueError``.
    """
    name = _resolve_name(backend)
    try:
        return importlib.import_module(BACKEND_MODULES[name])
    except ImportError as err:
        raise RuntimeError(
            f"backend={name!r} is unavailable: importing {BACKEND_MODULES[name]} failed "
            f"({err}). Use backend='native'"
        ) from err
