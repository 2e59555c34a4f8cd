"""TRL's ``GRPOTrainer`` with ratiokl's policy loss from the last hidden states.

``ratiokl.adapters.trl.GRPOTrainer`` is ``trl.GRPOTrainer`` (``trl >= 1.15``) whose loss
step runs on the policy's last hidden states and lm_head (weight, bias, logit scale and
soft cap, read from the model's config as TRL's fused head reads them). On TRL's default
path (the token level, no entropy or off-policy mask) it calls
:func:`ratiokl.torch.loss.linear_policy_loss`: per chunk of rows one GEMM, one fused
kernel (loss, metrics' row values and ``d loss / d logits`` together) and the two
gradient GEMMs, three GEMMs a step where TRL's chunked log-prob head recomputes the
logits in its backward (four). GSPO (``importance_sampling_level="sequence"``),
``top_entropy_quantile < 1`` and ``off_policy_mask_threshold`` need every token's
log-prob or entropy before the loss: they take the two-pass route,
:func:`~ratiokl.torch.loss.linear_selected_logprobs` (with the entropy; four GEMMs, as
TRL's) then :func:`~ratiokl.torch.loss.policy_objective`. The ``[N, V]`` logits are never
held. Everything else (generation, rewards, advantages, the reference model, logging) is
TRL's.

Usage: replace the import, keep the arguments::

    from ratiokl.adapters.trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          train_dataset=...)

The ``GRPOConfig`` maps to ratiokl's options by :func:`loss_options`, once, at
construction (the table: docs/trainers.md, "TRL"). With the default
``num_iterations=1`` TRL computes no old log-probs and the loss is on-policy
(``old_logps=None``). Per ``loss_type`` (``B`` completions, ``GA`` the current
gradient-accumulation steps in training, 1 in evaluation):

- ``grpo`` and ``sapo``: ``seq-mean-token-mean``, ``loss_normalizer = B * GA``;
- ``luspo``: ``seq-mean-token-sum``, ``loss_normalizer = B * GA``;
- ``bnpo``: ``token-mean``, ``loss_normalizer = max(active tokens, 1) * GA``;
- ``dr_grpo``: ``token-mean``, ``loss_normalizer = B * max_completion_length * GA``;
- ``dapo``, ``cispo`` and ``vespo``: ``token-mean``, ``loss_normalizer = num_items_in_batch /
  num_processes * GA / steps_per_generation`` (in evaluation without the last factor).

``beta`` is ``kl_coef`` on TRL's k3 (``"k3-is"``, times the ratio, with
``use_bias_correction_kl``), ``delta`` is ``ratio_cap`` (from 1 to ``1 + epsilon_high``:
``clip_eps_high = delta - 1`` and ``dual_clip = 1 + epsilon_high``), CISPO's ratio cap
``epsilon_high`` is ``clip_eps_high = epsilon_high - 1`` with ``clip_eps = 1`` (at or below
1, ``ratio_cap = epsilon_high``),
``importance_sampling_level`` is ``ratio_level``. TRL's high-entropy mask and
off-policy sequence mask (its own ``get_high_entropy_mask`` and ``get_off_policy_mask``
on the entropies and log-probs of the same pass) and vLLM's ``importance_sampling_ratio``
are ``importance_weights`` (the policy term only; the denominators keep every active
token). GSPO's PPO term, whose sequence ratio TRL differentiates (its gradient spread
over the sequence's tokens), with advantages ``[B]`` or ``[B, T]``, is two
``policy_objective`` calls on the per-sequence means of the positive and the negative
parts of ``weights * advantages`` (``ratiokl.adapters._sequence_ratio``, which shows the
equality); its bias-corrected KL, ``k3`` times the sequence ratio TRL differentiates, is
``"k3-is"`` plus ``sequence_kl_spread`` (a term of value 0 there). SAPO is
``objective="sapo"`` (spread as GSPO's PPO term at the sequence level). VESPO, ``-sg(phi) *
A * logp`` with ``phi`` TRL's own ``get_gamma_weights`` of the sequence's product of ratios
(vLLM's ratio folded in), is CISPO's form on-policy with ``phi`` as an importance weight
(``_trl_vespo``; TRL sums vLLM's log-ratio over every position, padded ones holding 1 in
its batches; the adapter reads the active ones). TRL's entropy bonus, a token mean
whatever the ``loss_type``, is ``entropy_coef`` with ``entropy_agg="token-mean"`` over
``kl_entropy_normalizer = max(active tokens, 1) * GA`` (for ``bnpo``, ``entropy_coef``
alone); with ``use_adaptive_entropy`` the coefficient of each step is TRL's controller's
(``_trl_bonus``, on TRL's own state); with ``top_entropy_quantile < 1`` the bonus is
TRL's mean over the high-entropy tokens (the entropy times that mask, over their count).
One difference: ratiokl bounds the log-ratio at
``+-20`` before ``exp`` (``log_ratio_bound``), TRL does not.

Refused at construction with a ``ValueError`` naming the field (ratiokl would compute
something else): ``delta < 1`` (or 1 with ``epsilon_high = 0``); ``cispo`` with
``epsilon_high <= 0``; an MoE router loss (``router_aux_loss_coef``); a non-positive logit scale or soft cap.
Multimodal inputs are refused in the loss step.

Logged (TRL's names and definitions, means over every process's active tokens, or
sequences for GSPO's clip ratios): ``kl`` (with ``beta``), ``entropy``,
``clip_ratio/low_mean``, ``clip_ratio/high_mean``, ``clip_ratio/region_mean``;
``vespo/phi_seq_mean``; with an entropy bonus ``policy_loss`` and ``entropy_coef``. Not
logged: ``clip_ratio/low_min`` / ``high_max`` and ``cispo_clip_ratio``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, get_args

from ratiokl._requirements import import_framework

# Each says which extra to install when absent or too old (``ratiokl[trl]`` brings both).
import_framework("torch", needed_by="ratiokl.adapters.trl", extra="trl")
import_framework("trl", needed_by="ratiokl.adapters.trl")

import torch  # noqa: E402
import trl  # noqa: E402

from ratiokl.adapters._trl_head import head_options, install_head  # noqa: E402
from ratiokl.adapters._trl_bonus import after_step, applied_coef  # noqa: E402
from ratiokl.adapters._trl_metrics import log_metrics, sequence_clips  # noqa: E402
from ratiokl.adapters._trl_options import loss_options, refuse_trl  # noqa: E402
from ratiokl.adapters._trl_vespo import vespo_loss  # noqa: E402
from ratiokl.adapters._sequence_ratio import (  # noqa: E402
    sequence_kl_spread,
    spread_objective,
)
from ratiokl.spec import BACKENDS, BackendName, LogitsDtype  # noqa: E402
from ratiokl.torch._route import backend_name  # noqa: E402
from ratiokl.torch.loss import (  # noqa: E402
    linear_policy_loss,
    linear_selected_logprobs,
    policy_objective,
)

__all__ = ["GRPOTrainer", "loss_options"]

#: Inputs of the loss step that carry images (the adapter scores text only).
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _check_backend(backend: str, device: torch.device) -> None:
    """Refuse a ``ratiokl_backend`` the trainer's device cannot run (``"triton"`` off CUDA,
    ``"interpret"`` off the CPU, either without a usable Triton), as ``linear_policy_loss``
    would at the first loss step, after generation."""
    try:
        backend_name(backend, device)
    except (ValueError, RuntimeError) as err:
        raise ValueError(
            f"`ratiokl_backend={backend!r}` cannot run on this trainer, whose model is on "
            f"{device} ({err}). Pass ratiokl_backend='auto' (the Triton kernels on CUDA, "
            "else the native path) or 'native'") from err


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with the loss step of :func:`ratiokl.torch.loss.linear_policy_loss`
    (the module docstring has the mapping and what is refused).

    Args (besides TRL's, all keyword):
      ratiokl_chunk_rows: completion tokens per chunk (``linear_policy_loss``'s
        ``chunk_rows``); None (default): sized by bytes (float32 logits, 1 GiB at most).
      ratiokl_backend: ``"auto"`` (Triton on CUDA, else the native path), ``"native"``,
        ``"triton"`` or ``"interpret"``; checked against the trainer's device when built
        (``ValueError``: ``"triton"`` off CUDA, ``"interpret"`` off the CPU, either
        without a usable Triton).
      ratiokl_check_ids: check the completion ids against the vocabulary
        (``check_ids``).
      ratiokl_logits_dtype: ``"float32"`` (default): the log-probs of an fp32 head on the
        model's values (TRL's own chunked head rounds its bf16 tiles); ``"input"``: a
        bf16 model's logits rounded to bf16 first, as TRL's head and a bf16 sampler do
        (``linear_policy_loss``'s ``logits_dtype``).
    """

    def __init__(self, *args, ratiokl_chunk_rows: Optional[int] = None,
                 ratiokl_backend: BackendName = "auto", ratiokl_check_ids: bool = True,
                 ratiokl_logits_dtype: LogitsDtype = "float32", **kwargs) -> None:
        if ratiokl_logits_dtype not in get_args(LogitsDtype):
            raise ValueError(f"`ratiokl_logits_dtype` must be one of "
                             f"{', '.join(map(repr, get_args(LogitsDtype)))}; got "
                             f"{ratiokl_logits_dtype!r}")
        if ratiokl_chunk_rows is not None and (
                isinstance(ratiokl_chunk_rows, bool) or not isinstance(ratiokl_chunk_rows, int)
                or ratiokl_chunk_rows < 1):
            raise ValueError(f"`ratiokl_chunk_rows` must be a positive int (completion tokens "
                             f"per chunk), or None to size the chunk by bytes; got "
                             f"{ratiokl_chunk_rows!r}")
        if ratiokl_backend not in BACKENDS:
            raise ValueError(f"`ratiokl_backend` must be one of {', '.join(map(repr, BACKENDS))}"
                             f"; got {ratiokl_backend!r}")
        super().__init__(*args, **kwargs)
        _check_backend(ratiokl_backend, self.accelerator.device)
        if self.aux_loss_enabled:
            refuse_trl("router_aux_loss_coef", self.router_aux_loss_coef,
                       "the MoE router loss is not added")
        options = loss_options(self.args)
        self._ratiokl_options = options
        self._ratiokl_quantile = float(self.args.top_entropy_quantile)
        self._ratiokl_vespo = self.args.loss_type == "vespo"
        self._ratiokl_fused = options["ratio_level"] == "token" and not self._ratiokl_vespo \
            and self._ratiokl_quantile >= 1.0 and self.off_policy_mask_threshold is None
        self._ratiokl_spread = options["ratio_level"] == "sequence" and \
            options.get("objective", "ppo") in ("ppo", "sapo")
        self._ratiokl_kl_spread = options["ratio_level"] == "sequence" and \
            options["kl_estimator"] == "k3-is" and options["kl_coef"] != 0.0
        is_peft = hasattr(self.model, "get_base_model")
        target = self.model.get_base_model() if is_peft else self.model
        self._ratiokl_head = {**head_options(target), "temperature": float(self.args.temperature),
                              "chunk_rows": ratiokl_chunk_rows, "backend": ratiokl_backend,
                              "check_ids": ratiokl_check_ids,
                              "logits_dtype": ratiokl_logits_dtype}
        install_head(target, bool(getattr(self.args, "cast_lm_head_to_fp32", False)))

    def _normalizer(self, mask: torch.Tensor, inputs: Dict[str, Any],
                    train: bool) -> Any:
        """The loss's denominator for TRL's ``loss_type`` (the module docstring)."""
        steps = self.current_gradient_accumulation_steps if train else 1
        loss_type = self.args.loss_type
        if loss_type in ("grpo", "luspo", "sapo"):
            return mask.shape[0] * steps
        if loss_type == "bnpo":
            return mask.sum().clamp(min=1).float() * steps
        if loss_type == "dr_grpo":
            return mask.shape[0] * self.max_completion_length * steps
        items = inputs["num_items_in_batch"].clamp(min=1).float() / self.accelerator.num_processes
        return items * steps / self.args.steps_per_generation if train else items

    def _bonus_coef(self, device: torch.device) -> Any:
        """This micro-batch's ``entropy_coef``: 0 without TRL's bonus, the static number,
        or the adaptive controller's value as a 0-d float32 tensor (it changes between
        optimizer steps: no kernel specialised per value)."""
        if not self._entropy_bonus_enabled:
            return 0.0
        if self.use_adaptive_entropy:
            return torch.tensor(applied_coef(self), dtype=torch.float32, device=device)
        return applied_coef(self)

    def _loss_on_head(self, hidden: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor], batch: Dict[str, Any]):
        """``(loss, metrics, logp, bonus)`` from the head: the fused route (``logp`` None)
        or the two-pass one (``logp [B, T]`` detached, for the sequence-level clip
        metrics). ``bonus``: the entropy bonus's ``(mean entropy, tokens)`` where it
        averages over the high-entropy tokens only, else None (every active token)."""
        options = {**self._ratiokl_options, "entropy_coef": batch["entropy_coef"]}
        head = self._ratiokl_head
        ids, mask, weights = batch["completion_ids"], batch["mask"], batch["weights"]
        common = dict(ref_logps=batch["ref_logps"], loss_normalizer=batch["normalizer"])
        bonus_on = "entropy_agg" in options  # TRL's bonus: a token mean, over GA steps
        if bonus_on:
            common["kl_entropy_normalizer"] = mask.sum().clamp(min=1).float() * batch["steps"]
        if self._ratiokl_fused:  # the token level: linear_policy_loss has no ratio_level
            fused = {k: v for k, v in options.items() if k != "ratio_level"}
            loss, metrics = linear_policy_loss(
                hidden, weight, ids, mask, batch["old_logps"], batch["advantages"], bias=bias,
                importance_weights=weights, **common, **fused, **head)
            return loss, metrics, None, None
        logp, entropy = linear_selected_logprobs(hidden, weight, ids, mask, bias=bias,
                                                 return_entropy=True, **head)
        high = None if self._ratiokl_quantile >= 1.0 else self.get_high_entropy_mask(
            entropy.detach(), mask, 1.0 - self._ratiokl_quantile).float()
        weights = self._policy_weights(logp.detach(), high, batch)
        bonus, bonus_entropy = None, entropy
        if bonus_on and high is not None:  # TRL's bonus: a mean over the high-entropy tokens
            tokens = torch.where(mask, high, 0.0).sum()
            bonus_entropy = entropy * high
            common["kl_entropy_normalizer"] = tokens.clamp(min=1) * batch["steps"]
            bonus = (torch.where(mask, bonus_entropy.detach(), 0.0).sum() / tokens.clamp(min=1),
                     tokens)
        if self._ratiokl_vespo:
            loss, metrics = vespo_loss(self, logp, bonus_entropy, weights, batch, options,
                                       common)
        elif self._ratiokl_spread:  # GSPO's PPO term: TRL differentiates the sequence ratio
            loss, metrics = spread_objective(logp, batch["old_logps"], batch["advantages"],
                                             mask, weights, options, entropy=bonus_entropy,
                                             **common)
        else:
            loss, metrics = policy_objective(
                logp, batch["old_logps"], batch["advantages"], mask, entropy=bonus_entropy,
                importance_weights=weights, **common, **options)
        if bonus is not None:  # the logged entropy is every active token's
            metrics = {**metrics, "entropy_mean": torch.where(
                mask, entropy.detach(), 0.0).sum() / mask.sum().clamp(min=1)}
        if self._ratiokl_kl_spread:  # TRL's k3 * s also differentiates the sequence ratio
            loss = loss + sequence_kl_spread(logp, batch["old_logps"], batch["ref_logps"], mask,
                                             options, batch["normalizer"])
        return loss, metrics, logp.detach(), bonus

    def _policy_weights(self, logp: torch.Tensor, high: Optional[torch.Tensor],
                        batch: Dict[str, Any]) -> Optional[torch.Tensor]:
        """The two-pass route's policy weights ``[B, T]`` (or None): what TRL multiplies
        its policy term by, from this pass's log-probs through TRL's own methods. vLLM's
        ratio, the off-policy mask (``get_off_policy_mask``: ``[B, 1]``, or ``[B, T]``
        with per-token advantages) and ``high``, the high-entropy token mask (TRL's
        ``get_high_entropy_mask``, float ``[B, T]``) or None."""
        mask, weights = batch["mask"], batch["weights"]
        parts = [] if weights is None else [weights]
        if self.off_policy_mask_threshold is not None:
            old = logp if batch["old_logps"] is None else batch["old_logps"]
            sampling = batch["sampling_logps"]
            adv = batch["advantages"]
            parts.append(self.get_off_policy_mask(
                adv.unsqueeze(1) if adv.dim() == 1 else adv, logp,
                old if sampling is None else sampling, mask.float(),
                self.off_policy_mask_threshold).expand(mask.shape))
        if high is not None:
            parts.append(high)
        if not parts:
            return None
        weights = parts[0]
        for part in parts[1:]:
            weights = weights * part
        return weights

    def _compute_loss(self, model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
        for name in _MULTIMODAL:
            if inputs.get(name) is not None:
                raise ValueError(f"ratiokl.adapters.trl.GRPOTrainer scores text only; the batch "
                                 f"holds `{name}`. Use trl.GRPOTrainer for multimodal models")
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mask = mask.bool()
        weights, vespo_ratio = None, None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            if self._ratiokl_vespo:  # folded into VESPO's sequence ratio, not a weight
                vespo_ratio = inputs["importance_sampling_ratio"]
            else:
                weights = inputs["importance_sampling_ratio"].expand(mask.shape)
        train = self.model.training
        batch = {"completion_ids": completion_ids, "mask": mask, "weights": weights,
                 "old_logps": inputs.get("old_per_token_logps"),
                 "sampling_logps": inputs.get("sampling_per_token_logps"),
                 "advantages": inputs["advantages"],
                 "ref_logps": inputs.get("ref_per_token_logps")
                 if self._ratiokl_options["kl_coef"] != 0.0 else None,
                 "normalizer": self._normalizer(mask, inputs, train),
                 "entropy_coef": self._bonus_coef(mask.device),
                 "steps": self.current_gradient_accumulation_steps if train else 1,
                 "vespo_ratio": vespo_ratio}

        def loss_of(hidden, weight, bias):
            return self._loss_on_head(hidden, weight, bias, batch)

        with self.accelerator.autocast():
            loss, metrics, logp, bonus = model(
                input_ids=input_ids, attention_mask=attention_mask, ratiokl_loss=loss_of,
                ratiokl_tokens=completion_ids.size(1))
        mode = "train" if train else "eval"
        log_metrics(self, mode, metrics, mask, sequence_clips(self, logp, batch))
        if self._entropy_bonus_enabled:
            mean, tokens = (metrics["entropy_mean"], mask.sum().float()) if bonus is None \
                else bonus
            after_step(self, mode, loss, mean, tokens, batch["entropy_coef"], train)
        return loss
