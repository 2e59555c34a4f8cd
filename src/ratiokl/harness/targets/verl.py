"""verl's own policy loss as a check target (verl 0.9.1; ``pip install 'ratiokl[verl]'``).

``ratiokl check --target ratiokl.harness.targets.verl:TARGET`` runs the fixtures'
``policy_loss`` and ``policy_objective`` cases through ``verl.trainer.ppo.core_algos``:
the configured policy loss (``get_policy_loss_fn``: ``vanilla``, ``gspo``, ``cispo``), then
``- entropy_coeff * agg_loss(entropy)`` and ``+ kl_loss_coef * agg_loss(kl_penalty(...))``,
as ``verl.workers.utils.losses.ppo_loss`` composes them. From logits, the log-probs and
entropies come from ``verl.utils.torch_functional`` on float32 logits divided by the
temperature; those alone are the ``selected_logprobs`` cases, and with ``kl_penalty`` the
``ratio_kl`` ones. The option mapping (:data:`OPTIONS`) is this module's only knowledge
of verl.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from ratiokl.harness._protocol import TargetCall, TargetResult
from ratiokl.harness.targets import _torch
from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND

__all__ = ["NAN_PADDED", "OPTIONS", "TARGET", "VerlTarget"]

#: ratiokl option -> the ``ActorConfig`` field it sets (the rest: :func:`_refusal`).
OPTIONS = {
    "clip_eps": "clip_ratio_low (and clip_ratio)",
    "clip_eps_high": "clip_ratio_high (None: clip_eps)",
    "dual_clip": "clip_ratio_c (None: inf, as verl always applies its dual clip, default 3)",
    "loss_agg": "loss_agg_mode (the same five names)",
    "loss_normalizer": "global_batch_info: batch_num_tokens (token-mean) or "
                       "global_batch_size (seq-mean-*; -norm: loss_scale_factor, size 1)",
    "ratio_level": "policy_loss.loss_mode = 'gspo' for 'sequence'",
    "objective": "policy_loss.loss_mode = 'cispo' for 'cispo'",
    "importance_weights": "rollout_is_weights",
    "kl_coef / kl_estimator": "use_kl_loss, kl_loss_coef, kl_loss_type (k1, k2, k3, k1+, k3+)",
    "entropy_coef": "entropy_coeff",
    "old_logps=None": "old_log_prob = log_prob.detach() (on-policy)",
}

_KL_TYPES = {"k1": "k1", "k2": "k2", "k3": "k3", "k1+": "k1+", "k3+": "k3+"}
#: The fixture ops this target runs: the loss, the actor's per-token values, and kl_penalty.
_OPS = _torch.POLICY_OPS + _torch.TOKEN_OPS


def _refusal(call: TargetCall) -> Optional[str]:
    """Why verl cannot express ``call``'s options, or None."""
    reason = _torch.refusal(call, "verl", _OPS)
    if reason is not None or call.op in _torch.TOKEN_OPS:
        return reason
    if call.option("ratio_cap") is not None:
        return "verl has no ratio_cap"
    if call.option("kl_estimator", "k3") not in _KL_TYPES and call.option("kl_coef", 0.0):
        return f"verl has no kl_loss_type for kl_estimator={call.option('kl_estimator')!r}"
    if call.option("log_ratio_bound", DEFAULT_LOG_RATIO_BOUND) != DEFAULT_LOG_RATIO_BOUND:
        return "verl's log-ratio clamp is fixed at 20 (log_ratio_bound)"
    if call.option("objective") == "sapo":
        return "verl's loss_mode 'sapo' is not mapped here"
    if call.option("objective") == "cispo" and call.option("ratio_level") == "sequence":
        return "verl has no sequence-level CISPO"
    return None


