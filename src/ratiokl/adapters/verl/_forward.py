"""verl's fused actor forward through :func:`ratiokl.torch.loss.linear_selected_logprobs`.

With ``actor_rollout_ref.model.use_fused_kernels=True`` verl's FSDP engine
(``workers/engine/fsdp/transformer_impl.py``) patches the Hugging Face model's forward
(``models/transformers/monkey_patch.patch_forward_with_backends``) so that it returns
``log_probs`` and ``entropy`` from the last hidden states and the lm_head weight instead
of the logits; ``fused_kernel_options.impl_backend`` picks the implementation
(``"torch"``: ``FusedLinearForPPO``, ``"triton"``, ``"liger"``). The adapter adds
``impl_backend="ratiokl"``: :func:`use_ratiokl_forward` installs :func:`forward`, the
same contract as verl's ``dense_common.forward_with_torch_backend`` with the head's
log-probs and entropies from ``linear_selected_logprobs`` (``chunk_rows`` rows of the
``[N, V]`` logits at a time, never all of them).

Where it deliberately differs from verl's own fused forwards: those compute
``hidden @ lm_head.weight.T`` and leave out the lm_head's bias (Phi), the model's logit
scale (Cohere, Falcon-H1, Granite) and its soft cap (Gemma 2); the adapter's log-probs and
entropies are the model's own, with the bias and the config's transform
(:func:`ratiokl.adapters._hf_head.head_transform`).
"""

from __future__ import annotations

from typing import Any, NoReturn, Optional

import torch
from verl.models.transformers import dense_common, monkey_patch

from ratiokl.adapters import refuse
from ratiokl.adapters._hf_head import head_transform
from ratiokl.spec import BackendName
from ratiokl.torch.loss import linear_selected_logprobs

__all__ = ["BACKEND", "forward", "install", "use_ratiokl_forward"]

#: The value of ``actor_rollout_ref.model.fused_kernel_options.impl_backend``.
BACKEND = "ratiokl"
_FIELD = "actor_rollout_ref.model.fused_kernel_options.impl_backend"
#: Model types whose fused forward verl writes per model (vision inputs, their own
#: decoder); the adapter's forward is the dense text models' one.
_OWN_FORWARD = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5",
                "qwen3_5_moe", "kimi_vl")


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse("ratiokl.adapters.verl's fused forward", f"{_FIELD}=torch", field, value, why)


def _refuse_head(field: str, value: Any, why: str) -> NoReturn:
    """A head ratiokl cannot take: verl's fused forwards would drop its transform, so the
    fallback is verl's unfused path (the model's own logits)."""
    refuse("ratiokl.adapters.verl's fused forward",
           "actor_rollout_ref.model.use_fused_kernels=False", field, value, why)


def use_ratiokl_forward(model: torch.nn.Module, *, backend: BackendName = "auto",
                        chunk_rows: Optional[int] = None) -> None:
    """Make ``model`` (a Hugging Face causal LM, dense text model) return verl's fused
    ``log_probs`` and ``entropy`` through :func:`forward`, as verl's
    ``patch_forward_with_backends`` does for its own backends: the model's *class*
    forward is replaced (every instance of the class), the options live on ``model``.

    ``backend`` and ``chunk_rows`` are :func:`linear_selected_logprobs`'s. The head is the
    model's own: the lm_head's bias and the config's logit scale and soft cap (read here,
    once: :func:`~ratiokl.adapters._hf_head.head_transform`), which verl's own fused
    forwards leave out. ``ValueError`` naming the field for a model type verl gives its
    own fused forward, or a head transform ratiokl cannot take.
    """
    config = model.config
    if config.model_type in _OWN_FORWARD:
        _refuse("model.config.model_type", config.model_type,
                "verl gives this model type its own fused forward (vision inputs)")
    model._ratiokl_head = head_transform(config, _refuse_head)
    model._verl_fused_kernels_backend = BACKEND
    model._ratiokl_backend = backend
    model._ratiokl_chunk_rows = chunk_rows
    model.__class__.forward = forward


