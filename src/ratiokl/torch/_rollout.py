"""The rollout correction in PyTorch: the arguments checked, then the framework-neutral
weights of ``ratiokl._core.rollout`` (``ratiokl.spec.rollout`` has the formulas) on
PyTorch's array adapter, or a backend's one launch (``Backend.rollout_weights``: the
Triton backends compute the weights and the metrics in one kernel)."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch

from ratiokl._core import rollout as _core
from ratiokl._core.sequences import as_rows
from ratiokl.spec import RolloutOptions
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import TokenInputs, check_row_values, check_same_device

__all__ = ["correct"]


def correct(mask: torch.Tensor, lead: Tuple[int, ...], inputs: TokenInputs,
            rollout_logps: torch.Tensor, opts: RolloutOptions, log_ratio_bound: Optional[float],
            launch: Optional[Callable] = None) -> Tuple[TokenInputs, Dict[str, torch.Tensor]]:
    """``inputs`` with the rollout weight folded into ``importance_weights``, and the
    rollout metrics (``ratiokl._core.rollout.correct``).

    ``mask``: the flattened bool ``[N]`` mask; ``lead``: the leading shape ``[...]``;
    ``opts``: ``spec.rollout_options`` of the call (called only where that is not None,
    i.e. where ``rollout_logps`` is given); ``launch``: the backend's ``rollout_weights``
    or None.
    """
    rollout = check_row_values("rollout_logps", rollout_logps, lead)
    check_same_device(mask=mask, rollout_logps=rollout)
    return _core.correct(XP, as_rows(mask, lead), inputs,
                         as_rows(rollout.detach().float(), lead), opts, log_ratio_bound, launch)
