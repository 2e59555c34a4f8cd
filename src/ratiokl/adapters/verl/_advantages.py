"""ratiokl's advantage estimators in verl's registry, as ``ratiokl_<verl name>``.

``algorithm.adv_estimator=ratiokl_grpo`` (and the others below) runs
:mod:`ratiokl.torch.advantages` where verl runs its own estimator: one vectorised pass
instead of verl's Python loop over the batch, the same numbers (the docs' table says
which option reproduces which estimator), padding kept out by construction. verl hands a
registered estimator ``token_level_rewards``, ``response_mask``, ``index`` (the ``uid``
of each sample's prompt) and the ``AlgoConfig``; each returns ``(advantages, returns)``
``[B, T]`` as verl's do.

Not registered: ``gae`` (verl's trainer passes a registered estimator neither the values
nor ``gamma`` / ``lam`` apart from the config, so a plug-in cannot replace it: call
:func:`ratiokl.torch.advantages.gae` where the trainer calls
``compute_gae_advantage_return``), ``remax`` (no group statistic: verl's own is already
one vectorised line) and the optimal-token-baseline pair (verl's trainer hands
``sum_pi_squared`` and ``old_log_probs`` to its own two names only: call
:func:`ratiokl.torch.advantages.optimal_token_baseline` where it calls them).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch
from verl.trainer.ppo import core_algos

from ratiokl.torch import advantages

__all__ = ["ESTIMATORS", "register"]

Tensor = torch.Tensor


def _option(config: Any, name: str, default: Any) -> Any:
    return default if config is None else config.get(name, default)


def _scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tuple[Tensor, Tensor]:
    """Each sequence's score (its rewards summed over its response tokens only) and the
    bool mask."""
    mask = response_mask != 0
    return torch.where(mask, token_level_rewards.float(), 0.0).sum(-1), mask


def _group_ids(index: Any, device: torch.device) -> Tensor:
    """verl's ``index`` (strings, or any hashable values) as integer group ids."""
    return torch.from_numpy(np.unique(np.asarray(index), return_inverse=True)[1].reshape(-1)
                            ).to(device)


def _outcome(estimate: Callable[..., Tensor]) -> Callable[..., Tuple[Tensor, Tensor]]:
    """A verl estimator from ``estimate(scores, ids, mask, config, epsilon)`` -> ``[B]``."""
    def estimator(token_level_rewards: Tensor, response_mask: Tensor, index: Any = None,
                  epsilon: float = 1e-6, config: Optional[Any] = None,
                  **_: Any) -> Tuple[Tensor, Tensor]:
        scores, mask = _scores(token_level_rewards, response_mask)
        ids = _group_ids(index, scores.device)
        adv = advantages.spread(estimate(scores, ids, mask, config, epsilon), mask)
        return adv, adv
    return estimator


def _grpo(scores, ids, mask, config, epsilon):
    norm = _option(config, "norm_adv_by_std_in_grpo", True)
    return advantages.grpo(scores, ids, eps=epsilon, scale="group" if norm else "none")


def _passk(scores, ids, mask, config, epsilon):
    norm = _option(config, "norm_adv_by_std_in_grpo", True)
    return advantages.grpo_passk(scores, ids, eps=epsilon, scale="group" if norm else "none")


def _baseline(scores, ids, mask, config, epsilon):
    return advantages.reinforce_pp_baseline(scores, ids, lengths=mask.sum(-1))


def _gdpo(scores, ids, mask, config, epsilon):
    """verl's ``gdpo`` without ``gdpo_reward_keys`` (one score: the summed rewards)."""
    return advantages.gdpo(scores[:, None], ids, eps=epsilon, lengths=mask.sum(-1))


def _reinforce_pp(token_level_rewards: Tensor, response_mask: Tensor,
                  config: Optional[Any] = None, **_: Any) -> Tuple[Tensor, Tensor]:
    return advantages.reinforce_pp(token_level_rewards, response_mask != 0,
                                   float(_option(config, "gamma", 1.0)))


#: verl's estimator name -> ratiokl's, registered as ``ratiokl_<name>``.
ESTIMATORS: Dict[str, Callable[..., Tuple[Tensor, Tensor]]] = {
    "grpo": _outcome(_grpo),
    "grpo_passk": _outcome(_passk),
    "gdpo": _outcome(_gdpo),
    "rloo": _outcome(lambda s, ids, m, c, e: advantages.rloo(s, ids)),
    "rloo_vectorized": _outcome(lambda s, ids, m, c, e: advantages.rloo(s, ids,
                                                                        singleton="zero")),
    "opo": _outcome(lambda s, ids, m, c, e: advantages.opo(s, ids, lengths=m.sum(-1))),
    "gpg": _outcome(lambda s, ids, m, c, e: advantages.gpg(s, ids)),
    "reinforce_plus_plus_baseline": _outcome(_baseline),
    "reinforce_plus_plus": _reinforce_pp,
}


def register() -> None:
    """Register every estimator of :data:`ESTIMATORS` with verl's ``register_adv_est``
    (done once, when this module is imported)."""
    for name, estimator in ESTIMATORS.items():
        core_algos.register_adv_est(f"ratiokl_{name}")(estimator)


register()
