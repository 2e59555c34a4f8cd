"""The launch machinery of the PyTorch binding: one launch described once, bound three ways.

A launch is a plain function ``launch(kernels, *args)``: ``kernels`` maps a
``@triton.jit`` kernel to something launchable as ``kernel[grid](...)``, and
the annotated positional parameters after it are the op's schema.
:class:`KernelOp` binds that one description for each way torch runs it:

* ``"eager"`` (CUDA, outside ``torch.compile``): the kernels themselves, inside
  a generated ``torch.autograd.Function`` when the op has a gradient, else
  called directly -- no op dispatcher, whose ~0.2-0.4 ms of host time per call
  dominated few-row steps on the H200;
* ``"compiled"`` (CUDA, while ``torch.compile`` traces): a
  ``torch.library.triton_op`` launching through ``wrap_triton``, so the
  compiler sees the kernels (``fullgraph=True`` works);
* ``"interpret"`` (CPU tensors): the interpreter twins
  (``ratiokl._kernels.interpreted``) inside a ``torch.library.custom_op``,
  opaque to the compiler, with a fake for tracing.

An op with a gradient gives ``setup_context(ctx, inputs, output)`` and
``backward(ctx, *grads)``: registered for both library ops and used by the
eager Function. ``ctx.binding`` names the binding that ran the forward, so a
backward launches its own kernels the same way (:meth:`KernelOp.run`).

Launches never synchronise with the host and never read out of bounds: the
kernels clamp every id and poison (NaN) an active row with an id outside
``[0, V)`` or a NaN temperature, so a host check is never needed for safety.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.library import custom_op, register_autograd, triton_op, wrap_triton

from ratiokl._kernels import interpreted
from ratiokl._kernels.interpret import quiet as quiet_interpreter
from ratiokl.torch._cached_launch import cached

__all__ = ["KernelOp", "binding_for", "kernels_for", "row_outputs", "row_stride"]

Tensor = torch.Tensor


def _raw(kernel):
    """Eager CUDA: the kernel launched from its cached compiled handle (no tracing wrapper,
    no per-call binder: ``_cached_launch``)."""
    return cached(kernel)


def _interpreter(kernel):
    return interpreted(kernel)


class KernelOp:
    """One launch (``launch(kernels, *args)``) bound as eager, compiled and interpreted ops.

    Call it like the launch without ``kernels``: the binding is chosen from the
    first tensor argument's device and whether ``torch.compile`` is tracing.
    """

    def __init__(self, launch: Callable, *, fake: Callable, mutates: Sequence[str] = (),
                 setup_context: Optional[Callable] = None,
                 backward: Optional[Callable] = None) -> None:
        name = launch.__name__
        signature = inspect.signature(launch)
        params = [p for p in list(signature.parameters.values())[1:]
                  if p.kind is p.POSITIONAL_OR_KEYWORD]  # keyword-only: eager tuning knobs
        schema = signature.replace(parameters=params)
        self.launch = launch
        self._mutates = tuple(mutates)
        names = [p.name for p in params]
        self._mutated_positions = tuple(names.index(m) for m in self._mutates)
        self._compiled = triton_op(f"ratiokl::{name}", self._bound(launch, wrap_triton, schema),
                                   mutates_args=self._mutates)
        self._interpret = custom_op(
            f"ratiokl::interpret_{name}", self._bound(launch, _interpreter, schema, quiet=True),
            mutates_args=self._mutates, device_types="cpu",
        )
        self._interpret.register_fake(fake)
        self._eager = self._direct
        if backward is not None:
            for qualname, binding in ((f"ratiokl::{name}", "compiled"),
                                      (f"ratiokl::interpret_{name}", "interpret")):
                register_autograd(qualname, backward,
                                  setup_context=self._tagged(setup_context, binding))
            self._eager = self._function(f"{name}_eager", setup_context, backward,
                                         lambda *args: launch(_raw, *args), "eager")
        self._transformed = self._function(f"{name}_transformed", setup_context, backward,
                                           self._interpret, "interpret")

    @staticmethod
    def _bound(launch: Callable, kernels: Callable, schema: inspect.Signature,
               quiet: bool = False) -> Callable:
        def op(*args):
            if quiet:  # the interpreter: its NumPy noise stays out of the caller's output
                with quiet_interpreter():
                    return launch(kernels, *args)
            return launch(kernels, *args)

        op.__signature__ = schema
        op.__name__ = launch.__name__
        return op

    @staticmethod
    def _tagged(setup_context: Callable, binding: str) -> Callable:
        def setup(ctx, inputs, output) -> None:
            ctx.binding = binding
            setup_context(ctx, inputs, output)

        return setup

    @staticmethod
    def _function(name: str, setup_context: Optional[Callable], backward: Optional[Callable],
                  run: Callable, binding: str) -> Callable:
        """An ``autograd.Function`` of the first input (the one a backward differentiates)
        and the rest as one tuple, which autograd does not walk (``apply`` costs host time
        per argument: the fused loss's twenty took about 35 us a call on the CPU), whose
        forward is ``run``; ``backward``'s other gradients, all None, are dropped (no
        ``backward``: the op is not differentiable, as a backward's own launches).

        In ``setup_context`` form with a generated ``vmap`` rule, so ``torch.func``
        transforms it: the ``"interpret"`` one (``run``: the interpreter's custom op, which
        ``vmap`` runs example by example) serves the CPU ops inside a transform, where the
        custom op's own autograd cannot go."""

        def forward(first, rest):
            return run(first, *rest)

        def setup(ctx, inputs, output) -> None:
            first, rest = inputs
            ctx.binding = binding
            if setup_context is not None:
                setup_context(ctx, (first, *rest), output)

        def backward_first(ctx, *grads):
            if backward is None:
                raise RuntimeError(f"{name} is not differentiable (no double backward)")
            return backward(ctx, *grads)[0], None

        function = type(name, (torch.autograd.Function,),
                        {"forward": staticmethod(forward), "setup_context": staticmethod(setup),
                         "backward": staticmethod(backward_first), "generate_vmap_rule": True})
        return lambda first, *rest: function.apply(first, rest)

    def _direct(self, *args):
        output = self.launch(_raw, *args)
        for index in self._mutated_positions:
            torch.autograd.graph.increment_version(args[index])
        return output

    def run(self, binding: str, *args):
        """The op through ``binding`` (``"eager"``, ``"compiled"`` or ``"interpret"``).

        Eager without a gradient to take (grad mode off, or the first input -- the only
        one a backward differentiates -- not requiring one): the launch itself, without
        the ``autograd.Function`` around it (about 10 us of host time a call).
        """
        if binding == "eager":
            if torch.is_grad_enabled() and args[0].requires_grad:
                return self._eager(*args)
            return self._direct(*args)
        if binding == "interpret" and torch._C._are_functorch_transforms_active():
            return self._transformed(*args)
        return (self._compiled if binding == "compiled" else self._interpret)(*args)

    def __call__(self, *args):
        return self.run(binding_for(args[0].device), *args)

    def direct(self, device: torch.device, *args, **knobs):
        """The launch itself, outside any op or autograd (eager only; knobs: tuning overrides)."""
        kernels = _raw if device.type == "cuda" else _interpreter
        with np.errstate(all="ignore"):
            return self.launch(kernels, *args, **knobs)


def binding_for(device: torch.device) -> str:
    """Which binding runs on ``device`` now (see the module docstring)."""
    if device.type != "cuda":
        return "interpret"
    return "compiled" if torch.compiler.is_compiling() else "eager"


def row_outputs(n_rows: int, device: torch.device, count: int) -> Tuple[Tensor, ...]:
    """``count`` fresh float32 ``[n_rows]`` tensors on ``device`` (a launch's row outputs)."""
    return tuple(torch.empty(n_rows, dtype=torch.float32, device=device) for _ in range(count))


def row_stride(t: Tensor) -> int:
    """Row stride of a per-row tensor, 0 for a one-element tensor (one value for every row)."""
    return 0 if t.numel() == 1 else t.stride(0)


def kernels_for(device: torch.device) -> Callable:
    """The launcher of eager launches outside any op (:meth:`KernelOp.direct`): the cached
    compiled handle on CUDA, the interpreter twin on the CPU."""
    return _raw if device.type == "cuda" else _interpreter

