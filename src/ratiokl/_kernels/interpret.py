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

One fix to the interpreter itself (:func:`_comparisons_give_int1`): its
comparisons return handles typed like their operands instead of ``int1``; from
Triton 3.7 on, broadcasting such a scalar (``tl.load(mask_ptr + row) != 0``) into
a vector mask then gives ``int32`` data, and every masked load fails with "mask has
unsupported dtype". The compiled kernels never see this: their comparisons are
``int1`` in the compiler. And one for NumPy >= 2.4 under Triton 3.6
(:func:`_index_of_one_element_arrays`): the interpreter turns a scalar into a Python
int with ``int(array)`` on a one-element ``[1]`` array, which NumPy 2.4 refuses (so
every ``range(n)`` over a tensor bound failed); Triton 3.9 squeezes first, as this does.
"""

import contextlib
import threading
import types
import warnings
from typing import Dict, Iterator

import numpy as np
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction

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


def _comparisons_give_int1() -> None:
    """Make the interpreter's comparisons return ``int1`` handles, as compiled code has them.

    Idempotent; the values (NumPy bools) are unchanged, only the handle's type.
    """
    builder = interpreter.InterpreterBuilder
    for name in dir(builder):
        if not name.startswith(("create_icmp", "create_fcmp")):
            continue
        compare = getattr(builder, name)
        if getattr(compare, "_ratiokl_int1", False):
            continue

        def as_int1(self, lhs, rhs, _compare=compare):
            out = _compare(self, lhs, rhs)
            return interpreter.TensorHandle(np.asarray(out.data, dtype=np.bool_), tl.int1)

        as_int1._ratiokl_int1 = True
        setattr(builder, name, as_int1)


def _index_of_one_element_arrays() -> None:
    """Scalars used as Python ints (``range`` bounds) through ``.item()``, as Triton 3.9 does.

    Wraps the interpreter's per-launch patch of ``tl.tensor`` (undone after each
    launch, as the interpreter's own); idempotent; a Triton without that hook is left
    as it is.
    """
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_ratiokl_index", False):
        return

    def patched(tensor, scope, _patch_tensor=patch_tensor):
        _patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._ratiokl_index = True
    interpreter._patch_lang_tensor = patched


_comparisons_give_int1()
_index_of_one_element_arrays()


class _Twin(InterpretedFunction):
    """An ``InterpretedFunction`` whose device-function calls undo their language patch.

    Triton 3.6's interpreter patches ``triton.language`` (and ``triton.language.core``)
    with interpreter builtins for each call of a ``@triton.jit`` helper and never
    restores them, unlike a launch: one interpreted call of ``tl.max`` left 59 builtins
    of ``triton.language.core`` patched, and the next real compile in the process failed
    (``'ir.value' object has no attribute 'dtype'``). Here a launch patches both modules
    once, for its whole grid, and restores them after it; a helper called inside it
    patches nothing (every helper's language is one of those two modules). Patching per
    helper call cost 0.6 ms (``inspect.getmembers`` of four namespaces): 39 % of an
    interpreted run of a 1024-row launch plan whose programs mostly exit at once.
    """

    def run(self, *args, **kwargs):
        scope = interpreter._patch_lang(_BOTH_LANGUAGES)
        _LAUNCH.depth += 1
        try:
            return super().run(*args, **kwargs)
        finally:
            _LAUNCH.depth -= 1
            scope.restore()

    def __call__(self, *args, **kwargs):
        scope = None if _LAUNCH.depth else interpreter._patch_lang(self.fn)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as err:
            raise interpreter.InterpreterError(repr(err)) from err
        finally:
            if hasattr(scope, "restore"):
                scope.restore()


class _Launches(threading.local):
    """Launches in progress on this thread (the language is patched while one is)."""

    depth = 0


_LAUNCH = _Launches()
#: What ``interpreter._patch_lang`` reads of a function: both language modules.
_BOTH_LANGUAGES = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})


def _library_twin(fn: triton.JITFunction) -> InterpretedFunction:
    """A Triton library function interpreted in its own module globals."""
    twin = _TWINS.get(id(fn))
    if twin is None:
        twin = _TWINS[id(fn)] = _Twin(fn.fn)
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
    twin = _TWINS[id(kernel)] = _Twin(twin_fn)
    for name, value in fn.__globals__.items():
        if value is tl:
            twin_globals[name] = _LanguageView(tl)
        elif isinstance(value, triton.JITFunction):
            twin_globals[name] = interpreted(value)
    return twin
