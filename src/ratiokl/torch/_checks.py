"""Argument validation for ``ratiokl.torch.loss``.

Every check here looks only at shapes, dtypes, devices and Python scalars, so
it costs no device synchronisation and traces under ``torch.compile``. The one
exception is :class:`ActiveCheck` (:func:`check_active_ids`), the documented
host check that ``check_ids=False`` skips, read after the call's kernels are
queued. Errors name the argument and say how to fix it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl._core.route import as_rows
from ratiokl.spec import LOGIT_DTYPE_NAMES, check_action_ids, check_temperatures

__all__ = [
    "ActiveCheck",
    "LOGIT_DTYPES",
    "Normalizer",
    "TokenInputs",
    "token_inputs",
    "check_active_ids",
    "check_logits",
    "check_ids",
    "check_mask",
    "check_no_transforms",
    "check_ref",
    "check_row_values",
    "check_same_device",
    "check_temperature",
    "poison_bad_temperature",
]

#: ``spec.LOGIT_DTYPE_NAMES`` as torch dtypes.
LOGIT_DTYPES = tuple(getattr(torch, name) for name in LOGIT_DTYPE_NAMES)

Temperature = Union[float, torch.Tensor]
Normalizer = Union[None, float, torch.Tensor]


def check_no_transforms() -> None:
    """Raise ``RuntimeError`` inside a ``torch.func`` transform (``grad``, ``vmap``, ...).

    The ops' ``autograd.Function``s give analytic (some in-place, computed in the forward)
    gradients and no batching rules, so functorch cannot transform them; the error says
    what to use. Not asked while ``torch.compile`` traces (Dynamo handles its own).
    """
    if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
        raise RuntimeError(
            "ratiokl.torch.loss functions do not support torch.func transforms (grad, vmap, "
            "jacrev, jvp, ...): their gradients are custom autograd Functions without "
            "functorch rules. Call them outside the transform: take gradients with "
            "loss.backward() or torch.autograd.grad, and pass the batch as the leading "
            "shape [...] instead of vmap (every op takes any leading shape); ratiokl.jax "
            "supports jax.grad and jax.vmap"
        )


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor; got {type(value).__name__}")
    return value


def check_logits(name: str, logits: object) -> torch.Tensor:
    """``logits`` is a float32/float16/bfloat16 tensor ``[..., V]`` with ``V >= 1``."""
    logits = _require_tensor(name, logits)
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"`{name}` must be float32, float16 or bfloat16; got {logits.dtype}. "
            f"Cast it, e.g. `{name}.float()`"
        )
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"`{name}` must have shape [..., V] with a vocabulary axis V >= 1 last; "
            f"got shape {tuple(logits.shape)}"
        )
    return logits


def _check_lead_shape(name: str, value: torch.Tensor, lead: Tuple[int, ...]) -> None:
    if tuple(value.shape) != lead:
        raise ValueError(
            f"`{name}` must have the logits' leading shape {list(lead)} (one value per "
            f"token); got {list(value.shape)}"
        )


def check_ids(action_ids: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """``action_ids`` is an int64 or int32 tensor of the leading shape."""
    ids = _require_tensor("action_ids", action_ids)
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"`action_ids` must be int64 or int32; got {ids.dtype}. "
            "Cast it with `action_ids.long()`"
        )
    _check_lead_shape("action_ids", ids, lead)
    return ids


def check_mask(mask: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """``mask`` is a bool (or integer 0/1) tensor of the leading shape; returned as bool."""
    mask = _require_tensor("mask", mask)
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise TypeError(
            f"`mask` must be bool (or integer 0/1); got {mask.dtype}. "
            "Pass `mask.bool()` or `mask > 0`"
        )
    _check_lead_shape("mask", mask, lead)
    return mask if mask.dtype == torch.bool else mask != 0


def check_row_values(name: str, values: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """A per-token floating tensor (``old_logps``, ``ref_logps``) of the leading shape."""
    values = _require_tensor(name, values)
    if not values.dtype.is_floating_point:
        raise TypeError(
            f"`{name}` must be a floating tensor (float32 recommended); got {values.dtype}"
        )
    _check_lead_shape(name, values, lead)
    return values


def check_ref(policy_logits: torch.Tensor, lead: Tuple[int, ...],
              ref_logits: object, ref_logps: object) -> None:
    """Exactly one of ``ref_logits`` (the policy's shape) and ``ref_logps`` (``lead``)."""
    if (ref_logits is None) == (ref_logps is None):
        raise ValueError(
            "pass exactly one of `ref_logits` (reference-model logits [..., V]) and "
            "`ref_logps` (reference log-probs [...]); set the other to None"
        )
    if ref_logps is not None:
        check_row_values("ref_logps", ref_logps, lead)
        return
    check_logits("ref_logits", ref_logits)
    if ref_logits.shape != policy_logits.shape:
        raise ValueError(
            f"`ref_logits` must have the shape of `policy_logits` {list(policy_logits.shape)}; "
            f"got {list(ref_logits.shape)}"
        )


def check_temperature(temperature: object, lead: Tuple[int, ...]) -> Temperature:
    """A positive finite Python float, or a floating tensor of the leading shape (or 0-d).

    A tensor is not inspected here (that would synchronise): its entries are
    checked on active rows by :func:`check_active_ids` (the ``check_ids``
    host check) and, checked or not, :func:`poison_bad_temperature` makes a
    bad entry NaN so that its row is NaN on every backend.
    """
    if isinstance(temperature, torch.Tensor):
        if not temperature.dtype.is_floating_point:
            raise TypeError(
                f"`temperature` tensor must be floating; got {temperature.dtype}"
            )
        if temperature.dim() == 0:
            return temperature.expand(lead)
        _check_lead_shape("temperature", temperature, lead)
        return temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(
            "`temperature` must be a Python float or a tensor of the leading shape; "
            f"got {type(temperature).__name__}"
        )
    value = float(temperature)
    # Comparisons, not math.isfinite: they also trace under torch.compile(dynamic=True).
    if not 0.0 < value < math.inf:
        raise ValueError(f"`temperature` must be a positive finite number; got {value}")
    return value


def check_same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    """All given tensors live on one device; returns it (``ValueError`` otherwise)."""
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(
                f"`{name}` is on {t.device} but `{first_name}` is on {first.device}; "
                f"move it with `{name}.to({first_name}.device)`"
            )
    return first.device


def poison_bad_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """``temperature`` with every entry outside ``(0, inf)`` replaced by NaN (no sync).

    A zero, negative, infinite or NaN temperature has no valid softmax; as NaN
    it poisons its row (outputs and gradient) on every backend, while inactive
    rows replace their temperature with 1 before any arithmetic.
    """
    return torch.where(_valid_temperature(temperature), temperature,
                       torch.full_like(temperature, math.nan))


def _valid_temperature(temperature: torch.Tensor) -> torch.Tensor:
    return (temperature > 0) & (temperature < math.inf)


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
    one host sync there), whose output the caller reads as the mask (:attr:`mask`). The
    error names the first bad position (:func:`check_active_ids`).
    """

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, vocab_size: Optional[int],
                 temperature: Optional[Temperature] = None, *, one_launch: bool = False) -> None:
        self._args = (ids, mask, vocab_size, temperature)
        self._flags = self._event = None
        has_temp = isinstance(temperature, torch.Tensor)
        #: The mask the call's kernels read: ``mask``, or under ``torch.compile`` the
        #: checking op's copy of it.
        self.mask = mask
        if torch.compiler.is_compiling():
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
            from ratiokl.torch import _launch

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


def _bad_rows(ids: torch.Tensor, mask: torch.Tensor, vocab_size: Optional[int],
              temperature: Optional[Temperature]) -> dict:
    """``{argument: bool rows}`` of the active rows whose id / temperature is bad."""
    bad = {}
    if vocab_size is not None:
        bad["action_ids"] = mask & ((ids < 0) | (ids >= vocab_size))
    if isinstance(temperature, torch.Tensor):
        bad["temperature"] = mask & ~_valid_temperature(temperature)
    return bad


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


# --- policy_loss's per-token inputs -------------------------------------------------------


@dataclass(frozen=True)
class TokenInputs:
    """``policy_loss``'s per-token inputs, validated, detached, laid out ``[R, T]``."""

    old_logps: Optional[torch.Tensor]  # float32; None: on-policy
    advantages: torch.Tensor  # float32, broadcast over tokens
    segment_ids: Optional[torch.Tensor]  # integer
    importance_weights: Optional[torch.Tensor]  # float32
    loss_normalizer: Normalizer
    kl_entropy_normalizer: Normalizer = None  # the denominator of kl_agg / entropy_agg terms


