"""TRL's own GRPO loss as a check target (TRL 1.16; ``pip install 'ratiokl[trl]'``).

``ratiokl check --target ratiokl.harness.targets.trl:TARGET`` runs the fixtures'
``policy_loss`` and ``policy_objective`` cases through ``GRPOTrainer._compute_loss`` itself,
called unbound on a small host object that holds the configuration fields it reads
(:class:`_Host`: the loss type, clip bounds, ``beta``, ``delta``, the entropy bonus) in
place of a built trainer. Its forward (``_get_per_token_logps_and_entropies``) is the one
part replaced: it returns the case's log-probs and entropies, from logits through TRL's own
``selective_log_softmax`` and ``entropy_from_logits`` on float32 logits divided by the
temperature (alone, those are the ``selected_logprobs`` cases). Everything after it
(ratios, clipping, KL, aggregation, entropy bonus, metrics) is TRL's code as it runs in
training, with one process, no gradient accumulation and no vLLM.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Optional

from ratiokl.harness._protocol import TargetCall, TargetResult
from ratiokl.harness.targets import _torch
from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND, DEFAULT_SAPO_TEMPERATURES

__all__ = ["LOSS_TYPES", "NAN_PADDED", "OPTIONS", "TARGET", "TRLTarget"]

#: The fixture ops this target runs: the loss and the per-token values (TRL's KL is inline
#: in ``_compute_loss``, with no function of its own for ``ratio_kl``).
_OPS = _torch.POLICY_OPS + ("selected_logprobs", "selected_logprobs_entropy")

#: ratiokl's ``loss_agg`` -> TRL's ``loss_type`` (PPO objective; CISPO: ``"cispo"``).
LOSS_TYPES = {"token-mean": "bnpo", "seq-mean-token-mean": "grpo",
              "seq-mean-token-sum": "luspo", "seq-mean-token-sum-norm": "dr_grpo"}

#: ratiokl option -> ``GRPOConfig`` field (the rest: :func:`_refusal`).
OPTIONS = {
    "loss_agg": "loss_type (LOSS_TYPES; token-mean with loss_normalizer: dapo, whose "
                "num_items_in_batch is the normalizer)",
    "clip_eps / clip_eps_high": "epsilon / epsilon_high (CISPO: epsilon_high = 1 + clip_eps_high)",
    "ratio_cap": "delta",
    "ratio_level": "importance_sampling_level",
    "objective": "loss_type = 'cispo' (token-mean only) or 'sapo' (seq-mean-token-mean only)",
    "sapo_temperatures": "sapo_temperature_pos, sapo_temperature_neg",
    "kl_coef / kl_estimator": "beta, with k3; k3-is: use_bias_correction_kl",
    "importance_weights": "the vLLM importance_sampling_ratio (use_vllm, "
                          "vllm_importance_sampling_correction)",
    "entropy_coef": "entropy_coef (always a token mean)",
}


def _refusal(call: TargetCall) -> Optional[str]:
    """Why TRL's loss cannot express ``call``'s options, or None."""
    reason = _torch.refusal(call, "TRL", _OPS)
    if reason is not None or call.op in _torch.TOKEN_OPS:
        return reason
    mode = call.option("loss_agg", "token-mean")
    if mode not in LOSS_TYPES:
        return f"TRL has no loss_type for loss_agg={mode!r}"
    if call.option("dual_clip") is not None:
        return "TRL has no dual clip"
    if call.option("kl_coef", 0.0) and call.option("kl_estimator", "k3") not in ("k3", "k3-is"):
        return f"TRL's KL is k3 only (kl_estimator={call.option('kl_estimator')!r})"
    if call.option("log_ratio_bound", DEFAULT_LOG_RATIO_BOUND) not in (
            None, DEFAULT_LOG_RATIO_BOUND):
        return "TRL does not bound the log-ratio (log_ratio_bound)"
    cispo = call.option("objective") == "cispo"
    if cispo and (mode != "token-mean" or call.option("ratio_cap") is not None):
        return "TRL's CISPO is token-mean (dapo's normalizer) with its own cap only"
    if call.option("objective") == "sapo" and (
            mode != "seq-mean-token-mean" or call.option("loss_normalizer") is not None):
        return "TRL's SAPO is seq-mean-token-mean (grpo's aggregation) only"
    if call.option("loss_normalizer") is not None and mode != "token-mean":
        return f"TRL has no normalizer for loss_type {LOSS_TYPES[mode]!r}"
    return None


class _Host:
    """The fields ``GRPOTrainer._compute_loss`` reads from its trainer, for one case."""

    def __init__(self, call: TargetCall, batch: _torch.TokenBatch) -> None:
        eps = float(call.option("clip_eps", 0.2))
        high = call.option("clip_eps_high")
        high = eps if high is None else float(high)
        cispo = call.option("objective") == "cispo"
        mode = call.option("loss_agg", "token-mean")
        dapo = call.option("loss_normalizer") is not None or cispo
        sapo = call.option("objective") == "sapo"
        self.loss_type = "cispo" if cispo else "sapo" if sapo else "dapo" if dapo \
            else LOSS_TYPES[mode]
        self.epsilon_low, self.epsilon_high = eps, (1.0 + high if cispo else high)
        self.importance_sampling_level = call.option("ratio_level", "token")
        self.beta = float(call.option("kl_coef", 0.0))
        self.entropy_coef = float(call.option("entropy_coef", 0.0))
        self._entropy_bonus_enabled = self.entropy_coef != 0.0
        self.use_vllm = self.vllm_importance_sampling_correction = (
            call.option("importance_weights") is not None)
        self.args = SimpleNamespace(
            use_bias_correction_kl=call.option("kl_estimator", "k3") == "k3-is",
            delta=call.option("ratio_cap"), steps_per_generation=1,
            **dict(zip(("sapo_temperature_pos", "sapo_temperature_neg"),
                       call.option("sapo_temperatures") or DEFAULT_SAPO_TEMPERATURES)))
        self.max_completion_length = batch.mask.shape[-1]
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_adaptive_entropy, self.aux_loss_enabled = False, False
        self.current_gradient_accumulation_steps = 1
        self.model = SimpleNamespace(training=True)
        self.accelerator = SimpleNamespace(
            num_processes=1, sync_gradients=True, gather=lambda x: x,
            gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
        self._metrics: Any = defaultdict(lambda: defaultdict(list))
        self._batch = batch

    def _get_per_token_logps_and_entropies(self, *_: Any, **__: Any):
        """The trainer's forward, replaced: the case's log-probs and entropies."""
        return self._batch.logps, self._batch.entropy, None


class TRLTarget(_torch.TrainerTarget):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` on the case's log-probs."""

    key, label, module = "trl", "TRL", "trl"
    refusal = staticmethod(_refusal)

    def __call__(self, call: TargetCall) -> TargetResult:
        import torch
        from trl import GRPOTrainer
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax

        batch = _torch.token_batch(call, selective_log_softmax, entropy_from_logits,
                                   need_entropy=call.op != "selected_logprobs",
                                   nan_padding=self.nan_padding)
        if call.op in _torch.TOKEN_OPS:
            return _torch.result(call, batch, _torch.per_token_outputs(call, batch))
        if batch.entropy is None:  # from log-probs without entropies: TRL computes them
            batch.entropy = torch.zeros_like(batch.logps)
        host = _Host(call, batch)
        rows, width = batch.mask.shape
        mask = batch.mask.long()
        inputs = {
            "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
            "completion_ids": torch.zeros(rows, width, dtype=torch.long),
            "completion_mask": mask, "advantages": batch.advantages,
            "old_per_token_logps": batch.old_logps, "ref_per_token_logps": batch.ref_logps,
            "num_items_in_batch": torch.tensor(float(call.option("loss_normalizer")
                                                     or mask.sum())),
            "importance_sampling_ratio": batch.importance_weights,
        }
        loss = GRPOTrainer._compute_loss(host, host.model, inputs)
        return _torch.result(call, batch, {"loss": loss})


#: TRL on finite padding (what its trainer feeds it), and on the fixtures' NaN padding.
TARGET = TRLTarget()
NAN_PADDED = TRLTarget(nan_padding=True)
