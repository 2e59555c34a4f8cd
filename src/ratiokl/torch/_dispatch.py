"""Backend table for ``ratiokl.torch``: a backend name -> the module that runs it.

Backend module interface
------------------------
``ratiokl.torch.loss`` validates the arguments, flattens the leading shape
``[...]`` to ``N`` rows, runs the host id check (unless ``check_ids=False``)
and then calls one of these on the flattened tensors::

    selected_logprobs(logits, ids, mask, temperature, check_ids) -> logp
    ratio_kl(policy, ref, ids, mask, old_logps, ref_logps, kl_code, temperature,
             check_ids) -> (ratio, kl)

with

    logits, policy  [N, V] float32 | float16 | bfloat16, any strides
                    (a view of the caller's tensor where possible)
    ref             [N, V] like ``policy``, or None when ``ref_logps`` is given;
                    detached (no gradient may reach it)
    ids             [N] any integer dtype, *not* range-checked on inactive rows
    mask            [N] bool (True = active)
    old_logps       [N] float32, detached
    ref_logps       [N] float32, detached, or None when ``ref`` is given
    kl_code         int from ``ratiokl.spec.KL_ESTIMATORS`` (1: k1, 2: k2, 3: k3)
    temperature     a positive Python float, or a float32 [N] tensor (detached;
                    inactive rows may hold anything, including 0 or NaN)
    check_ids       True: the caller has verified every active id is in
                    [0, V), so the backend may skip poisoning. False: no check
                    was made (CUDA graphs / torch.compile); an active row with
                    an out-of-range id must give NaN outputs and NaN gradient.
    logp, ratio, kl [N] float32

Both functions are differentiable with respect to ``logits``/``policy`` only,
write that gradient in the logits' dtype, never read out of bounds (ids are
clamped before any gather), and keep inactive rows neutral by construction:
``logp = 0``, ``ratio = 1``, ``kl = 0``, gradient exactly 0, whatever the row
holds. Neither may synchronise with the host.

Backends: ``"native"`` (``_native``, framework ops, any device), ``"triton"``
(``_triton`` on CUDA tensors) and ``"interpret"`` (the same ``_triton`` module
on CPU tensors, through Triton's interpreter). ``"auto"`` picks ``"triton"``
for CUDA tensors when Triton is installed, else ``"native"``.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from ratiokl.spec import BACKENDS

__all__ = ["resolve"]

def _import_native() -> ModuleType:
    from ratiokl.torch import _native

    return _native


def _import_triton() -> ModuleType:
    from ratiokl.torch import _triton

    return _triton


#: Backend name -> loader of the module implementing the interface above. Plain
#: import statements (not importlib) so that torch.compile traces through them.
_LOADERS = {
    "native": _import_native,
    "triton": _import_triton,
    "interpret": _import_triton,
}

#: Whether the ``triton`` package is installed (found, not imported: importing
#: it is left to the backend module, so ``import ratiokl.torch`` stays light).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _backend_name(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device``; raises if it cannot run there."""
    if backend not in BACKENDS:
        choices = ", ".join(repr(b) for b in BACKENDS)
        raise ValueError(f"`backend` must be one of {choices}; got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and _HAS_TRITON else "native"
    if backend == "triton" and device.type != "cuda":
        raise ValueError(
            f"backend='triton' needs CUDA tensors; the inputs are on {device}. Use "
            "backend='native' (or 'interpret' to run the Triton kernels on the CPU)"
        )
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(
            f"backend='interpret' runs Triton's CPU interpreter and needs CPU tensors; "
            f"the inputs are on {device}. Use backend='triton' or 'native'"
        )
    if backend in ("triton", "interpret") and not _HAS_TRITON:
        raise RuntimeError(
            f"backend={backend!r} needs the `triton` package, which is not installed. "
            "Install `ratiokl[triton]` or use backend='native'"
        )
    return backend


def _load(name: str) -> ModuleType:
    try:
        return _LOADERS[name]()
    except Exception as err:  # any import failure: say which backend and what to use
        raise RuntimeError(
            f"backend={name!r} is unavailable: importing its module failed "
            f"({type(err).__name__}: {err}). Use backend='native'"
        ) from err


def resolve(backend: str, device: torch.device) -> ModuleType:
    """The backend module for ``backend`` (``"auto"`` resolved) on tensors on ``device``."""
    return _load(_backend_name(backend, device))
