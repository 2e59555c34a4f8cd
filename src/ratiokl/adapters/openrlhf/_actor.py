"""``Actor.forward`` from the last hidden states: ``linear_selected_logprobs`` on the
decoder's output and the lm_head weight, never the ``[B, S, V]`` float32 logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, NoReturn, Optional, Tuple

import torch
from transformers.modeling_outputs import ModelOutput

from ratiokl.adapters import refuse
from ratiokl.adapters._hf_head import head_transform
from ratiokl.spec import BackendName
from ratiokl.torch.loss import linear_selected_logprobs

__all__ = ["ActorOutput", "actor_forward"]


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse("ratiokl.adapters.openrlhf.actor_forward", "openrlhf.models.Actor.forward", field,
           value, why)


@dataclass
class ActorOutput(ModelOutput):
    """What the forward returns with ``return_output=True``: no ``logits`` (never built);
    ``entropy`` ``[B, S - 1]`` float32 with ``return_entropy`` (0 where the attention mask
    excludes the predicted or the predicting position). Reading ``aux_loss`` (the MoE
    router loss, which this forward does not compute) raises a ``ValueError``."""

    logits: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None

    def __getattr__(self, name: str):
        if name == "aux_loss":
            _refuse("aux_loss_coef", "> 0", "the MoE router loss is not computed")
        raise AttributeError(name)


def _head(model: torch.nn.Module) -> Tuple[torch.nn.Linear, Dict[str, Any]]:
    """The lm_head module and the ``linear_selected_logprobs`` options that make its logits
    the model's own (with its ``bias``): the config's logit scale and soft cap, read as the
    ``transformers`` model classes apply them (:func:`ratiokl.adapters._hf_head.
    head_transform`: Cohere, Falcon-H1, Granite, HyperCLOVA X, Gemma 2 and later). A
    ``ValueError`` naming what it cannot read: a field no known class applies, LoRA on the
    head."""
    options = head_transform(model.config, _refuse)
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or hasattr(head, "base_layer"):
        _refuse("lm_head", type(head).__name__, "the head must be a plain torch.nn.Linear "
                "(no LoRA on lm_head)")
    return head, options


def _call_head(head: torch.nn.Linear, rows: torch.Tensor, score: Callable) -> Any:
    """``score(rows, weight, bias)`` run as the head module's own forward, so that wrappers
    managing its parameters around its calls see it as the model's own head call: DeepSpeed
    ZeRO-3 gathers the partitioned weight for this call (and again for its backward) and
    releases it after, rather than keeping it gathered for the whole actor forward."""
    own = head.__dict__.get("forward")
    head.forward = lambda x: score(x, head.weight, head.bias)
    try:
        return head(rows)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _decoder_hidden(model: torch.nn.Module, sequences: torch.Tensor,
                    attention_mask: torch.Tensor, packed: bool) -> torch.Tensor:
    """The decoder's last hidden states ``[B, S, H]`` on OpenRLHF's inputs: the padded
    batch with its attention mask and position ids, or with ``packed`` (OpenRLHF's
    ``--ds.packing_samples``, ``unpad_and_slice_tensor`` without ring attention) the
    attended tokens of all rows in one row ``[1, N]``, row-major, with each sequence's
    positions from 0 and no attention mask (the attention keeps the sequences apart by
    their positions: flash-attn's varlen path, or ``transformers``' packed-sequence mask),
    scattered back to ``[B, S, H]`` (0 where the attention mask is 0)."""
    positions = attention_mask.long().cumsum(-1) - 1
    if not packed:
        positions.masked_fill_(attention_mask == 0, 1)
        return model.base_model(sequences, attention_mask=attention_mask,
                                position_ids=positions, use_cache=False).last_hidden_state
    kept = attention_mask.flatten().nonzero().squeeze(1)  # a host sync, as OpenRLHF's
    hidden = model.base_model(sequences.flatten()[kept][None], attention_mask=None,
                              position_ids=positions.flatten()[kept][None],
                              use_cache=False).last_hidden_state[0]
    return hidden.new_zeros(sequences.numel(), hidden.shape[-1]).index_copy(
        0, kept, hidden).view(*sequences.shape, -1)


def actor_forward(backend: BackendName = "auto",
                  chunk_rows: Optional[int] = None) -> Callable:
    """A replacement for ``openrlhf.models.Actor.forward`` (OpenRLHF 0.11): same arguments,
    same return values, the log-probs and entropies through
    :func:`ratiokl.torch.loss.linear_selected_logprobs` (``backend``, ``chunk_rows``).

    Per call it runs the model's decoder (``model.base_model``; through PEFT's
    ``get_base_model()``) on OpenRLHF's ``sequences``, ``attention_mask`` and position ids
    (with the actor's ``packing_samples``, on the tokens packed as OpenRLHF packs them:
    :func:`_decoder_hidden`), and gives ``linear_selected_logprobs`` the hidden states of
    positions ``0 .. S-2``, the lm_head weight (with its bias, and the model's logit scale
    or soft cap: Cohere, Granite, Gemma), ``sequences[:, 1:]`` and the actor's
    ``temperature``. With an
    ``action_mask [B, T]`` and neither ``return_entropy`` nor ``return_logprobs`` only the
    last ``T`` positions are computed. Returns as OpenRLHF's: ``action_log_probs [B, T]``
    float32 (0 where ``action_mask`` is false), ``[B, S - 1]`` log-probs with
    ``return_logprobs`` and no mask, and with ``return_output`` an :class:`ActorOutput`
    (``entropy [B, S - 1]`` with ``return_entropy``). Positions the attention mask
    excludes (the prediction of or from a padded token) are inactive: log-prob and entropy
    0, exactly zero gradient, whatever their hidden states hold. A call that wants the
    logits (no ``action_mask``, no ``return_logprobs``) runs OpenRLHF's own forward.

    ``ValueError`` (naming the field) for ring attention (``ds.ring_attn_size > 1``),
    multimodal inputs, a logit multiplier it cannot read and LoRA on the lm_head; reading
    ``output.aux_loss`` (MoE) raises one too. The head's GEMMs run inside the head
    module's own call (:func:`_call_head`), so DeepSpeed ZeRO-3 gathers its weight.
    """
    from openrlhf.models.actor import Actor

    original = getattr(Actor.forward, "ratiokl_original", Actor.forward)

    def forward(self, sequences: torch.LongTensor, action_mask: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, return_output: bool = False,
                allgather_logits: bool = False, return_logprobs: bool = False,
                ring_attn_group=None, packed_seq_lens=None, return_entropy: bool = False,
                **mm_inputs):
        if action_mask is None and not return_logprobs:
            return original(self, sequences, action_mask, attention_mask, return_output,
                            allgather_logits, return_logprobs, ring_attn_group,
                            packed_seq_lens, return_entropy, **mm_inputs)
        if ring_attn_group is not None:
            _refuse("ds.ring_attn_size", "> 1", "ring attention splits the packed tokens "
                    "over ranks (ring-flash-attn's CUDA kernels); the adapter packs them "
                    "on one rank only")
        if mm_inputs or getattr(self, "is_vlm", False):
            _refuse("mm_inputs", sorted(mm_inputs), "the adapter scores text models only")
        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") \
            else self.model
        head, options = _head(model)
        if attention_mask is None:
            attention_mask = torch.ones_like(sequences)
        hidden = _decoder_hidden(model, sequences, attention_mask,
                                 getattr(self, "packing_samples", False))
        active = attention_mask[:, :-1].bool() & attention_mask[:, 1:].bool()
        window = 0 if return_entropy or return_logprobs else -action_mask.shape[1]
        if window:
            active = active[:, window:] & action_mask.bool()
        ids = sequences[:, 1:][:, window:]

        def score(rows, weight, bias):
            if weight.dtype != rows.dtype:  # autocast: the head in the activations' dtype
                weight = weight.to(rows.dtype)
                bias = None if bias is None else bias.to(rows.dtype)
            return linear_selected_logprobs(
                rows, weight, ids, active, bias=bias, temperature=self.temperature,
                return_entropy=return_entropy, chunk_rows=chunk_rows, backend=backend,
                **options)

        out = _call_head(head, hidden[:, :-1][:, window:], score)
        logp, entropy = out if return_entropy else (out, None)
        output = ActorOutput(entropy=entropy) if return_output else None
        if action_mask is None:
            return (logp, output) if return_output else logp
        action_log_probs = torch.where(action_mask.bool(), logp[:, -action_mask.shape[1]:], 0.0)
        return (action_log_probs, output) if return_output else action_log_probs

    forward.__doc__ = actor_forward.__doc__
    forward.ratiokl_original = original
    return forward
