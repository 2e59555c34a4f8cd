"""verl's policy losses ``"ratiokl"``, ``"ratiokl_gspo"`` and ``"ratiokl_cispo"``.

Each is a ``core_algos.PolicyLossFn``: verl's ``workers/utils/losses.ppo_loss`` (the model
engine's loss step) calls it with the padded ``[B, T]`` log-probs of the responses and
the actor config, and adds the entropy bonus and the KL loss itself afterwards (0.9.1's
``PolicyLossFn`` sees neither the entropies nor the reference log-probs). The loss is
:func:`ratiokl.torch.loss.policy_objective` with the options :func:`loss_options` maps
from the ``ActorConfig`` and the denominator :func:`loss_normalizer` takes from the
engine's global batch info, so the value and the gradient w.r.t. ``log_prob`` are those
of verl's ``vanilla``, ``gspo`` and ``cispo`` losses (``tests/adapters/test_verl_adapter.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Literal, Mapping, NoReturn, Optional, Tuple, Union

import torch

from ratiokl.adapters import refuse
from ratiokl.torch.loss import policy_objective

__all__ = ["LOSS_NAMES", "loss_normalizer", "loss_options", "make_policy_loss"]

Variant = Literal["ppo", "gspo", "cispo"]
#: The names registered with ``core_algos.register_policy_loss`` (the value of
#: ``actor_rollout_ref.actor.policy_loss.loss_mode``) and the verl loss each one matches.
LOSS_NAMES: Dict[str, Variant] = {"ratiokl": "ppo", "ratiokl_gspo": "gspo",
                                  "ratiokl_cispo": "cispo"}
_AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
         "seq-mean-token-sum-norm")
#: verl's GSPO clamps the sequence log-ratio at +10 (``compute_policy_loss_gspo``).
GSPO_LOG_RATIO_BOUND = 10.0
_ACTOR = "actor_rollout_ref.actor"
#: verl's clip metrics and the ratiokl metric each one is.
_METRICS = {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "approx_kl",
            "actor/pg_clipfrac_lower": "dual_clip_fraction"}


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse("ratiokl.adapters.verl", "verl's own loss_mode", f"{_ACTOR}.{field}", value, why)


def loss_options(config: Any, variant: Variant, loss_agg_mode: str) -> Dict[str, Any]:
    """The :func:`~ratiokl.torch.loss.policy_objective` options of a verl ``ActorConfig``
    (or its ``DictConfig``) for one of verl's policy losses, those fixed for the run.

    ``clip_ratio_low`` / ``clip_ratio_high`` (each ``clip_ratio`` when None) are
    ``clip_eps`` / ``clip_eps_high``; ``"ppo"`` (verl's ``vanilla``) adds its always-on
    dual clip ``clip_ratio_c`` (default 3.0); ``"gspo"`` is ``ratio_level="sequence"``
    with the log-ratio bounded at ``10`` (verl bounds it at ``+10`` only); ``"cispo"`` is
    ``objective="cispo"``. ``ValueError`` naming the field for a ``loss_agg_mode`` verl
    does not define or a ``clip_ratio_c`` not above 1 (verl asserts both).
    """
    if loss_agg_mode not in _AGGS:
        _refuse("loss_agg_mode", loss_agg_mode, f"verl defines {list(_AGGS)}")
    clip = config.clip_ratio
    low = clip if config.clip_ratio_low is None else config.clip_ratio_low
    high = clip if config.clip_ratio_high is None else config.clip_ratio_high
    options: Dict[str, Any] = dict(clip_eps=float(low), clip_eps_high=float(high),
                                   loss_agg=loss_agg_mode)
    if variant == "ppo":
        dual = config.get("clip_ratio_c", 3.0)
        if not dual > 1.0:
            _refuse("clip_ratio_c", dual, "the dual clip bounds the ratio from above and "
                    "must be greater than 1 (verl's vanilla loss asserts it)")
        options["dual_clip"] = float(dual)
    elif variant == "gspo":
        options.update(ratio_level="sequence", log_ratio_bound=GSPO_LOG_RATIO_BOUND)
    else:
        options["objective"] = "cispo"
    return options


def loss_normalizer(loss_agg_mode: str, info: Mapping[str, Any],
                    mask: torch.Tensor) -> Union[float, torch.Tensor]:
    """The denominator ``D`` of verl's ``agg_loss`` for this micro-batch.

    ``info`` is ``config.global_batch_info`` (set by ``ppo_loss`` from the engine:
    ``dp_size``, ``batch_num_tokens`` over every rank, ``global_batch_size`` and
    ``loss_scale_factor``; empty or None entries take ``agg_loss``'s defaults, computed
    from ``mask``, bool ``[B, T]``): ``token-mean`` ``batch_num_tokens / dp_size``,
    ``token-sum`` ``1 / dp_size``, ``seq-mean-token-mean`` / ``-token-sum``
    ``global_batch_size / dp_size``, ``seq-mean-token-sum-norm`` the same times
    ``loss_scale_factor`` (default ``T``). Without ``batch_num_tokens`` (token-mean) or
    ``global_batch_size`` (the sequence modes) and ``dp_size > 1``: ``ValueError``, as in
    verl.
    """
    dp = info.get("dp_size") or 1
    if loss_agg_mode == "token-sum":
        return 1.0 / dp
    key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    count = info.get(key)
    if count is None:
        if dp > 1:
            raise ValueError(f"ratiokl.adapters.verl: loss_agg_mode={loss_agg_mode!r} with "
                             f"dp_size={dp} needs the global `{key}` in "
                             "config.global_batch_info (verl's ppo_loss sets it)")
        count = mask.sum() if key == "batch_num_tokens" else mask.any(-1).sum()
    denominator = count / dp
    if loss_agg_mode == "seq-mean-token-sum-norm":
        denominator = denominator * (info.get("loss_scale_factor") or mask.shape[-1])
    return denominator


def _verl_metrics(metrics: Mapping[str, torch.Tensor]) -> Dict[str, float]:
    """ratiokl's metrics under the names verl's losses log, as Python floats like verl's
    (one host synchronisation; ``pg_clipfrac_lower`` is 0 for GSPO and CISPO, which have
    no dual clip)."""
    values = torch.stack([metrics[k] for k in _METRICS.values()]).tolist()
    return dict(zip(_METRICS, values))


PolicyLossFn = Callable[..., Tuple[torch.Tensor, Dict[str, float]]]


def make_policy_loss(variant: Variant) -> PolicyLossFn:
    """verl's ``PolicyLossFn`` for ``variant`` through ``policy_objective``."""

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor,
                    advantages: torch.Tensor, response_mask: torch.Tensor,
                    loss_agg_mode: str = "token-mean", config: Optional[Any] = None,
                    rollout_is_weights: Optional[torch.Tensor] = None,
                    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        """ratiokl's policy loss on verl's ``[B, T]`` log-probs (``log_prob`` with
        autograd; ``old_log_prob``, per-token ``advantages``, the rollout-correction
        ``rollout_is_weights`` detached; ``response_mask`` bool). Returns the float32
        0-d loss and verl's three clip metrics (Python floats). Padded positions
        (``response_mask`` False) reach neither the loss nor a gradient, whatever they
        hold."""
        if config is None:
            raise ValueError("ratiokl.adapters.verl: the policy loss needs the actor "
                             "`config` (verl's ppo_loss passes it)")
        mask = response_mask.bool()
        options = loss_options(config, variant, loss_agg_mode)
        info = getattr(config, "global_batch_info", None) or {}
        normalizer = loss_normalizer(loss_agg_mode, info, mask)
        loss, metrics = policy_objective(
            log_prob, old_log_prob, advantages, mask, importance_weights=rollout_is_weights,
            loss_normalizer=normalizer, **options)
        return loss, _verl_metrics(metrics)

    policy_loss.__name__ = policy_loss.__qualname__ = f"ratiokl_{variant}_policy_loss"
    return policy_loss
