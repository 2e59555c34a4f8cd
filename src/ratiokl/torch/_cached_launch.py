"""Eager CUDA launches from a cached compiled-kernel handle, without Triton's per-call binder.

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run``, which on
every call binds the arguments, specialises each one, builds and hashes a cache
key (``str`` of the options included) and only then launches: on the H200 that
was 22 us for a 6-argument kernel and about 90 us for the forward kernel's 20,
against 12 us from the compiled handle. :class:`CachedLaunch` keys a dict on
the facts Triton specialises a launch on -- per tensor its dtype and whether
its address is 16-byte aligned, per integer whether it is 1, a multiple of 16,
and which integer type holds it, the constexpr and option keywords, the
current device -- and per constexpr parameter its value, whether it is passed by
keyword or by position (a positional one such as the fused kernel's ``V`` is
compiled in: two vocabularies of the same facts are two kernels), so one key
never covers two of Triton's. The first launch of
a key goes through Triton (which compiles, or loads from its cache, and
launches); later ones call the compiled handle's launcher with the arguments in
the kernel's parameter order, as ``JITFunction.run`` itself does (the same call
in Triton 3.6 to 3.9).

Whenever a launch hook is registered (a profiler such as Proton) every launch
takes Triton's own path, so hooks see each one; so does every launch on a Triton
outside the versions ``ratiokl._kernels.triton_compat`` was tested on (which holds
every use of Triton's internals made here).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import torch
import triton

from ratiokl._kernels.triton_compat import (
    IN_RANGE,
    current_device,
    current_stream,
    kernel_params,
    launch_hooked,
    run_compiled,
)

__all__ = ["CachedLaunch", "cached", "specialization_key"]

_Tensor = torch.Tensor
_I32_MIN, _I32_MAX, _U64_MIN = -2**31, 2**31 - 1, 2**63


def _arg_facts(args: Tuple[Any, ...]) -> list:
    """What Triton's specialisation can see of each runtime argument (a superset of it),
    one entry per argument: a tensor's dtype (with ``False`` beside it when its address is
    not 16-byte aligned), an integer's class (1; a multiple of 16; outside int32; from
    2**63: bit flags), a bool's value, a float's type, anything else its type and value.

    One plain loop over ``type()`` (an ``isinstance`` chain and a tuple per argument took
    27 us for the fused kernel's 41 arguments on the CPU, this 7).
    """
    facts = []
    add = facts.append
    for value in args:
        kind = type(value)
        if kind is _Tensor:
            add(value.dtype if not value.data_ptr() & 15 else (value.dtype, False))
        elif kind is int:
            add(1 if value == 1 else (2 if value % 16 == 0 else 0)
                | (0 if _I32_MIN <= value <= _I32_MAX else 4) | (8 if value >= _U64_MIN else 0))
        elif kind is bool:
            add((bool, value))
        elif kind is float:
            add(float)
        elif isinstance(value, _Tensor):  # a subclass (nn.Parameter): as a tensor
            add(value.dtype if not value.data_ptr() & 15 else (value.dtype, False))
        else:
            add((kind, value))  # None, or anything else: its value (unhashable: Triton's path)
    return facts


def specialization_key(device: int, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                       constexprs: FrozenSet[int] = frozenset()) -> Tuple[Any, ...]:
    """The cache key of a launch with ``args`` and ``kwargs`` on CUDA device ``device``;
    ``constexprs``: the positions of ``args`` that are constexpr parameters (keyed by value)."""
    facts = _arg_facts(args)
    for index in constexprs:
        if index < len(args):
            facts[index] = ("constexpr", args[index])
    return device, tuple(facts), tuple(kwargs.items())


class CachedLaunch:
    """``CachedLaunch(kernel)[grid](*args, **kwargs)``: launches like ``kernel[grid](...)``."""

    def __init__(self, kernel: triton.runtime.JITFunction) -> None:
        self.kernel = kernel
        self._params, self._constexprs = kernel_params(kernel)
        self._handles: Dict[Tuple[Any, ...], Tuple[Any, Tuple[str, ...]]] = {}

    def __getitem__(self, grid: Tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _order(self, n_args: int, kwargs: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
        """Where each kernel parameter comes from: a position in ``args`` or a keyword name;
        None when a parameter is missing (a default: left to Triton)."""
        order = []
        for index, name in enumerate(self._params):
            if index < n_args:
                order.append(index)
            elif name in kwargs:
                order.append(name)
            else:
                return None
        return tuple(order)

    def _launch(self, grid: Tuple[int, ...], args: Tuple[Any, ...],
                kwargs: Dict[str, Any]) -> None:
        if not IN_RANGE or launch_hooked():
            self.kernel[grid](*args, **kwargs)
            return
        device = current_device()
        try:
            key = specialization_key(device, args, kwargs, self._constexprs)
            entry = self._handles.get(key)
        except TypeError:  # an unhashable argument: Triton's path
            self.kernel[grid](*args, **kwargs)
            return
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            order = self._order(len(args), kwargs)
            if order is not None:  # the positions first, then these keywords
                self._handles[key] = (compiled, order[len(args):])
            return
        compiled, keywords = entry
        run_compiled(compiled, grid, current_stream(device),
                     (*args, *[kwargs[name] for name in keywords]))


#: ``id(kernel)`` -> its launch (a ``JITFunction`` hashes in Python: its source's key).
_LAUNCHES: Dict[int, CachedLaunch] = {}


def cached(kernel: triton.runtime.JITFunction) -> CachedLaunch:
    """The one :class:`CachedLaunch` of ``kernel`` (made on first use)."""
    launch = _LAUNCHES.get(id(kernel))
    if launch is None or launch.kernel is not kernel:
        launch = _LAUNCHES[id(kernel)] = CachedLaunch(kernel)
    return launch
