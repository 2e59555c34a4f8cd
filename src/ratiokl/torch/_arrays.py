"""PyTorch's array adapter for the framework-neutral core (:mod:`ratiokl._core`).

:data:`XP` offers the operations the core's docstring lists, as PyTorch ops on tensors of
any device (traced by ``torch.compile``; nothing synchronises with the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["XP"]


class _Torch:
    """The adapter (static methods only: one shared instance, :data:`XP`)."""

    where = staticmethod(torch.where)
    exp = staticmethod(torch.exp)
    expm1 = staticmethod(torch.expm1)
    isinf = staticmethod(torch.isinf)
    stack = staticmethod(torch.stack)
    zeros_like = staticmethod(torch.zeros_like)
    ones_like = staticmethod(torch.ones_like)
    stop_gradient = staticmethod(torch.Tensor.detach)

    @staticmethod
    def sum(x, axis=None, keepdims=False):
        return x.sum() if axis is None else x.sum(dim=axis, keepdim=keepdims)

    @staticmethod
    def maximum(x, floor):
        return x.clamp(min=floor)

    @staticmethod
    def clip(x, low, high):
        return x.clamp(low, high)

    @staticmethod
    def count(mask):
        return mask.sum()

    @staticmethod
    def as_float(x):
        return x.float()

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


XP = _Torch()
