"""Interpreter twins of the ``@triton.jit`` kernels, for CPU tensors in any process.

``TRITON_INTERPRET`` is read when a kernel is decorated (and when
``triton.language`` is imported), so a process that also launches the
kernels on CUDA cannot flip it. Instead, a twin re-binds the kernel's very
Python function to a copy of its module globals in which

* every ``@triton.jit`` helper of ours is itself a twin (recursively), and
* ``tl`` (``triton.language``) is a view whose ``@triton.jit`` library
  functions (``tl.max``, ``tl.sum``, ...) are interpreted in their own
  module, where the combine functions they pass to ``tl.reduce`` keep the
  identity that the interpreter's fast NumPy reductions look for,

* ``INTERPRETED`` (``numerics``), where present, is True,

and wraps it in Triton's ``InterpretedFunction``. The twin launches like the
kernel (``twin[grid](...)``) and runs the same source through the interpreter.

One fix to the interpreter itself (``triton_compat``, where every use of Triton's
internals lives, with the version range they were tested on): its
comparisons return handles typed like their operands instead of ``int1``; from
Triton 3.7 on, broadcasting such a scalar (``tl.load(mask_ptr + row) != 0``) into
a vector mask then gives ``int32`` data, and every masked load fails with "mask has
unsupported dtype". The compiled kernels never see this: their comparisons are
``int1`` in the compiler. And one for NumPy >= 2.4 under Triton 3.6
(``triton_compat`` too): the interpreter turns a scalar into a Python
int with ``int(array)`` on a one-element ``[1]`` array, which NumPy 2.4 refuses (so
every ``range(n)`` over a tensor bound failed); Triton 3.9 squeezes first, as this does.
"""

import contextlib
import types
import warnings
from typing import Dict, Iterator

import numpy as np
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from ratiokl._kernels.triton_compat import Twin, patch_interpreter

__all__ = ["interpreted", "quiet"]

#: NumPy's warning when Triton 3.6's interpreter converts a one-element array to a scalar.
_NDIM_CONVERSION = "Conversion of an array with ndim"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Keep the interpreter's NumPy noise out of the caller's warnings, for a launch of a
    twin: NaN / inf rows are data, not accidents, and Triton 3.6's interpreter turns
    ``[1]``-arrays into scalars, which NumPy >= 2 deprecates."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NDIM_CONVERSION, category=DeprecationWarning)
        yield

#: id(JITFunction) -> its twin; registered before a twin's globals are filled (cycles).
_TWINS: Dict[int, InterpretedFunction] = {}
#: Name under which a twin's globals keep the real ``triton.language``: the
#: interpreter patches its builtins there for the duration of a launch.
_REAL_TL = "_ratiokl_real_triton_language"


class _LanguageView(types.ModuleType):
    """``triton.language`` with its ``@triton.jit`` functions interpreted."""

    def __init__(self, lang: types.ModuleType) -> None:
        super().__init__(lang.__name__)
        self._lang = lang

    def __getattr__(self, name: str):
        value = getattr(self._lang, name)
        if isinstance(value, triton.JITFunction):
            return _library_twin(value)
        return value


patch_interpreter()


def _library_twin(fn: triton.JITFunction) -> InterpretedFunction:
    """A Triton library function interpreted in its own module globals."""
    twin = _TWINS.get(id(fn))
    if twin is None:
        twin = _TWINS[id(fn)] = Twin(fn.fn)
    return twin


def interpreted(kernel: triton.JITFunction) -> InterpretedFunction:
    """The interpreter twin of ``kernel`` (cached; the helpers it calls are twinned too)."""
    twin = _TWINS.get(id(kernel))
    if twin is not None:
        return twin
    fn = kernel.fn
    twin_globals = dict(fn.__globals__)
    twin_globals[_REAL_TL] = tl
    if "INTERPRETED" in twin_globals:  # numerics.to_storage: round bf16 in float32 bits
        twin_globals["INTERPRETED"] = tl.constexpr(True)
    twin_fn = types.FunctionType(
        fn.__code__, twin_globals, fn.__name__, fn.__defaults__, fn.__closure__
    )
    twin_fn.__qualname__ = fn.__qualname__
    twin_fn.__module__ = fn.__module__
    twin = _TWINS[id(kernel)] = Twin(twin_fn)
    for name, value in fn.__globals__.items():
        if value is tl:
            twin_globals[name] = _LanguageView(tl)
        elif isinstance(value, triton.JITFunction):
            twin_globals[name] = interpreted(value)
    return twin
