"""Every use of Triton's internals, in one place, checked against the versions it was tested on.

ratiokl reaches below Triton's public API twice:

* eager CUDA launches from a compiled kernel's cached handle
  (``ratiokl.torch._cached_launch``): the launch hooks, the current device and stream, a
  ``JITFunction``'s parameters and the compiled handle's launcher call
  (:func:`run_compiled`, the call ``JITFunction.run`` itself makes);
* the interpreter twins (``ratiokl._kernels.interpret``): two fixes to the interpreter
  (:func:`patch_interpreter`) and its language patch, applied once per launch instead of
  once per helper call (:class:`Twin`).

Tested on Triton 3.6 (the H200) and 3.9 (the CPU interpreter): :data:`TESTED`. On a
version outside that range importing this module warns once (``RuntimeWarning``) and
the cached launches take Triton's own launch path (correct, 10-80 us more host time a
launch); the interpreter fixes are applied only where the internals they wrap exist.
"""

from __future__ import annotations

import re
import threading
import types
import warnings
from typing import Any, FrozenSet, Tuple

import numpy as np
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import interpreter
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "IN_RANGE", "TESTED", "Twin", "current_device", "current_stream", "kernel_params",
    "launch_hooked", "patch_interpreter", "run_compiled",
]

#: Oldest and newest ``(major, minor)`` Triton this module was tested on.
TESTED = ((3, 6), (3, 9))


def _version(text: str) -> Tuple[int, int]:
    """``(major, minor)`` of a version string such as ``3.6.0+git1234``."""
    found = re.match(r"(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


#: Whether the installed Triton is within :data:`TESTED` (else: Triton's own launch path).
IN_RANGE = TESTED[0] <= _version(triton.__version__) <= TESTED[1]
if not IN_RANGE:
    warnings.warn(
        f"ratiokl was tested with Triton {TESTED[0][0]}.{TESTED[0][1]} to "
        f"{TESTED[1][0]}.{TESTED[1][1]}, found {triton.__version__}: eager CUDA launches take "
        "Triton's own (slower) launch path and the interpreter fixes apply only where "
        "Triton's internals match; install a tested Triton for the cached launches",
        RuntimeWarning, stacklevel=2,
    )


# --- the cached launch ----------------------------------------------------------------------


def launch_hooked() -> bool:
    """Whether a launch hook is registered (an empty ``HookChain`` is none)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))


def current_device() -> int:
    """The current CUDA device, as Triton's driver sees it."""
    return driver.active.get_current_device()


def current_stream(device: int) -> Any:
    """The current stream of ``device``, as Triton's driver sees it."""
    return driver.active.get_current_stream(device)


def kernel_params(kernel: triton.runtime.JITFunction) -> Tuple[Tuple[str, ...], FrozenSet[int]]:
    """A kernel's parameter names in order and the positions of its constexpr parameters."""
    return (tuple(kernel.arg_names),
            frozenset(i for i, p in enumerate(kernel.params) if p.is_constexpr))


def run_compiled(compiled: Any, grid: Tuple[int, ...], stream: Any, args: Tuple[Any, ...]) -> None:
    """Launch a compiled handle (what ``kernel[grid](...)`` returned) on ``grid`` with
    ``args`` in the kernel's parameter order, as ``JITFunction.run`` does (3.6 to 3.9).
    No hook is registered (the caller checked): None for both, as Triton would pass."""
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *args)


# --- the interpreter --------------------------------------------------------------------------


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


def patch_interpreter() -> None:
    """The two fixes to Triton's interpreter (idempotent), see ``ratiokl._kernels.interpret``."""
    if hasattr(interpreter, "InterpreterBuilder") and hasattr(interpreter, "TensorHandle"):
        _comparisons_give_int1()
    _index_of_one_element_arrays()


class _Launches(threading.local):
    """Launches in progress on this thread (the language is patched while one is)."""

    depth = 0


_LAUNCH = _Launches()
#: What ``interpreter._patch_lang`` reads of a function: both language modules.
_BOTH_LANGUAGES = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})


class Twin(InterpretedFunction):
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
