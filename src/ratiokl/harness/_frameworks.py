"""Framework adapters: NumPy case -> framework call -> NumPy outputs and gradient.

Each adapter imports its framework lazily, so importing
``ratiokl.harness`` imports neither torch nor jax. A target is one
``(framework, backend)`` pair, named ``"<framework>-<backend>"``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

import numpy as np

from ratiokl._requirements import MissingDependency, import_framework, unmet
from ratiokl.harness._cases import Case
from ratiokl.harness._ops import OPS
from ratiokl.harness._protocol import TargetCall

__all__ = ["TARGETS", "Outcome", "Target", "call_target", "target_status"]


@dataclass(frozen=True)
class Target:
    """One ``(framework, backend)`` pair; ``gpu`` marks pairs that need a GPU."""

    framework: str
    backend: str
    gpu: bool

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.backend}"


TARGETS: Dict[str, Target] = {t.name: t for t in (
    Target("torch", "native", gpu=False),
    Target("torch", "interpret", gpu=False),
    Target("torch", "triton", gpu=True),
    Target("jax", "native", gpu=False),
    Target("jax", "interpret", gpu=False),
    Target("jax", "triton", gpu=True),
)}


@dataclass
class Outcome:
    """What one call returned: outputs and gradient as NumPy, with their framework dtypes
    (a dtype of None, or an output absent from ``output_dtypes``, is not checked; a ``grad``
    of None is a missing gradient)."""

    outputs: Dict[str, np.ndarray]
    output_dtypes: Dict[str, str]
    grad: Optional[np.ndarray]
    grad_dtype: Optional[str]
    #: Gradient of the unused interleaved slots when the logits were strided (must be 0).
    stride_gap_grad: Optional[np.ndarray] = None
    #: The gradients of ``Op.also_differentiate``'s arguments, and their dtypes.
    extra_grads: Dict[str, np.ndarray] = field(default_factory=dict)
    extra_grad_dtypes: Dict[str, str] = field(default_factory=dict)


def _framework(name: str) -> Optional[str]:
    """Why ``ratiokl.<name>`` cannot be used here (framework absent or too old), in full."""
    try:
        import_framework(name, needed_by=f"ratiokl.{name}")
    except MissingDependency as exc:
        return str(exc)
    return None


def _triton() -> Optional[str]:
    return unmet("triton")


def _torch_cuda() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"


def _jax_triton() -> Optional[str]:
    """The JAX route's own reason (versions, GPU, jax-triton's import), in full."""
    from ratiokl.jax._route import _jax_triton_error

    return _jax_triton_error() or None


def _jax_interpret() -> Optional[str]:
    """The JAX route's own reason (torch or triton missing or too old), in full."""
    from ratiokl.jax._route import _interpret_error

    return _interpret_error() or None


_REQUIREMENTS: Dict[str, Tuple[Callable[[], Optional[str]], ...]] = {
    "torch-native": (lambda: _framework("torch"),),
    "torch-interpret": (lambda: _framework("torch"), _triton),
    "torch-triton": (lambda: _framework("torch"), _triton, _torch_cuda),
    "jax-native": (lambda: _framework("jax"),),
    "jax-interpret": (lambda: _framework("jax"), _jax_interpret),
    "jax-triton": (lambda: _framework("jax"), _jax_triton),
}


def target_status(name: str) -> Optional[str]:
    """``None`` if the target can run on this machine, else the reason it cannot."""
    if name not in TARGETS:
        raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
    for requirement in _REQUIREMENTS[name]:
        reason = requirement()
        if reason is not None:
            return reason
    return None


def _backend(op, backend: str) -> Dict[str, str]:
    """The ``backend=`` keyword, for the functions that take one (``Op.takes_backend``)."""
    return {"backend": backend} if op.takes_backend else {}


def _split_args(call: TargetCall,
                convert: Callable[[str, Any], Any]) -> Tuple[list, Dict[str, Any]]:
    op = call.spec
    args = {k: convert(k, v) for k, v in call.arguments.items()}
    return [args.get(k) for k in op.positional], {k: args[k] for k in op.keywords if k in args}


def _torch_to_numpy(t) -> np.ndarray:
    """Float32 NumPy copy of a tensor (exact for fp16/bf16 values)."""
    import torch

    return t.detach().to(device="cpu", dtype=torch.float32).numpy()


