"""The policy's lm_head for the adapter: its logit options and the patched forward.

:func:`head_options` reads the logit scale and soft cap from the model's config the way
TRL's fused head reads them (``trl.trainer.utils.add_fused_lm_head``): the logits are
``c * tanh((h W^T + b) * s / c)`` before the temperature, as in
:func:`ratiokl.torch.loss.linear_selected_logprobs`. :func:`install_head` patches the
model's forward so the loss runs on the backbone's last hidden states and the head's
weight and bias, inside the forward that DDP / FSDP / DeepSpeed wrappers see.
"""

from __future__ import annotations

import math
import types
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from trl.trainer.utils import maybe_gather_lm_head_ctx

from ratiokl.adapters._trl_options import refuse_trl

__all__ = ["head_options", "install_head"]


def _logit_scale(config: Any) -> Tuple[str, float]:
    """``(field, scale)``: the first of TRL's fields the config sets (Cohere's
    ``logit_scale``, ``output_multiplier``, Falcon-H1's ``lm_head_multiplier``, Granite's
    and MiniCPM3's ``logits_scaling`` dividing, HyperCLOVA X's multiplying)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    value = getattr(config, "logits_scaling", None)
    if value is None:
        return "logit_scale", 1.0
    if getattr(config, "model_type", None) == "hyperclovax":
        return "logits_scaling", value
    if not _positive(value):
        refuse_trl("model.config.logits_scaling", value, "the logits are divided by it")
    return "logits_scaling", 1.0 / value


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def head_options(model: Any) -> Dict[str, Optional[float]]:
    """``{"logit_scale", "logit_softcap"}`` of :func:`~ratiokl.torch.loss.linear_policy_loss`
    for ``model``, read from its text config as TRL's fused head reads them: the scale,
    then Gemma's ``final_logit_softcapping``, then the temperature. The bias is the
    lm_head's own, read at each call (FSDP and PEFT replace the head)."""
    config = model.config.get_text_config()
    field, scale = _logit_scale(config)
    if not _positive(scale):
        refuse_trl(f"model.config.{field}", scale, "ratiokl's logit_scale is a positive number")
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and not _positive(softcap):
        refuse_trl("model.config.final_logit_softcapping", softcap,
                   "ratiokl's logit_softcap is a positive number or None")
    return {"logit_scale": float(scale), "logit_softcap": None if softcap is None
            else float(softcap)}


def _whole(param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """An FSDP2 DTensor's whole tensor; anything else as it is."""
    return param.full_tensor() if hasattr(param, "full_tensor") else param


def install_head(model: torch.nn.Module, fp32: bool) -> None:
    """Patch ``model.forward``: ``model(..., ratiokl_loss=fn, ratiokl_tokens=T)`` runs the
    backbone and returns ``fn(hidden [B, T, H], weight [V, H], bias [V] or None)`` of the
    hidden states that predict the last ``T`` tokens; without ``ratiokl_loss`` the
    previous forward (TRL's, or the model's own) runs. The backbone and head are looked
    up per call (FSDP and PEFT replace them). ``fp32`` (``cast_lm_head_to_fp32``): the
    head in float32 and the hidden states as they are (TRL's ``F.linear`` upcasts them,
    which changes no value): ratiokl's split products (``fp32_matmul="bf16x3"``) give that
    float32 head's log-probs with bf16 GEMMs, no float32 GEMM; else, under autocast, the
    head in the hidden states' dtype (float32 logits either way)."""
    previous = model.forward

    def forward(self, *args, ratiokl_loss: Callable = None, ratiokl_tokens: int = 0, **kwargs):
        if ratiokl_loss is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        hidden = hidden[:, -ratiokl_tokens - 1:-1]
        head = self.get_output_embeddings()
        weight, bias = _whole(head.weight), _whole(head.bias)
        with maybe_gather_lm_head_ctx(weight, bias):  # ZeRO-3: the gathered head
            dtype = torch.float32 if fp32 else hidden.dtype
            weight = weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
            return ratiokl_loss(hidden.to(weight.device), weight, bias)

    model.forward = types.MethodType(forward, model)