def forward(self, input_ids: Optional[torch.LongTensor] = None,
            attention_mask: Optional[torch.Tensor] = None,
            position_ids: Optional[torch.LongTensor] = None, past_key_values: Any = None,
            inputs_embeds: Optional[torch.FloatTensor] = None,
            labels: Optional[torch.LongTensor] = None, use_cache: Optional[bool] = None,
            output_attentions: Optional[bool] = None,
            output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None,
            cache_position: Optional[torch.LongTensor] = None, logits_to_keep: Any = 0,
            temperature: float = 1.0, shift_labels: Optional[torch.LongTensor] = None,
            **loss_kwargs: Any) -> dense_common.CausalLMOutputForPPO:
    """verl's fused forward contract: the decoder's last hidden states ``[B, S, H]``
    (verl's ``forward_base_model``), then per position the log-prob of the next token
    and the entropy of ``softmax(logits / temperature)``, float32 ``[B, S]`` each
    (``CausalLMOutputForPPO.log_probs`` / ``.entropy``; no ``logits``).

    The next tokens are ``shift_labels`` when given (the engine's packed, rolled ids),
    else ``labels`` or ``input_ids`` rolled left by one (the last position's is the
    first token: its value is discarded by the engine). A 2-D ``attention_mask`` of the
    ids' shape (the engine's padded layout) marks the active positions: padded ones
    enter no GEMM, get 0 and send no gradient. The logits are the model's own: the
    lm_head's bias, then the logit scale and soft cap :func:`use_ratiokl_forward` read.
    """
    if not return_dict:
        raise ValueError("ratiokl.adapters.verl's fused forward returns log_probs and "
                         "entropy only: call it with return_dict=True (verl's engine does)")
    outputs = dense_common.forward_base_model(
        self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
        output_attentions=output_attentions, output_hidden_states=output_hidden_states,
        cache_position=cache_position)
    hidden = outputs[0]
    if shift_labels is not None:
        next_ids = shift_labels
    elif labels is not None or input_ids is not None:
        next_ids = torch.roll(input_ids if labels is None else labels, shifts=-1, dims=-1)
    else:
        raise ValueError("ratiokl.adapters.verl's fused forward needs `input_ids`, `labels` "
                         "or `shift_labels` for the tokens whose log-probs it returns")
    mask = None
    if attention_mask is not None and attention_mask.shape == next_ids.shape:
        mask = attention_mask.bool()
    head = self.lm_head
    # An instance of the patched class that use_ratiokl_forward never saw reads its own.
    transform = getattr(self, "_ratiokl_head", None)
    if transform is None:
        transform = head_transform(self.config, _refuse_head)
    log_probs, entropy = linear_selected_logprobs(
        hidden, head.weight, next_ids, mask, bias=head.bias, temperature=temperature,
        **transform, return_entropy=True,
        chunk_rows=getattr(self, "_ratiokl_chunk_rows", None),
        backend=getattr(self, "_ratiokl_backend", "auto"))
    return dense_common.CausalLMOutputForPPO(
        log_probs=log_probs, entropy=entropy, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def install() -> None:
    """Wrap verl's ``patch_forward_with_backends`` (idempotent): ``impl_backend="ratiokl"``
    with ``use_fused_kernels`` calls :func:`use_ratiokl_forward`; any other value goes to
    verl's own function unchanged. ``apply_monkey_patch`` looks the function up in its
    module when the engine builds the model, so the engine picks the wrapper up."""
    verl_patch = monkey_patch.patch_forward_with_backends
    if getattr(verl_patch, "_ratiokl", False):
        return

    def patch_forward_with_backends(model, use_fused_kernels: bool = False,
                                    fused_kernels_backend: Optional[str] = None) -> None:
        if use_fused_kernels and fused_kernels_backend == BACKEND:
            use_ratiokl_forward(model)
            return
        verl_patch(model, use_fused_kernels=use_fused_kernels,
                   fused_kernels_backend=fused_kernels_backend)

    patch_forward_with_backends._ratiokl = True
    monkey_patch.patch_forward_with_backends = patch_forward_with_backends