def _call_torch(call: TargetCall, backend: str, strided: bool) -> Outcome:
    import torch

    from ratiokl.torch import loss

    op = call.spec
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    device = "cuda" if backend == "triton" else "cpu"
    leaf = None
    extra_leaves = {}

    def convert(key: str, value: Any) -> Any:
        nonlocal leaf
        if not isinstance(value, np.ndarray):
            return value
        if key in op.logit_args:
            t = torch.tensor(value, device=device).to(dtypes[call.dtype_of(key)])
            if key in call.grads[1:]:
                extra_leaves[key] = t.requires_grad_(True)
            if key == op.differentiate:
                if strided:
                    # Logits interleaved with NaN slots the kernel must never read.
                    leaf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"),
                                      dtype=t.dtype, device=device)
                    leaf[..., ::2] = t
                    leaf.requires_grad_(True)
                    return leaf[..., ::2]
                leaf = t.requires_grad_(True)
            return t
        if value.dtype.kind in "iu":
            value = value.astype(np.int64)
        elif value.dtype.kind == "f":
            value = value.astype(np.float32)
        return torch.tensor(value, device=device)

    positional, keywords = _split_args(call, convert)
    outputs = op.unpack(getattr(loss, op.name)(*positional, **keywords, **op.fixed,
                                               **_backend(op, backend)))
    cot = [torch.tensor(call.cotangents[o], device=device) for o in op.cotangents]
    leaves = [leaf, *extra_leaves.values()]
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(torch.autograd.grad(
        [outputs[o] for o in op.cotangents], leaves, cot, allow_unused=True), leaves)]
    grad, extra = grads[0], dict(zip(extra_leaves, grads[1:]))
    gap = None
    if strided:
        grad, gap = grad[..., ::2], grad[..., 1::2]
    return Outcome(
        outputs={o: _torch_to_numpy(v) for o, v in outputs.items()},
        output_dtypes={o: str(v.dtype).replace("torch.", "") for o, v in outputs.items()},
        grad=_torch_to_numpy(grad),
        grad_dtype=str(grad.dtype).replace("torch.", ""),
        stride_gap_grad=None if gap is None else _torch_to_numpy(gap),
        extra_grads={k: _torch_to_numpy(g) for k, g in extra.items()},
        extra_grad_dtypes={k: str(g.dtype).replace("torch.", "") for k, g in extra.items()},
    )


@functools.lru_cache(maxsize=None)
def _jax_value_and_grad(op_key: str, backend: str, statics: Tuple[Tuple[str, Any], ...],
                        extra: Tuple[str, ...]):
    """A jitted ``(args, array_kwargs, cotangents) -> (outputs, grads)``, one per static
    setup; ``grads`` maps ``differentiate`` and the ``extra`` arguments to their gradients.

    Every array is a jit argument (traced, like a training step's inputs), so
    cases of equal shapes and dtypes share one compilation.
    """
    import jax

    from ratiokl.jax import loss

    op = OPS[op_key]
    names = (op.differentiate, *extra)

    def fn(diff, args, kwargs):
        args = [diff.get(k, a) for k, a in zip(op.positional, args)]
        kwargs = {k: diff.get(k, v) for k, v in kwargs.items()}
        outputs = op.unpack(getattr(loss, op.name)(*args, **kwargs, **dict(statics), **op.fixed,
                                                   **_backend(op, backend)))
        return tuple(outputs[o] for o in op.cotangents), outputs

    @jax.jit
    def value_and_grad(args, kwargs, cotangents):
        given = {**dict(zip(op.positional, args)), **kwargs}
        _, vjp, outputs = jax.vjp(lambda d: fn(d, args, kwargs),
                                  {k: given[k] for k in names}, has_aux=True)
        return outputs, vjp(cotangents)[0]

    return value_and_grad


def _call_jax(call: TargetCall, backend: str, strided: bool) -> Outcome:
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    del strided  # JAX arrays carry no user-visible strides.
    op = call.spec

    def convert(key: str, value: Any) -> Any:
        if not isinstance(value, np.ndarray):
            return value
        if key in op.logit_args:  # cast on the host: no XLA compilation per shape
            return jnp.asarray(value.astype(jnp.dtype(call.dtype_of(key))))
        if value.dtype == np.bool_:
            return jnp.asarray(value)
        if value.dtype.kind in "iu":
            return jnp.asarray(value.astype(np.int32))
        return jnp.asarray(value.astype(np.float32))

    positional, keywords = _split_args(call, convert)
    arrays = {k: v for k, v in keywords.items() if isinstance(v, jax.Array)}
    statics = tuple(sorted((k, v) for k, v in keywords.items() if k not in arrays))
    if call.expect_error is not None:
        # Eager, so the host id check sees concrete values and raises.
        getattr(loss, op.name)(*positional, **keywords, **op.fixed, **_backend(op, backend))
        raise AssertionError(f"{op.name} returned although {call.expect_error} was expected")
    cot = tuple(jnp.asarray(c) for c in call.cotangents.values())
    outputs, grads = _jax_value_and_grad(call.op, backend, statics, call.grads[1:])(
        positional, arrays, cot)
    to_np = lambda x: np.asarray(x).astype(np.float32)
    grad = grads.pop(op.differentiate)
    return Outcome(
        outputs={o: to_np(v) for o, v in outputs.items()},
        output_dtypes={o: str(v.dtype) for o, v in outputs.items()},
        grad=to_np(grad),
        grad_dtype=str(grad.dtype),
        extra_grads={k: to_np(g) for k, g in grads.items()},
        extra_grad_dtypes={k: str(g.dtype) for k, g in grads.items()},
    )


_CALLS = {"torch": _call_torch, "jax": _call_jax}


def call_target(case: Union[Case, TargetCall], target: str, *, strided: bool = False) -> Outcome:
    """Run ``case`` (a fixture case, or its :class:`TargetCall`) through
    ``ratiokl.<framework>.loss`` with the target's backend.

    ``strided`` passes the policy logits as a non-contiguous view (torch only).
    Exceptions from the library propagate (an expected error is one of them).
    """
    t = TARGETS[target]
    call = case if isinstance(case, TargetCall) else TargetCall.of(case)
    return _CALLS[t.framework](call, t.backend, strided)
