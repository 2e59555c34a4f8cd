"""Argument validation for ``ratiokl.torch.loss``.

The shape and dtype rules are :mod:`ratiokl._core.checks`, bound here to PyTorch's
adapter; with :func:`check_same_device`, :func:`check_no_transforms` and
:func:`check_transform_backend` they look only at
shapes, dtypes, devices and Python scalars, so they cost no device synchronisation and
trace under ``torch.compile``. The one exception is :class:`ActiveCheck`
(:func:`check_active_ids`), the documented host check that ``check_ids=False`` skips,
read after the call's kernels are queued.
"""

from __future__ import annotations

import itertools
from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl._core import checks
from ratiokl._core.checks import TokenInputs
from ratiokl.spec import check_action_ids, check_temperatures
from ratiokl.torch._arrays import XP

__all__ = ["ActiveCheck", "check_active_ids", "check_ids", "check_logits", "check_mask",
           "check_no_transforms", "check_ref", "check_row_values", "check_same_device",
           "check_temperature", "check_transform_backend", "float64_backend", "LOGIT_DTYPES",
           "Normalizer", "poison_bad_temperature", "token_inputs", "TokenInputs"]

#: ``spec.LOGIT_DTYPE_NAMES`` as torch dtypes.
LOGIT_DTYPES = XP.logit_dtypes

Temperature = Union[float, torch.Tensor]
Normalizer = Union[None, float, torch.Tensor]

# The shape and dtype rules, in PyTorch's words.
(check_logits, check_ids, check_mask, check_row_values, check_ref, check_temperature,
 float64_backend, poison_bad_temperature, token_inputs, _bad_rows) = checks.bind(XP)


def _in_transform() -> bool:
    """Whether a ``torch.func`` transform is active (never asked while ``torch.compile``
    traces: Dynamo handles its own)."""
    return not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active()


def check_no_transforms() -> None:
    """Raise ``RuntimeError`` inside a ``torch.func`` transform (``grad``, ``vmap``, ...):
    the ops from hidden states (``linear_selected_logprobs``, ``linear_policy_loss``).

    Their ``autograd.Function``s compute the gradients in the forward or in chunks written
    into buffers, with no functorch rules; the error says what to use.
    """
    if _in_transform():
        raise RuntimeError(
            "linear_selected_logprobs and linear_policy_loss do not support torch.func "
            "transforms (grad, vmap, jacrev, jvp, ...): their gradients are custom autograd "
            "Functions without functorch rules. Call them outside the transform: take "
            "gradients with loss.backward() or torch.autograd.grad, and pass the batch as "
            "the leading shape [...] instead of vmap (every op takes any leading shape); "
            "selected_logprobs, ratio_kl, policy_loss and policy_objective support "
            "torch.func, and ratiokl.jax supports jax.grad and jax.vmap"
        )


def check_transform_backend(backend: str, vocab_group: object, inplace_grad: bool = False
                            ) -> None:
    """Inside a ``torch.func`` transform, the logits ops run on ``"native"`` and
    ``"interpret"``; raise ``RuntimeError`` for ``"triton"`` (its launches take no batched
    tensors) and ``vocab_group`` (collectives), ``ValueError`` for ``inplace_grad=True``."""
    if not _in_transform():
        return
    if vocab_group is not None:
        raise RuntimeError(
            "`vocab_group` is not supported inside torch.func transforms (grad, vmap, ...): "
            "the sharded ops run collectives with custom autograd Functions without "
            "functorch rules. Call the op outside the transform (loss.backward(), the batch "
            "as the leading shape [...]), or pass unsharded logits"
        )
    if backend == "triton":
        raise RuntimeError(
            "backend='triton' is not supported inside torch.func transforms (grad, vmap, "
            "...): its CUDA launches take no batched tensors. Pass backend='native' inside "
            "the transform, or call the op outside it (loss.backward(), the batch as the "
            "leading shape [...])"
        )
    if inplace_grad:
        raise ValueError(
            "`inplace_grad=True` cannot apply inside a torch.func transform (the gradient "
            "would be written into a transform's wrapper of the logits); pass "
            "inplace_grad=False"
        )


#: All given tensors (None skipped) live on one device; returns it (``ValueError``
#: otherwise). The adapter's rule, which the framework-neutral core asks too.
check_same_device = XP.same_device


class _FlagSlots:
    """A ring of pinned host slots that ``active_check_kernel`` writes its flags into,
    each with the event the host waits on.

    Pinned host memory is mapped into every device's address space (unified
    addressing), so the kernel stores the two flags straight into the slot the host
    reads after the event: no device buffer, no copy to the host, no pinned allocation
    or new event per call. Slots are 16 bytes (the kernel's pointer stays 16-byte
    aligned: one compile) and reused round-robin. A call reads its own slot before it
    returns, but one that raises between queuing the check and reading it (a bad
    argument validated later, such as ``rollout_logps``) leaves its write pending, on
    any stream: :meth:`take` waits for a slot's last event before handing it out again
    (at once in the usual case, that event having been waited for ``SLOTS`` calls ago).
    One ring per device (an event records on its own device's streams only).
    """

    SLOTS = 64

    def __init__(self) -> None:
        self._rings: Dict[int, Tuple[Tuple[torch.Tensor, torch.cuda.Event], ...]] = {}
        self._turn = itertools.count()  # next() is atomic under the GIL: threads share it

    def take(self, device: torch.device) -> Tuple[torch.Tensor, torch.cuda.Event]:
        """The next int32 ``[4]`` pinned slot on ``device``'s ring (the kernel writes the
        first two) and its event."""
        ring = self._rings.get(device.index)
        if ring is None:
            flags = torch.zeros((self.SLOTS, 4), dtype=torch.int32, pin_memory=True)
            ring = self._rings[device.index] = tuple(
                (row, torch.cuda.Event()) for row in flags.unbind())
        slot, event = ring[next(self._turn) % self.SLOTS]
        event.synchronize()  # a never-recorded event returns at once
        return slot, event


