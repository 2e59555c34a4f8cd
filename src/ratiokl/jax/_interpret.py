"""The launch of JAX's ``"interpret"`` backend: ``jax_triton.triton_call`` run by Triton's CPU
interpreter.

``backend="interpret"`` is the ``"triton"`` binding (``ratiokl.jax._triton``: the same
``custom_vjp``, ``vmap`` rules and launches in ``ratiokl.jax._launch``) with every launch
sent to :func:`triton_call` here instead of jax-triton's. It runs the kernel's
interpreter twin (``ratiokl._kernels.interpreted``, the one ``ratiokl.torch``'s
``"interpret"`` backend runs) on torch CPU tensors behind ``jax.pure_callback``, so it
works under ``jit``, ``grad``, ``vjp``, ``vmap`` and ``shard_map`` on any JAX device (the
arrays are copied to the host and back). It is for testing the JAX binding on a CPU, and
slow. It needs torch and triton (``pip install 'ratiokl[torch-triton]'``), imported
with this module.

Memory a kernel does not write shows: outputs named in ``input_output_aliases`` start as
a copy of their input and those in ``zeroed_outputs`` as zeros, as on the GPU; the others
start as garbage (NaN; -1 for integers), as uninitialised memory may hold. Like
``pure_callback`` (and jax-triton), the outputs are typed invariant across ``shard_map``'s
axes.

Launches run one at a time: the interpreter patches module globals while a launch runs,
and the callbacks of several devices run on several threads.

:func:`recording` is the seam for tests that check what was launched.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
import torch

from ratiokl._kernels import interpreted
from ratiokl._kernels.interpret import quiet

__all__ = ["Launch", "recording", "triton_call"]

#: One launch at a time (see the module docstring).
_LOCK = threading.Lock()
#: The lists of the :func:`recording` blocks now open.
_RECORDERS: List[List["Launch"]] = []


@dataclass(frozen=True)
class Launch:
    """One launch that ran: the kernel's name, the grid, the compile-time keywords and
    the ``input_output_aliases`` (input position -> output position)."""

    kernel: str
    grid: Tuple[int, ...]
    constants: Mapping[str, Any]
    aliases: Mapping[int, int]


@contextlib.contextmanager
def recording() -> Iterator[List[Launch]]:
    """A list that gets a :class:`Launch` each time the interpreter backend runs a kernel
    inside the block, in the order they run.

    For tests that check which kernels run with which constants (a plan, a flag). A
    launch is recorded when its computation runs, which JAX may do after the call
    returns: block on the results (``jax.block_until_ready``) inside the block. A
    traced launch that does not run (the primal that ``custom_vmap`` traces for its
    rule) is not recorded."""
    launches: List[Launch] = []
    with _LOCK:
        _RECORDERS.append(launches)
    try:
        yield launches
    finally:
        with _LOCK:
            _RECORDERS.remove(launches)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":  # NumPy has no bfloat16: through its bits
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor, dtype: Any) -> np.ndarray:
    if np.dtype(dtype).name == "bfloat16":
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def _garbage(shape: jax.ShapeDtypeStruct, zeroed: bool) -> torch.Tensor:
    """A fresh output: zeros, or what unwritten memory may hold (NaN; -1 for integers)."""
    dtype = np.dtype(shape.dtype)
    fill = 0 if zeroed else (np.nan if dtype.kind == "f" else -1)
    return _to_torch(np.full(shape.shape, fill, dtype))


def _check_constants(constants: Mapping[str, Any]) -> None:
    """Refuse what jax-triton cannot pass: its keywords are compile-time constants, and
    Triton cannot convert a NumPy scalar to one."""
    for name, value in constants.items():
        if isinstance(value, np.generic):
            raise TypeError(f"{name}={value!r}: jax-triton passes keywords as compile-time "
                            "constants, and Triton cannot convert a NumPy scalar; pass a "
                            "Python number")


def triton_call(*args: jax.Array, kernel: Any,
                out_shape: Union[jax.ShapeDtypeStruct, Sequence[jax.ShapeDtypeStruct]],
                grid: Tuple[int, ...], num_warps: Optional[int] = None,
                input_output_aliases: Optional[Dict[int, int]] = None,
                zeroed_outputs: Sequence[int] = (), **constants: Any) -> Any:
    """``jax_triton.triton_call``'s signature and results, run by the interpreter on the
    host (``num_warps`` has no meaning there)."""
    del num_warps
    _check_constants(constants)
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)
    aliases = dict(input_output_aliases or {})
    launch = Launch(kernel.__name__, tuple(grid), dict(constants), aliases)
    from_input = {o: i for i, o in aliases.items()}
    twin = interpreted(kernel)

    def host(*arrays: np.ndarray) -> List[np.ndarray]:
        ins = [_to_torch(a) for a in arrays]
        outs = [ins[from_input[j]].clone() if j in from_input
                else _garbage(s, j in zeroed_outputs) for j, s in enumerate(shapes)]
        with _LOCK, quiet(), warnings.catch_warnings():
            # Also NumPy's "All-NaN slice" in the interpreter's reductions over the
            # garbage-filled outputs.
            warnings.filterwarnings("ignore", category=RuntimeWarning)
            twin[grid](*ins, *outs, **constants)
            for launches in _RECORDERS:
                launches.append(launch)
        return [_to_numpy(o, s.dtype) for o, s in zip(outs, shapes)]

    res = jax.pure_callback(host, shapes, *args)
    return res[0] if single else res
