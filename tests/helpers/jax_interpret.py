"""``jax_triton.triton_call`` stand-in for CPU tests: the kernel's interpreter twin.

The JAX ``"triton"`` backend launches every kernel through
``ratiokl.jax._triton._triton_call``; tests substitute :func:`interpreted_triton_call`
for it, which runs the same kernel on the CPU (Triton's interpreter, torch
tensors) behind ``jax.pure_callback``. Outputs named in
``input_output_aliases`` start as a copy of their input, those in
``zeroed_outputs`` as zeros, and the others as garbage (NaN, or -1 for
integers), as unwritten memory would be: a value a kernel fails to write shows.
"""

from __future__ import annotations

import numpy as np
import torch

from ratiokl._kernels import interpreted


def _to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    if np.dtype(dtype).name == "bfloat16":
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def _fresh(shape, zeroed: bool) -> torch.Tensor:
    dtype = np.dtype(shape.dtype)
    fill = 0 if zeroed else (np.nan if dtype.kind == "f" else -1)
    return _to_torch(np.full(shape.shape, fill, dtype))


def interpreted_triton_call(*args, kernel, out_shape, grid, num_warps=None,
                            input_output_aliases=None, zeroed_outputs=(), record=None, **meta):
    """``triton_call``'s signature and results, run by the interpreter on the host.

    Keywords other than the launch's own are the kernel's compile-time constants
    in jax-triton; a NumPy scalar among them is refused, as the real launch does.

    ``record``: a list that gets the kernel's name each time it runs (not when traced).
    """
    import jax

    del num_warps
    for name, value in meta.items():  # what jax-triton 0.3.1 with Triton 3.6 fails to compile
        if isinstance(value, np.generic):
            raise TypeError(f"{name}={value!r}: jax-triton passes keywords as compile-time "
                            "constants, and Triton cannot convert a NumPy scalar")
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)
    aliases = {o: i for i, o in (input_output_aliases or {}).items()}

    def host(*arrays):
        if record is not None:
            record.append(kernel.__name__)
        ins = [_to_torch(a) for a in arrays]
        outs = [ins[aliases[j]].clone() if j in aliases else _fresh(s, j in zeroed_outputs)
                for j, s in enumerate(shapes)]
        with np.errstate(all="ignore"):
            interpreted(kernel)[grid](*ins, *outs, **meta)
        return [_to_numpy(o, s.dtype) for o, s in zip(outs, shapes)]

    res = jax.pure_callback(host, shapes, *args)
    return res[0] if single else res


def use_interpreted_triton(monkeypatch) -> None:
    """Route ``backend="triton"`` of ``ratiokl.jax`` to :func:`interpreted_triton_call` on
    this host for one test (``monkeypatch``: pytest's fixture, which undoes it)."""
    from ratiokl.jax import _launch, _route

    monkeypatch.setattr(_launch, "triton_call", interpreted_triton_call)
    monkeypatch.setattr(_route, "backend_name", lambda backend: backend)


def jax_backend(name: str, monkeypatch) -> str:
    """The ``backend=`` of a test parametrised over ``"native"`` / ``"triton"``: the Triton
    one through the interpreter (skipped without Triton)."""
    if name == "native":
        return "native"
    import pytest

    pytest.importorskip("triton")
    use_interpreted_triton(monkeypatch)
    return "triton"
