"""Per-token ratio and KL from per-token log-probs: ``[N]``-sized framework ops.

Shared by every PyTorch backend that produces ``logp`` first and leaves the
per-token epilogue to autograd (the math is in ``ratiokl.torch.loss.ratio_kl``).
Inactive rows' inputs are replaced with neutral values *before* any
arithmetic, so a NaN ``old_logp`` or ``logp_ref`` on an inactive row never
sits in an untaken ``torch.where`` branch whose gradient would be ``0 * NaN``.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["ratio_kl"]


def _kl(d: torch.Tensor, kl_code: int) -> torch.Tensor:
    """Schulman's estimator on ``d = logp_ref - logp`` (codes from ``ratiokl.spec``)."""
    if kl_code == 1:
        return -d
    if kl_code == 2:
        return 0.5 * d * d
    return torch.expm1(d) - d


def ratio_kl(
    logp: torch.Tensor,
    logp_ref: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    kl_code: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ratio, kl)`` float32 ``[N]`` from float32 ``[N]`` log-probs and a bool mask.

    Differentiable through ``logp`` only (the caller passes the others
    detached). Inactive rows: ``ratio = 1``, ``kl = 0``, zero gradient.
    """
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(mask, logp, zero)
    logp_ref = torch.where(mask, logp_ref.float(), zero)
    old = torch.where(mask, old_logps.float(), zero)
    ratio = torch.exp(logp - old)
    kl = _kl(logp_ref - logp, kl_code)
    return torch.where(mask, ratio, zero + 1.0), torch.where(mask, kl, zero)