def _check_advantages(advantages: object, lead: Tuple[int, ...]) -> torch.Tensor:
    """Per token ``[...]``, or per sequence ``lead[:-1]`` / ``lead[:-1] + [1]``; ``[R, T]`` out."""
    if not isinstance(advantages, torch.Tensor) or not advantages.dtype.is_floating_point:
        got = (advantages.dtype if isinstance(advantages, torch.Tensor)
               else type(advantages).__name__)
        raise TypeError(f"`advantages` must be a floating torch.Tensor (float32 recommended); "
                        f"got {got}. Cast it with `advantages.float()`")
    shape = tuple(advantages.shape)
    if shape != lead and not (lead and shape in (lead[:-1], lead[:-1] + (1,))):
        raise ValueError(
            f"`advantages` must have shape {list(lead)} (per token) or {list(lead[:-1])} "
            f"(per sequence); got {list(shape)}"
        )
    adv = advantages.detach().float()
    if shape != lead:
        adv = adv.reshape(lead[:-1] + (1,)).expand(lead)
    return as_rows(adv, lead)


def _check_normalizer(value: object, name: str = "loss_normalizer") -> Normalizer:
    """None, a positive finite Python number, or a 0-d floating tensor (not inspected)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not value.dtype.is_floating_point:
            raise ValueError(f"`{name}` tensor must be a 0-d floating tensor")
        return value.detach().float()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{name}` must be None, a Python number or a 0-d tensor")
    if not 0.0 < float(value) < math.inf:  # comparisons: they trace with dynamic=True
        raise ValueError(f"`{name}` must be a positive finite number; got {value}")
    return float(value)


def token_inputs(
    lead: Tuple[int, ...],
    old_logps: object,
    advantages: object,
    segment_ids: object,
    importance_weights: object,
    loss_normalizer: object,
    kl_entropy_normalizer: object = None,
) -> TokenInputs:
    """Validate ``policy_loss``'s per-token arguments (errors name the argument);
    ``old_logps`` None (on-policy) stays None."""
    old = None if old_logps is None else check_row_values("old_logps", old_logps, lead)
    weights = None
    if importance_weights is not None:
        weights = check_row_values("importance_weights", importance_weights, lead)
        weights = as_rows(weights.detach().float(), lead)
    segs = None
    if segment_ids is not None:
        if not isinstance(segment_ids, torch.Tensor) or segment_ids.dtype.is_floating_point \
                or segment_ids.dtype.is_complex or segment_ids.dtype == torch.bool:
            raise TypeError("`segment_ids` must be an integer torch.Tensor (e.g. int32)")
        if tuple(segment_ids.shape) != lead:
            raise ValueError(
                f"`segment_ids` must have the leading shape {list(lead)}; "
                f"got {list(segment_ids.shape)}"
            )
        segs = as_rows(segment_ids, lead)
    return TokenInputs(
        old_logps=None if old is None else as_rows(old.detach().float(), lead),
        advantages=_check_advantages(advantages, lead),
        segment_ids=segs,
        importance_weights=weights,
        loss_normalizer=_check_normalizer(loss_normalizer),
        kl_entropy_normalizer=_check_normalizer(kl_entropy_normalizer, "kl_entropy_normalizer"),
    )
