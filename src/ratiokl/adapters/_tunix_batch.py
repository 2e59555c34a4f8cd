"""A Tunix ``TrainExample`` as the ratiokl ops take it: the model call, and the
per-token arrays of the positions whose next token is scored.

Two layouts, both Tunix's (``tunix.rl.common.compute_per_token_logps``):

- padded: ``prompt_ids [B, P]`` (left-padded) and ``completion_ids [B, T]``; the model
  runs on their concatenation ``[B, P + T]`` with Tunix's positions and causal mask
  (``common.process_ids``), and the ``T`` positions before each completion token score it;
- packed (``max_seq_token_per_tpu``; ``rl.utils.pack_sequences``): ``prompt_ids [B, 0]``,
  ``completion_ids [B, L]`` holding prompts and completions back to back,
  ``segment_ids [B, L]`` (``1, 2, ...`` per sequence, 0 on padding) and
  ``segment_positions``; every position but the last scores the next token, and
  ``completion_mask``, ``advantages`` (then per token) and the log-probs are ``[B, L]``
  with position 0 dropped (Tunix gives it log-prob 0; it is a prompt token). The
  segments go to ratiokl as ``segment_ids``, so a "sequence" of ``loss_agg`` and GSPO is
  a packed sequence.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, NamedTuple, Optional, Tuple

import jax
import jax.numpy as jnp
from tunix.rl import common

__all__ = ["Targets", "model_call", "scoring", "targets"]


class Targets(NamedTuple):
    """The scored tokens, ``[B, T]`` each (``T``: the completion length, or ``L - 1``
    packed); ``advantages`` is ``[B]`` (one per sequence) or ``[B, T]``."""

    ids: jax.Array
    mask: jax.Array  # bool
    advantages: jax.Array
    old_logps: Optional[jax.Array]
    ref_logps: Optional[jax.Array]
    importance_weights: Optional[jax.Array]
    segment_ids: Optional[jax.Array]


def _packed(example: Any) -> bool:
    if getattr(example, "segment_ids", None) is None:
        return False
    if example.prompt_ids.shape[1] != 0:
        raise ValueError(
            "a packed TrainExample (`segment_ids` given) holds its prompts in "
            f"`completion_ids`; got `prompt_ids` of shape {tuple(example.prompt_ids.shape)}. "
            "Pack with tunix.rl.utils.pack_sequences (prompt_ids [B, 0])")
    return True


def _takes_segment_ids(model: Any) -> bool:
    """Whether the model's call takes ``segment_ids`` (as Tunix decides it)."""
    try:
        params = inspect.signature(model.__call__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "segment_ids" or p.kind is p.VAR_KEYWORD for p in params)


def model_call(model: Any, example: Any, pad_id: int,
               eos_id: int) -> Tuple[jax.Array, Dict[str, Any]]:
    """``(tokens [B, P + T], keyword arguments)`` of the model call Tunix makes: its own
    ``common.process_ids`` for positions and mask, and ``segment_ids`` (the packing's, or
    the non-pad mask) where the model's ``__call__`` takes them."""
    segments = getattr(example, "segment_ids", None) if _packed(example) else None
    tokens, positions, attn_mask, pad_segments = common.process_ids(
        example.prompt_ids, example.completion_ids, pad_id, eos_id, segments,
        getattr(example, "segment_positions", None))
    call: Dict[str, Any] = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    given = segments if segments is not None else pad_segments
    if given is not None and _takes_segment_ids(model):
        call["segment_ids"] = given
    return tokens, call


def scoring(x: jax.Array, example: Any) -> jax.Array:
    """The rows of ``x [B, P + T, ...]`` (the model's logits or hidden states) at the
    positions that score a token: ``[B, T, ...]``."""
    if _packed(example):
        return x[:, :-1]
    completions = example.completion_ids.shape[1]
    return x[:, -completions - 1:-1]


def targets(example: Any) -> Targets:
    """The :class:`Targets` of ``example`` (inactive where ``completion_mask`` is 0)."""
    packed = _packed(example)

    def per_token(x: Optional[jax.Array]) -> Optional[jax.Array]:
        return None if x is None or not packed else x[:, 1:]

    def tokens(x: Optional[jax.Array]) -> Optional[jax.Array]:
        return per_token(x) if packed else x

    return Targets(
        ids=tokens(example.completion_ids),
        mask=tokens(example.completion_mask).astype(jnp.bool_),
        advantages=tokens(example.advantages),
        old_logps=tokens(example.old_per_token_logps),
        ref_logps=tokens(example.ref_per_token_logps),
        importance_weights=tokens(getattr(example, "sampler_is_weights", None)),
        segment_ids=per_token(getattr(example, "segment_ids", None)),
    )
