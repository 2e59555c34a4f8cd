"""TRL's ``GRPOTrainer`` with ratiokl's policy loss from the last hidden states.

``ratiokl.adapters.trl.GRPOTrainer`` is ``trl.GRPOTrainer`` (``trl >= 1.15``) whose loss
step calls :func:`ratiokl.torch.loss.linear_policy_loss` on the policy's last hidden
states and lm_head weight: per chunk of rows one GEMM, one fused kernel (loss,
metrics' row values and ``d loss / d logits`` together) and the two gradient GEMMs,
three GEMMs a step where TRL's chunked log-prob head recomputes the logits in its
backward (four). The ``[N, V]`` logits are never held. Everything else (generation,
rewards, advantages, the reference model, logging) is TRL's.

Usage: replace the import, keep the arguments::

    from ratiokl.adapters.trl import GRPOTrainer
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          train_dataset=...)

The ``GRPOConfig`` maps to ``policy_loss`` options by :func:`loss_options`, once, at
construction (the table: docs/policy_loss.md, "verl and TRL equivalents"). With the
default ``num_iterations=1`` TRL computes no old log-probs and the loss is on-policy
(``old_logps=None``). Per ``loss_type`` (``B`` completions, ``GA`` the current
gradient-accumulation steps in training, 1 in evaluation):

- ``grpo``: ``seq-mean-token-mean``, ``loss_normalizer = B * GA``;
- ``bnpo``: ``token-mean``, ``loss_normalizer = max(active tokens, 1) * GA``;
- ``dr_grpo``: ``token-mean``, ``loss_normalizer = B * max_completion_length * GA``;
- ``dapo`` and ``cispo``: ``token-mean``, ``loss_normalizer = num_items_in_batch /
  num_processes * GA / steps_per_generation`` (in evaluation without the last factor).

``beta`` is ``kl_coef`` on TRL's k3 (``"k3-is"``, times the ratio, with
``use_bias_correction_kl``), ``delta`` is ``ratio_cap``, CISPO's ratio cap
``epsilon_high`` is ``clip_eps_high = epsilon_high - 1`` with ``clip_eps = 1``, vLLM's
``importance_sampling_ratio`` is ``importance_weights``. One difference: ratiokl bounds
the log-ratio at ``+-20`` before ``exp`` (``log_ratio_bound``), TRL does not.

Refused at construction with a ``ValueError`` naming the field (ratiokl would compute
something else): ``loss_type`` ``sapo``, ``vespo`` or ``luspo``;
``importance_sampling_level="sequence"``; ``top_entropy_quantile < 1``;
``off_policy_mask_threshold``; an entropy bonus (``entropy_coef``,
``use_adaptive_entropy``); an MoE router loss; an lm_head bias, logit scale or
soft-capping. Multimodal inputs are refused in the loss step.

Logged (TRL's names and definitions, means over every process's active tokens):
``kl`` (with ``beta``), ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean``. Not logged: ``clip_ratio/low_min`` / ``high_max`` (per
sequence) and ``cispo_clip_ratio``.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Dict, NoReturn, Tuple

from ratiokl._requirements import import_framework

# Each says which extra to install when absent or too old (``ratiokl[trl]`` brings both).
import_framework("torch", needed_by="ratiokl.adapters.trl", extra="trl")
import_framework("trl", needed_by="ratiokl.adapters.trl")

import torch  # noqa: E402
import trl  # noqa: E402
from trl.trainer.utils import maybe_gather_lm_head_ctx  # noqa: E402

from ratiokl.adapters import refuse  # noqa: E402
from ratiokl.spec import BACKENDS, BackendName  # noqa: E402
from ratiokl.torch._route import backend_name  # noqa: E402
from ratiokl.torch.loss import linear_policy_loss  # noqa: E402

__all__ = ["GRPOTrainer", "loss_options"]

#: TRL ``loss_type`` -> ratiokl ``loss_agg`` (the denominators: ``GRPOTrainer._normalizer``).
_LOSS_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "token-mean",
             "dapo": "token-mean", "cispo": "token-mean"}
#: The loss types whose clipped ratio TRL logs as ``clip_ratio/*``.
_PPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
#: Inputs of the loss step that carry images (the adapter scores text only).
_MULTIMODAL = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes",
               "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse("ratiokl.adapters.trl.GRPOTrainer", "trl.GRPOTrainer", field, value, why)


def loss_options(args: "trl.GRPOConfig") -> Dict[str, Any]:
    """The :func:`~ratiokl.torch.loss.linear_policy_loss` options of a ``GRPOConfig``
    (those fixed for the run; the denominator is per step). ``ValueError`` naming the
    field for whatever ratiokl does not compute as TRL does."""
    loss_type = args.loss_type
    if loss_type not in _LOSS_AGG:
        _refuse("loss_type", loss_type, f"ratiokl implements {sorted(_LOSS_AGG)}")
    if args.importance_sampling_level != "token":
        _refuse("importance_sampling_level", args.importance_sampling_level,
                "the hidden-state path has the token-level ratio only")
    if getattr(args, "top_entropy_quantile", 1.0) < 1.0:
        _refuse("top_entropy_quantile", args.top_entropy_quantile,
                "the high-entropy token mask needs every entropy before the loss")
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        _refuse("off_policy_mask_threshold", args.off_policy_mask_threshold,
                "the off-policy sequence mask is not implemented")
    if getattr(args, "entropy_coef", 0.0) or getattr(args, "use_adaptive_entropy", False):
        _refuse("entropy_coef", getattr(args, "entropy_coef", 0.0),
                "TRL's entropy bonus is a token mean whatever the loss_type, ratiokl's is "
                "aggregated like the loss")
    eps_low = args.epsilon
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    options: Dict[str, Any] = {
        "loss_agg": _LOSS_AGG[loss_type],
        "kl_coef": float(args.beta),
        "kl_estimator": "k3-is" if getattr(args, "use_bias_correction_kl", False) else "k3",
        "temperature": float(args.temperature),
    }
    if loss_type == "cispo":  # TRL: min(r, epsilon_high), detached, on logp; no floor
        if not eps_high > 1.0:
            _refuse("epsilon_high", eps_high, "CISPO's epsilon_high is the ratio's cap (e.g. "
                    "5.0) and must be above 1")
        options.update(objective="cispo", clip_eps=1.0, clip_eps_high=eps_high - 1.0)
    else:
        options.update(clip_eps=eps_low, clip_eps_high=eps_high, ratio_cap=args.delta)
    return options


def _check_head(model: torch.nn.Module) -> None:
    """Refuse an lm_head that is not ``hidden @ weight.T`` (a bias, a scale, a soft cap)."""
    config = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier",
                 "lm_head_multiplier", "logits_scaling"):
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            _refuse(f"model.config.{name}", value,
                    "the logits must be hidden @ lm_head.weight.T exactly")
    if getattr(model.get_output_embeddings(), "bias", None) is not None:
        _refuse("lm_head.bias", "present", "the logits must be hidden @ lm_head.weight.T")
    if getattr(config, "output_router_logits", False) and getattr(
            config, "router_aux_loss_coef", 0.0):
        _refuse("model.config.router_aux_loss_coef", config.router_aux_loss_coef,
                "the MoE router loss is not added")


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


def _install_head(model: torch.nn.Module, fp32: bool) -> None:
    """Patch ``model.forward``: ``model(..., ratiokl_loss=fn, ratiokl_tokens=T)`` runs the
    backbone and returns ``fn(hidden [B, T, H], weight [V, H])`` of the hidden states
    that predict the last ``T`` tokens; without ``ratiokl_loss`` the previous forward
    (TRL's, or the model's own) runs. Through the forward, so DDP / FSDP / DeepSpeed
    wrappers see the call; the backbone and head are looked up per call (FSDP and PEFT
    replace them)."""
    previous = model.forward

    def forward(self, *args, ratiokl_loss: Callable = None, ratiokl_tokens: int = 0, **kwargs):
        if ratiokl_loss is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        hidden = hidden[:, -ratiokl_tokens - 1:-1]
        weight = self.get_output_embeddings().weight
        if hasattr(weight, "full_tensor"):  # an FSDP2 DTensor: the whole head
            weight = weight.full_tensor()
        with maybe_gather_lm_head_ctx(weight):  # ZeRO-3: the gathered head
            if fp32:
                hidden, weight = hidden.float(), weight.float()
            elif weight.dtype != hidden.dtype:  # autocast: the head in the activations' dtype
                weight = weight.to(hidden.dtype)
            return ratiokl_loss(hidden.to(weight.device), weight)

    model.forward = types.MethodType(forward, model)


class GRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` with the loss step of :func:`ratiokl.torch.loss.linear_policy_loss`
    (the module docstring has the mapping and what is refused).

    Args (besides TRL's, all keyword):
      ratiokl_chunk_rows: completion tokens per chunk (``linear_policy_loss``'s
        ``chunk_rows``): one ``[chunk_rows, V]`` buffer in the head's dtype.
      ratiokl_backend: ``"auto"`` (Triton on CUDA, else the native path), ``"native"``,
        ``"triton"`` or ``"interpret"``; checked against the trainer's device when built
        (``ValueError``: ``"triton"`` off CUDA, ``"interpret"`` off the CPU, either
        without a usable Triton).
      ratiokl_check_ids: check the completion ids against the vocabulary
        (``check_ids``).
    """

    def __init__(self, *args, ratiokl_chunk_rows: int = 2048,
                 ratiokl_backend: BackendName = "auto", ratiokl_check_ids: bool = True,
                 **kwargs) -> None:
        if isinstance(ratiokl_chunk_rows, bool) or not isinstance(ratiokl_chunk_rows, int) \
                or ratiokl_chunk_rows < 1:
            raise ValueError(f"`ratiokl_chunk_rows` must be a positive int (completion tokens "
                             f"per chunk); got {ratiokl_chunk_rows!r}")
        if ratiokl_backend not in BACKENDS:
            raise ValueError(f"`ratiokl_backend` must be one of {', '.join(map(repr, BACKENDS))}"
                             f"; got {ratiokl_backend!r}")
        super().__init__(*args, **kwargs)
        _check_backend(ratiokl_backend, self.accelerator.device)
        self._ratiokl_options = loss_options(self.args)
        self._ratiokl_call = {"chunk_rows": ratiokl_chunk_rows, "backend": ratiokl_backend,
                              "check_ids": ratiokl_check_ids}
        is_peft = hasattr(self.model, "get_base_model")
        target = self.model.get_base_model() if is_peft else self.model
        _check_head(target)
        _install_head(target, bool(getattr(self.args, "cast_lm_head_to_fp32", False)))

    def _normalizer(self, mask: torch.Tensor, inputs: Dict[str, Any],
                    train: bool) -> Any:
        """The loss's denominator for TRL's ``loss_type`` (the module docstring)."""
        steps = self.current_gradient_accumulation_steps if train else 1
        loss_type = self.args.loss_type
        if loss_type == "grpo":
            return mask.shape[0] * steps
        if loss_type == "bnpo":
            return mask.sum().clamp(min=1).float() * steps
        if loss_type == "dr_grpo":
            return mask.shape[0] * self.max_completion_length * steps
        items = inputs["num_items_in_batch"].clamp(min=1).float() / self.accelerator.num_processes
        return items * steps / self.args.steps_per_generation if train else items

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
        weights = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            weights = inputs["importance_sampling_ratio"].expand(mask.shape)
        train = self.model.training
        options = self._ratiokl_options

        def loss_of(hidden: torch.Tensor, weight: torch.Tensor):
            return linear_policy_loss(
                hidden, weight, completion_ids, mask, inputs.get("old_per_token_logps"),
                inputs["advantages"], ref_logps=inputs.get("ref_per_token_logps")
                if options["kl_coef"] != 0.0 else None, importance_weights=weights,
                loss_normalizer=self._normalizer(mask, inputs, train), **options,
                **self._ratiokl_call)

        with self.accelerator.autocast():
            loss, metrics = model(input_ids=input_ids, attention_mask=attention_mask,
                                  ratiokl_loss=loss_of, ratiokl_tokens=completion_ids.size(1))
        self._log_metrics("train" if train else "eval", metrics, mask)
        return loss

    def _log_metrics(self, mode: str, metrics: Dict[str, torch.Tensor],
                     mask: torch.Tensor) -> None:
        """TRL's names: the means over every process's active tokens."""
        tokens = mask.sum().float()
        logged: Tuple[Tuple[str, str], ...] = (("entropy", "entropy_mean"),)
        if self._ratiokl_options["kl_coef"] != 0.0:
            logged += (("kl", "kl_mean"),)
        if self.args.loss_type in _PPO_TYPES:
            logged += (("clip_ratio/low_mean", "clip_fraction_low"),
                       ("clip_ratio/high_mean", "clip_fraction_high"),
                       ("clip_ratio/region_mean", "clip_fraction"))
        sums = torch.stack([metrics[ours] * tokens for _, ours in logged] + [tokens])
        totals = self.accelerator.reduce(sums, reduction="sum")
        count = totals[-1].clamp(min=1.0)
        for i, (theirs, _) in enumerate(logged):
            self._metrics[mode][theirs].append((totals[i] / count).item())
