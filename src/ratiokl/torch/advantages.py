"""PyTorch advantage estimators: ``from ratiokl.torch import advantages``.

Signatures only: each function is one call into ``ratiokl._core.advantage_route``
(written once for both frameworks) with this binding's array adapter; GAE's scan is this
binding's own (:func:`_scan`: the Triton kernel or a scan of whole-tensor ops). The
docstrings are ``ratiokl._docs.advantages``'s, rendered for PyTorch.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ratiokl._core import advantage_route as _route
from ratiokl._core import advantages as _math
from ratiokl._docs.advantages import documented
from ratiokl.spec import BackendName
from ratiokl.spec.advantages import GroupScale, GroupStd, Singleton, Whitening
from ratiokl.spec.token_baselines import Align
from ratiokl.torch._arrays import XP
from ratiokl.torch._route import backend_name

__all__ = ["gae", "gdpo", "gpg", "grpo", "grpo_passk", "opo", "optimal_token_baseline",
           "reinforce_pp", "reinforce_pp_baseline", "rloo", "spread"]

Tensor = torch.Tensor
_documented = documented("torch")


@_documented
def grpo(scores: Tensor, group_ids: Optional[Tensor] = None, *,
         group_size: Optional[int] = None, valid: Optional[Tensor] = None,
         std: GroupStd = "unbiased", scale: GroupScale = "group", eps: float = 1e-6,
         singleton: Singleton = "score") -> Tensor:
    with torch.no_grad():
        return _route.grpo(XP, scores, group_ids, group_size=group_size, valid=valid, std=std,
                           scale=scale, eps=eps, singleton=singleton)


@_documented
def rloo(scores: Tensor, group_ids: Optional[Tensor] = None, *,
         group_size: Optional[int] = None, valid: Optional[Tensor] = None,
         singleton: Singleton = "score") -> Tensor:
    with torch.no_grad():
        return _route.rloo(XP, scores, group_ids, group_size=group_size, valid=valid,
                           singleton=singleton)


@_documented
def reinforce_pp_baseline(scores: Tensor, group_ids: Optional[Tensor] = None, *,
                          group_size: Optional[int] = None, valid: Optional[Tensor] = None,
                          lengths: Optional[Tensor] = None, whiten: Whitening = "unbiased",
                          singleton: Singleton = "score") -> Tensor:
    with torch.no_grad():
        return _route.reinforce_pp_baseline(XP, scores, group_ids, group_size=group_size,
                                            valid=valid, lengths=lengths, whiten=whiten,
                                            singleton=singleton)


@_documented
def opo(scores: Tensor, group_ids: Optional[Tensor] = None, *,
        group_size: Optional[int] = None, valid: Optional[Tensor] = None,
        lengths: Optional[Tensor] = None) -> Tensor:
    with torch.no_grad():
        return _route.opo(XP, scores, group_ids, group_size=group_size, valid=valid,
                          lengths=lengths)


@_documented
def grpo_passk(scores: Tensor, group_ids: Optional[Tensor] = None, *,
               group_size: Optional[int] = None, valid: Optional[Tensor] = None,
               std: GroupStd = "unbiased", scale: GroupScale = "group",
               eps: float = 1e-6) -> Tensor:
    with torch.no_grad():
        return _route.grpo_passk(XP, scores, group_ids, group_size=group_size, valid=valid,
                                 std=std, scale=scale, eps=eps)


@_documented
def gpg(scores: Tensor, group_ids: Optional[Tensor] = None, *,
        group_size: Optional[int] = None, valid: Optional[Tensor] = None,
        f_norm: float = 1.0) -> Tensor:
    with torch.no_grad():
        return _route.gpg(XP, scores, group_ids, group_size=group_size, valid=valid,
                          f_norm=f_norm)


@_documented
def gdpo(scores: Tensor, group_ids: Optional[Tensor] = None, *,
         group_size: Optional[int] = None, valid: Optional[Tensor] = None,
         weights: Optional[Sequence[float]] = None, std: GroupStd = "unbiased",
         eps: float = 1e-6, singleton: Singleton = "score", lengths: Optional[Tensor] = None,
         whiten: Whitening = "unbiased") -> Tensor:
    with torch.no_grad():
        return _route.gdpo(XP, scores, group_ids, group_size=group_size, valid=valid,
                           weights=weights, std=std, eps=eps, singleton=singleton,
                           lengths=lengths, whiten=whiten)


def _scan(backend: str):
    """The raw ``(advantages, returns)`` of GAE's recursion for ``backend`` (resolved on
    the inputs' device): the Triton kernel, or :func:`_math.reverse_scan`."""
    def scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float):
        if backend_name(backend, rewards.device) == "native":
            elements = _math.gae_elements(XP, rewards, values, mask, gamma, lam)
            adv = torch.where(mask, _math.reverse_scan(XP, elements)[3], 0.0)
            return adv, torch.where(mask, adv + torch.where(mask, values.float(), 0.0), 0.0)
        from ratiokl.torch._launch.gae import GAE  # imports triton: only when a kernel backend runs

        as_rows = lambda x: x.float().contiguous()  # noqa: E731 (column stride 1)
        return GAE(as_rows(rewards), as_rows(values), mask.contiguous(), gamma, lam)
    return scan


@_documented
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float, *,
        whiten: Whitening = "unbiased", backend: BackendName = "auto") -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        return _route.gae(XP, _scan(backend), rewards, values, mask, gamma, lam, whiten=whiten)


@_documented
def reinforce_pp(rewards: Tensor, mask: Tensor, gamma: float, *,
                 whiten: Whitening = "unbiased",
                 backend: BackendName = "auto") -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        return _route.reinforce_pp(XP, _scan(backend), rewards, mask, gamma, whiten=whiten)


@_documented
def optimal_token_baseline(rewards: Tensor, mask: Tensor, old_logps: Tensor,
                           sum_pi_squared: Tensor, group_ids: Optional[Tensor] = None, *,
                           group_size: Optional[int] = None, valid: Optional[Tensor] = None,
                           is_weights: Optional[Tensor] = None, align: Align = "position",
                           zero_tail: bool = True, eps: float = 1e-8,
                           backend: BackendName = "auto") -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        return _route.optimal_token_baseline(
            XP, _scan(backend), rewards, mask, old_logps, sum_pi_squared, group_ids,
            group_size=group_size, valid=valid, is_weights=is_weights, align=align,
            zero_tail=zero_tail, eps=eps)


@_documented
def spread(advantages: Tensor, mask: Tensor) -> Tensor:
    return _route.spread(XP, advantages, mask)
