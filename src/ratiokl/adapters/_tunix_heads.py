"""Where a Tunix model keeps its last hidden states and its lm_head.

The ``"ratiokl_grpo"`` loss computes the policy's log-probs from the hidden states the
model's head reads and the head's weight (``ratiokl.jax.loss.linear_policy_loss``), so it
needs, per model class, the :class:`LMHead` (weight, bias, logit softcap, compute dtype)
that turns ``hidden [B, L, H]`` into the logits the model's own ``__call__`` returns.

The hidden states come from Tunix's own convention for them (its score-head models use
it): ``model(tokens, output_hidden_states=True, ...)`` sows the final-norm output as the
``nnx.Intermediate`` ``"all_hidden_states"``, captured here (``nnx.capture``; ``nnx.pop``
on older flax). The model still builds its logits in that call; nothing reads them, so
under ``jit`` (Tunix's train step) XLA drops the head's GEMM and the ``[B, L, V]`` array,
leaving the linear op's own (chunks of rows on a GPU).

Known classes (``tunix`` 0.1.7): ``Gemma`` (tied embedding, ``final_logit_softcap``),
``Gemma3`` (tied embedding), ``Qwen2`` and ``Qwen3`` (tied embedding or ``lm_head``, both
cast to the model's ``dtype`` as its ``decode`` / ``Einsum`` do) and the test suite's
``ToyTransformer`` (an ``nnx.Linear`` head with bias). ``Llama3`` and ``Gemma4`` are not:
their ``__call__`` has no ``output_hidden_states`` in 0.1.7. :func:`register_lm_head` adds
a class (one that sows ``"all_hidden_states"`` as above).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, NamedTuple, Optional, Union

import jax
from flax import nnx

__all__ = ["LMHead", "hidden_states", "lm_head_of", "register_lm_head"]


class LMHead(NamedTuple):
    """A model's head as ``ratiokl.jax.loss.linear_policy_loss`` takes it: the logits are
    ``c * tanh((h @ weight.T + bias) / c)`` (``c = logit_softcap``; None: no cap), with
    ``h``, ``weight`` and ``bias`` cast to ``dtype`` first (None: their promoted dtype, as
    ``jnp.dot`` would compute in)."""

    weight: jax.Array  # [V, H]
    bias: Optional[jax.Array] = None  # [V]
    logit_softcap: Optional[float] = None
    dtype: Any = None


HeadOf = Callable[[Any], LMHead]
_HEADS: Dict[str, HeadOf] = {}


def _key(model_type: Union[type, str]) -> str:
    if isinstance(model_type, str):
        return model_type
    return f"{model_type.__module__}.{model_type.__qualname__}"


def register_lm_head(model_type: Union[type, str], head_of: HeadOf) -> None:
    """Teach the ``"ratiokl_grpo"`` loss a model class (or its ``"module.QualName"``).

    ``head_of(model)`` returns the :class:`LMHead` of an instance; the class's
    ``__call__`` must take ``output_hidden_states=True`` and then sow the hidden states its
    head reads as ``self.sow(nnx.Intermediate, "all_hidden_states", x)`` (Tunix's own
    models do). Subclasses are matched too; a later registration replaces an earlier one.
    """
    if not callable(head_of):
        raise TypeError(f"register_lm_head: `head_of` must be a callable model -> LMHead; "
                        f"got {type(head_of).__name__}")
    _HEADS[_key(model_type)] = head_of


def _param(variable: Any) -> jax.Array:
    return variable[...]


def _no_lora(module: Any, where: str) -> Any:
    """``module``, refusing a head that carries LoRA parameters (qwix's
    ``nnx.LoRAParam``): its logits are not ``h @ weight.T`` alone."""
    if jax.tree_util.tree_leaves(nnx.state(module, nnx.LoRAParam)):
        raise ValueError(
            f"the 'ratiokl_grpo' policy loss reads the head weight `{where}`, which carries "
            "LoRA parameters (its logits are not h @ weight.T alone). Leave the head out of "
            "the LoRA module pattern, or select the full-logits loss "
            "(GRPOConfig(policy_loss_fn='ratiokl_grpo_logits'))")
    return module


def _embedding_head(model: Any) -> LMHead:
    """``embedder.decode``: ``x @ input_embedding.T`` (Gemma, Gemma3)."""
    embedder = _no_lora(model.embedder, "embedder.input_embedding")
    return LMHead(_param(embedder.input_embedding),
                  logit_softcap=getattr(model, "final_logits_softcap", None))


def _qwen_head(model: Any) -> LMHead:
    """Qwen2 / Qwen3: tied (``embedder.decode``) or ``lm_head`` (``x @ w``, ``w [H, V]``),
    each casting ``x`` and the weight to its module's ``dtype``."""
    if model.config.use_tied_embedding:
        embedder = _no_lora(model.embedder, "embedder.input_embedding")
        return LMHead(_param(embedder.input_embedding), dtype=embedder.dtype)
    head = _no_lora(model.lm_head, "lm_head.w")
    return LMHead(_param(head.w).T, dtype=head.dtype)


def _linear_head(model: Any) -> LMHead:
    """An ``nnx.Linear`` ``lm_head`` (``x @ kernel + bias``, ``kernel [H, V]``)."""
    head = _no_lora(model.lm_head, "lm_head.kernel")
    bias = None if head.bias is None else _param(head.bias)
    return LMHead(_param(head.kernel).T, bias, dtype=head.dtype)


for _name, _head_of in (("tunix.models.gemma.model.Gemma", _embedding_head),
                        ("tunix.models.gemma3.model.Gemma3", _embedding_head),
                        ("tunix.models.qwen2.model.Qwen2", _qwen_head),
                        ("tunix.models.qwen3.model.Qwen3", _qwen_head),
                        ("tunix.tests.test_common.ToyTransformer", _linear_head)):
    register_lm_head(_name, _head_of)


def lm_head_of(model: Any) -> Optional[HeadOf]:
    """The registered ``head_of`` of ``model``'s class or its nearest base; None if none."""
    for cls in type(model).__mro__:
        found = _HEADS.get(_key(cls))
        if found is not None:
            return found
    return None


def hidden_states(model: Any, tokens: jax.Array, call: Dict[str, Any]) -> jax.Array:
    """``[B, L, H]``: the states ``model``'s head reads, from ``model(tokens, **call,
    output_hidden_states=True)`` (the model's logits are left unread)."""
    if hasattr(nnx, "capture"):  # flax >= 0.12: sow outside capture is deprecated
        _, sown = nnx.capture(model, nnx.Intermediate)(tokens, **call,
                                                        output_hidden_states=True)
    else:
        model(tokens, **call, output_hidden_states=True)
        sown = nnx.pop(model, nnx.Intermediate)
    states = jax.tree_util.tree_leaves(sown.get("all_hidden_states"))
    if not states:
        raise ValueError(
            f"{type(model).__name__}(..., output_hidden_states=True) sowed no "
            "'all_hidden_states': the 'ratiokl_grpo' loss needs the hidden states its head "
            "reads (self.sow(nnx.Intermediate, 'all_hidden_states', x) before the head), "
            "or select GRPOConfig(policy_loss_fn='ratiokl_grpo_logits')")
    return states[-1]
