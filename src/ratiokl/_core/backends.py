"""The backend table both bindings follow (framework-neutral): which backend names exist,
which binding module provides each, and the shape of the errors when one cannot run.

Each framework's ``_route`` holds one loader per module in :data:`PROVIDERS` (given the
backend name, it imports the binding module on first use and gathers its functions into a
:class:`ratiokl._backend.Backend`; :func:`load`), resolves ``"auto"`` by its own rule (PyTorch: the
tensors' device; JAX: the default backend) and raises these errors:

* an unknown name: ``ValueError`` listing :data:`ratiokl.spec.BACKENDS`
  (:func:`check_name`);
* a backend whose packages are missing, too old or have no device to run on:
  ``RuntimeError("backend=<name> cannot run here: <reason><advice>")`` (:func:`cannot_run`;
  a wrong device for the inputs is a ``ValueError`` of the binding's own);
* a binding module whose import fails: ``RuntimeError("backend=<name> is unavailable:
  importing its module failed (<type>: <message>). Use backend='native'")``
  (:func:`load`).
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple, Type

from ratiokl._backend import Backend
from ratiokl.spec import BACKENDS

__all__ = ["PROVIDERS", "cannot_run", "check_name", "load"]

#: Concrete backend name -> the binding module (``ratiokl.<framework>.<module>``) whose
#: functions run it: ``"native"`` the framework's own ops (any device), ``"triton"`` the
#: shared Triton kernels on a GPU, ``"interpret"`` the same binding with every launch run
#: by Triton's CPU interpreter. ``"auto"`` names one of the first two.
PROVIDERS: Dict[str, str] = {"native": "_native", "triton": "_triton", "interpret": "_triton"}


def check_name(backend: str) -> None:
    """Raise ``ValueError`` unless ``backend`` is one of :data:`ratiokl.spec.BACKENDS`."""
    if backend not in BACKENDS:
        choices = ", ".join(repr(b) for b in BACKENDS)
        raise ValueError(f"`backend` must be one of {choices}; got {backend!r}")


def cannot_run(name: str, reason: str, advice: str) -> RuntimeError:
    """The error for a backend this installation cannot run: ``reason`` says why,
    ``advice`` (starting with its own separator) what to install or use instead."""
    return RuntimeError(f"backend={name!r} cannot run here: {reason}{advice}")


def load(name: str, loaders: Dict[str, Callable[[str], Backend]],
         catch: Tuple[Type[BaseException], ...] = (Exception,)) -> Backend:
    """The :class:`Backend` of the concrete ``name``: the loader of the module
    :data:`PROVIDERS` names, called with ``name``; an exception of ``catch`` (importing the
    binding module) becomes the ``RuntimeError`` saying which backend and what to use."""
    try:
        return loaders[PROVIDERS[name]](name)
    except catch as err:
        raise RuntimeError(
            f"backend={name!r} is unavailable: importing its module failed "
            f"({type(err).__name__}: {err}). Use backend='native'"
        ) from err