_FLAG_SLOTS = _FlagSlots()


_CAPTURE_ERROR = (
    "check_ids=True reads the active ids on the host, which a CUDA graph capture cannot "
    "do; pass check_ids=False inside the capture (a bad id or temperature then makes its "
    "row NaN), or check the ids before capturing"
)


@torch.library.custom_op("ratiokl::checked_mask", mutates_args=())
def _checked_mask(ids: torch.Tensor, mask: torch.Tensor, vocab_size: int,
                  temperature: Optional[torch.Tensor]) -> torch.Tensor:
    """A copy of ``mask``, once :func:`check_active_ids` passed: the check under
    ``torch.compile``. Opaque to the compiler (it runs when the compiled graph runs, and
    raises ratiokl's ``ValueError``), and its output is the mask every later op reads, so
    the compiler can neither drop it nor move the kernels before it."""
    if mask.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(_CAPTURE_ERROR)
    check_active_ids(ids, mask, vocab_size, temperature)
    return mask.clone()


@_checked_mask.register_fake
def _checked_mask_fake(ids, mask, vocab_size, temperature):
    return torch.empty_like(mask)


@_checked_mask.register_vmap
def _checked_mask_vmap(info, in_dims, ids, mask, vocab_size, temperature):
    """Under ``torch.func.vmap``: every example's ids at once, the batch axis first (so an
    error names the position as ``[example, ...]``); the mask passes through."""

    def whole(t: Optional[torch.Tensor], dim: Optional[int]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t.expand(info.batch_size, *t.shape) if dim is None else t.movedim(dim, 0)

    check_active_ids(whole(ids, in_dims[0]), whole(mask, in_dims[1]), vocab_size,
                     whole(temperature, in_dims[3]))
    return mask.clone(), in_dims[1]


class ActiveCheck:
    """The host check of active ids and temperatures, queued on the device, read later.

    ``ActiveCheck(ids, mask, V, temperature)`` queues the test behind an event: with
    ``one_launch`` (the Triton backends) one launch of ``active_check_kernel``, which
    writes its two flags straight into a pinned host slot (:class:`_FlagSlots`), else
    framework ops and an asynchronous copy of their result to pinned host memory. The
    caller then queues its kernels and calls :meth:`raise_if_bad`, which waits for that
    event only -- the GPU keeps running the kernels queued after it, and the bad rows
    are NaN in them either way. On the CPU the test runs at once, before anything is
    launched. While ``torch.compile`` traces, the test becomes the ``ratiokl::checked_mask``
    op (``vocab_size`` needed), run inside the compiled graph before the kernels (on a GPU
    one host sync there), whose output the caller reads as the mask (:attr:`mask`). Inside
    a ``torch.func`` transform the same op runs at once; under ``vmap`` its batching rule
    checks every example's ids together. The error names the first bad position
    (:func:`check_active_ids`; under ``vmap`` with the vmapped axis first).
    """

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, vocab_size: Optional[int],
                 temperature: Optional[Temperature] = None, *, one_launch: bool = False) -> None:
        self._args = (ids, mask, vocab_size, temperature)
        self._flags = self._event = None
        has_temp = isinstance(temperature, torch.Tensor)
        #: The mask the call's kernels read: ``mask``, or under ``torch.compile`` the
        #: checking op's copy of it.
        self.mask = mask
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            self.mask = _checked_mask(ids, mask, vocab_size,
                                      temperature if has_temp else None)
            return
        if ids.device.type != "cuda":
            check_active_ids(*self._args)  # nothing to overlap with: check now
            return
        if vocab_size is None and not has_temp:
            return  # nothing to test
        if torch.cuda.is_current_stream_capturing():  # its wait would break the capture
            raise ValueError(_CAPTURE_ERROR)
        if one_launch:  # the Triton backends: one kernel (ratiokl._kernels.active_check)
            from ratiokl.torch import _launch  # imports triton: only when a kernel backend runs

            self._flags, self._event = _FLAG_SLOTS.take(ids.device)
            _launch.active_flags(ids, mask, vocab_size, temperature if has_temp else None,
                                 out=self._flags)
        else:
            flags = torch.stack([b.any() for b in _bad_rows(*self._args).values()])
            self._flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._flags.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
        self._event.record()

    def raise_if_bad(self) -> None:
        """Raise ``ValueError`` if an active id or temperature was bad (else return)."""
        if self._event is not None:
            self._event.synchronize()
            if self._flags.numpy()[:2].any():
                check_active_ids(*self._args)


def check_active_ids(ids: torch.Tensor, mask: torch.Tensor, vocab_size: Optional[int],
                     temperature: Optional[Temperature] = None) -> None:
    """Raise ``ValueError`` naming the first active position with an id outside ``[0, V)``.

    Also for a tensor ``temperature`` (the leading shape): the first active
    position whose temperature is not positive and finite. ``vocab_size``
    None checks the temperature only. One host synchronisation (on two
    booleans); callers that cannot afford it pass ``check_ids=False`` and get
    NaN rows instead.
    """
    bad = _bad_rows(ids, mask, vocab_size, temperature)
    if not bad:
        return
    found = dict(zip(bad, torch.stack([b.any() for b in bad.values()]).tolist()))
    if not any(found.values()):
        return
    # The error path: the spec's checks name the position, on host copies.
    host_mask = mask.cpu().numpy()
    if found.get("action_ids"):
        check_action_ids(ids.cpu().numpy(), host_mask, vocab_size)
    check_temperatures(temperature.float().cpu().numpy(), host_mask)
