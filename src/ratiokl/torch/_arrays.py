"""PyTorch's array adapter for the framework-neutral core (:mod:`ratiokl._core`).

:data:`XP` offers the operations the core's docstring lists, as PyTorch ops on tensors of
any device (traced by ``torch.compile``; nothing synchronises with the host), and the
route's hooks (:mod:`ratiokl._core.route`) and validation's questions
(:mod:`ratiokl._core.checks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ratiokl.spec import LOGIT_DTYPE_NAMES
from ratiokl.torch import _once
from ratiokl.torch._lm_head import head_logits

__all__ = ["XP", "XP64"]


class _Torch:
    """The adapter, one instance per compute dtype: :data:`XP` (float32, every logits dtype
    but float64) and :data:`XP64` (float64 logits or log-probs, the native backend);
    :meth:`for_dtype` picks one from an input's dtype."""

    def __init__(self, float_dtype: torch.dtype) -> None:
        #: The dtype ``as_float`` and ``flat`` give: the op's compute dtype.
        self.float_dtype = float_dtype

    @staticmethod
    def for_dtype(dtype) -> "_Torch":
        """:data:`XP64` for float64 inputs, else :data:`XP` (float32 math)."""
        return XP64 if dtype == torch.float64 else XP

    where = staticmethod(torch.where)
    exp = staticmethod(torch.exp)
    expm1 = staticmethod(torch.expm1)
    #: ``exp`` of a temporary nobody reads afterwards: in place (one ``[rows, V]`` float32
    #: buffer fewer at the native path's peak).
    exp_temporary = staticmethod(torch.Tensor.exp_)
    #: ``x - y`` and ``maximum(x, floor)`` of a temporary ``x``: in place, likewise.
    sub_temporary = staticmethod(torch.Tensor.sub_)
    isinf = staticmethod(torch.isinf)
    stack = staticmethod(torch.stack)
    zeros_like = staticmethod(torch.zeros_like)
    ones_like = staticmethod(torch.ones_like)
    stop_gradient = staticmethod(torch.Tensor.detach)
    isfinite = staticmethod(torch.isfinite)
    log = staticmethod(torch.log)

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdims)

    @staticmethod
    def max(x, axis):
        return x.amax(dim=axis)

    @staticmethod
    def maximum(x, floor):
        return x.clamp(min=floor)

    @staticmethod
    def maximum_temporary(x, floor):
        return x.clamp_(min=floor)

    @staticmethod
    def exp_sums(d):
        # Products and sums, never ``linalg.vecdot``: autocast would run that in bfloat16.
        e = torch.exp(d)
        return e.sum(dim=-1), e.mul_(d).sum(dim=-1)

    @staticmethod
    def clip(x, low, high):
        return x.clamp(low, high)

    @staticmethod
    def count(mask):
        return mask.sum()

    def as_float(self, x):
        return x.to(self.float_dtype)

    @staticmethod
    def as_index(x):
        return x.long()

    @staticmethod
    def broadcast_to(x, shape):
        return x.expand(shape)

    @staticmethod
    def positions(like):
        return torch.arange(like.shape[-1], device=like.device).expand(like.shape)

    @staticmethod
    def cummax(x):
        return torch.cummax(x, dim=-1).values

    @staticmethod
    def reverse_cummin(x):
        return x.flip(-1).cummin(dim=-1).values.flip(-1)

    @staticmethod
    def shift(x, step: int, fill):
        if step > 0:
            return F.pad(x[..., :-step], (step, 0), value=fill)
        return F.pad(x[..., -step:], (0, -step), value=fill)

    @staticmethod
    def take(x, index):
        return torch.gather(x, -1, index)

    # --- groups of samples (ratiokl._core.advantages) -------------------------------------

    @staticmethod
    def argsort(x):
        return torch.argsort(x, stable=True)

    @staticmethod
    def cumsum(x):
        return torch.cumsum(x, dim=-1)

    @staticmethod
    def unpermute(values, order):
        """``out[order] = values``."""
        return torch.empty_like(values).scatter_(0, order, values)

    @staticmethod
    def gather(table, index):
        """``table[index]`` along the first axis."""
        return table[index]

    def flat(self, values):
        """A detached, contiguous ``[N]`` view (or copy) in the compute dtype of a per-token
        tensor; None passes through. Contiguous: the kernels read row ``i`` at ``i`` (an
        expanded input, such as per-sequence advantages broadcast over one sequence,
        flattens to stride 0)."""
        if values is None:
            return None
        return values.detach().reshape(-1).to(self.float_dtype).contiguous()

    # --- the route's hooks (ratiokl._core.route.loss_step) ---------------------------------

    no_grad = staticmethod(torch.no_grad)
    compiling = staticmethod(torch.compiler.is_compiling)
    #: ``inplace_grad``: the launch consumes the logits, so the host check is read first.
    check_before_inplace = True

    @staticmethod
    def compiled_backward(logits: torch.Tensor) -> bool:
        """Whether ``torch.compile`` traces a gradient of ``logits``: then the two passes.

        The fused kernel stores the gradient in the forward and the backward scales it in
        place; AOTAutograd's backward graph gets the stored gradient as an input, which
        functionalization copies before the in-place scale (on the H200 the compiled
        fused step took 1.72x the eager one: an extra read and write of the ``[N, V]``
        gradient). The two-pass backward writes a new gradient, nothing to copy.
        """
        return (torch.compiler.is_compiling() and torch.is_grad_enabled()
                and logits.requires_grad)

    @staticmethod
    def head_logits(hidden, mask, weight, bias, transform):
        """Every row's logits ``[N, V]`` from ``hidden [N, H]`` (``ratiokl.torch._lm_head``),
        inactive rows' hidden states zeroed (the GEMMs in float32 for float32 inputs)."""
        kept = torch.where(mask[:, None], hidden,
                           torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        return head_logits(kept, weight, bias, transform)

    def once(self, loss: torch.Tensor, op: str) -> torch.Tensor:
        """``loss``, whose graph refuses a second backward (``ratiokl.torch._once``), as the
        one-kernel loss does; in float64 ``loss`` itself: float64 runs on the native backend
        only, whose two passes backpropagate any number of times (``gradcheck`` runs
        several backwards through one graph)."""
        if self.float_dtype == torch.float64:
            return loss
        return _once.backward_once(loss, op)

    # --- validation's questions (ratiokl._core.checks) -----------------------------------

    array_type, any_array, noun = "torch.Tensor", "a torch.Tensor", "tensor"
    logit_dtypes = tuple(getattr(torch, name) for name in LOGIT_DTYPE_NAMES)
    #: The logits dtype only the native backend takes (computed in float64).
    wide_dtype = torch.float64
    id_dtype_names = ("int64", "int32")
    id_dtypes = (torch.int64, torch.int32)
    casts = {"float": "{}.float()", "ids": "{}.long()", "bool": "{}.bool()"}

    @staticmethod
    def is_array(value) -> bool:
        return isinstance(value, torch.Tensor)

    @staticmethod
    def as_array(x):
        return x

    @staticmethod
    def is_floating(dtype) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def is_integer(dtype) -> bool:
        return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)

    @staticmethod
    def is_bool(dtype) -> bool:
        return dtype == torch.bool

    @staticmethod
    def same_device(**tensors) -> torch.device:
        """The one device the given tensors (None skipped) live on; ``ValueError`` naming
        the first that differs (``ratiokl.torch._checks.check_same_device``)."""
        named = [(name, t) for name, t in tensors.items() if t is not None]
        first_name, first = named[0]
        for name, t in named[1:]:
            if t.device != first.device:
                raise ValueError(
                    f"`{name}` is on {t.device} but `{first_name}` is on {first.device}; "
                    f"move it with `{name}.to({first_name}.device)`"
                )
        return first.device


XP = _Torch(torch.float32)
XP64 = _Torch(torch.float64)