def _config(call: TargetCall, n_seq: int):
    """verl's ``ActorConfig`` for ``call``'s options (:data:`OPTIONS`) and its
    ``policy_loss.loss_mode``."""
    from verl.workers.config import ActorConfig

    eps = float(call.option("clip_eps", 0.2))
    high = call.option("clip_eps_high")
    dual = call.option("dual_clip")
    mode = ("cispo" if call.option("objective") == "cispo"
            else "gspo" if call.option("ratio_level") == "sequence" else "vanilla")
    kl_coef = float(call.option("kl_coef", 0.0))
    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio=eps, clip_ratio_low=eps, clip_ratio_high=eps if high is None else float(high),
        clip_ratio_c=math.inf if dual is None else float(dual),
        loss_agg_mode=call.option("loss_agg", "token-mean"),
        entropy_coeff=float(call.option("entropy_coef", 0.0)),
        use_kl_loss=kl_coef != 0.0, kl_loss_coef=kl_coef,
        kl_loss_type=_KL_TYPES.get(call.option("kl_estimator", "k3"), "k3"),
    )
    config.global_batch_info.update(_global_batch_info(call, n_seq))
    return config, mode


def _global_batch_info(call: TargetCall, n_seq: int) -> Dict[str, Any]:
    """``agg_loss``'s denominators for ``loss_normalizer`` (verl's defaults without it)."""
    normalizer = call.option("loss_normalizer")
    info: Dict[str, Any] = {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None,
                            "loss_scale_factor": None}
    mode = call.option("loss_agg", "token-mean")
    if normalizer is None:
        return info
    if mode == "token-mean":
        info["batch_num_tokens"] = float(normalizer)
    elif mode == "seq-mean-token-sum-norm":
        info.update(global_batch_size=1, loss_scale_factor=float(normalizer))
    elif mode.startswith("seq-mean"):
        info["global_batch_size"] = float(normalizer)
    return info


class VerlTarget(_torch.TrainerTarget):
    """verl 0.9.1's policy loss, entropy bonus and KL loss (``core_algos``)."""

    key, label, module = "verl", "verl", "verl.trainer.ppo.core_algos"
    refusal = staticmethod(_refusal)

    def __call__(self, call: TargetCall) -> TargetResult:
        from verl.trainer.ppo import core_algos
        from verl.utils import torch_functional as verl_F

        batch = _torch.token_batch(call, verl_F.logprobs_from_logits, verl_F.entropy_from_logits,
                                   need_entropy=_torch.needs_entropy(call),
                                   nan_padding=self.nan_padding)
        if call.op in _torch.TOKEN_OPS:
            return _torch.result(call, batch, _torch.per_token_outputs(
                call, batch, lambda logp, ref, kind: core_algos.kl_penalty(logp, ref, kind)))
        n_seq = int(batch.mask.any(-1).sum())
        config, mode = _config(call, n_seq)
        old = batch.logps.detach() if batch.old_logps is None else batch.old_logps
        loss, _ = core_algos.get_policy_loss_fn(mode)(
            old_log_prob=old, log_prob=batch.logps, advantages=batch.advantages,
            response_mask=batch.mask, loss_agg_mode=config.loss_agg_mode, config=config,
            rollout_is_weights=batch.importance_weights)
        agg = dict(loss_mask=batch.mask, loss_agg_mode=config.loss_agg_mode,
                   **config.global_batch_info)
        if batch.entropy is not None:
            loss = loss - config.entropy_coeff * core_algos.agg_loss(loss_mat=batch.entropy, **agg)
        if config.use_kl_loss:
            kl = core_algos.kl_penalty(batch.logps, batch.ref_logps, config.kl_loss_type)
            loss = loss + core_algos.agg_loss(loss_mat=kl, **agg) * config.kl_loss_coef
        return _torch.result(call, batch, {"loss": loss})


#: verl on finite padding (what its actor feeds it), and on the fixtures' NaN padding.
TARGET = VerlTarget()
NAN_PADDED = VerlTarget(nan_padding=True)
