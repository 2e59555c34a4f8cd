"""Tunix's GRPO loss from the last hidden states and the lm_head, through
:func:`ratiokl.jax.loss.linear_policy_loss`.

Importing this module registers two policy losses in Tunix's function registry
(``tunix.rl.function_registry``). Select one by name and build the learner from this
module (Tunix's ``GRPOLearner`` with the configuration checked when it is built)::

    from ratiokl.adapters.tunix import GRPOLearner  # registers both names
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    algo_config = GRPOConfig(..., policy_loss_fn="ratiokl_grpo")
    learner = GRPOLearner(rl_cluster, algo_config, reward_fns)

- ``"ratiokl_grpo"`` (:func:`grpo_loss_fn`): the model runs as Tunix runs it
  (``common.process_ids``) with ``output_hidden_states=True``; the final hidden states
  ``[B, T, H]`` of the scoring positions and the model's head (weight, bias, logit
  softcap: ``ratiokl.adapters._tunix_heads``) go to ``linear_policy_loss``, which never
  holds the ``[B, T, V]`` float32 logits (on a GPU; its ``"native"`` backend, the CPU's,
  builds the scored rows' logits at once). The model's own head output is left unread,
  so XLA drops it under ``jit`` (Tunix's train step). Known heads: Gemma (tied, softcap),
  Gemma3, Qwen2, Qwen3 (tied or ``lm_head``) and Tunix's test ``ToyTransformer``;
  :func:`register_lm_head` adds a class. Any other model is refused (``ValueError``
  naming its class): Llama3 and Gemma4 have no ``output_hidden_states`` in Tunix 0.1.7.
- ``"ratiokl_grpo_logits"`` (:func:`grpo_logits_loss_fn`): the same loss from the
  model's full logits (:func:`ratiokl.jax.loss.policy_loss`), for any model.

Inactive (padding) positions are isolated by construction in both: whatever their
hidden states or logits hold, they add nothing and get an exact zero gradient.

Packed sequences (``max_seq_token_per_tpu``; Tunix's ``rl.utils.pack_sequences``): the
``TrainExample``'s ``segment_ids`` go to ratiokl's ``segment_ids``, so the sequence-level
aggregations and GSPO's ratio take each packed sequence as a sequence (Tunix's own loss
takes the whole packed row as one; ``token-mean`` is the same either way).
``"sequence-mean-token-scale"`` is refused there (it divides by the padded completion
length, which a packed row does not have).

Mapping (:func:`loss_options`; ``algo_config`` fields):

- ``epsilon``, ``epsilon_high``: ``clip_eps``, ``clip_eps_high``; ``epsilon_c``: ``dual_clip``;
- ``beta`` with ``kl_loss_mode`` ``"kl"`` / ``"mse_kl"`` / ``"low_var_kl"``: ``kl_coef``
  with ``kl_estimator`` ``"k1"`` / ``"k2"`` / ``"k3"`` (on ``ref_per_token_logps``;
  none given: no KL);
- ``loss_algo`` ``"grpo"`` / ``"gspo-token"``: ``ratio_level`` ``"token"`` / ``"sequence"``;
- ``loss_agg_mode`` ``"token-mean"``, ``"sequence-mean-token-mean"``,
  ``"seq-mean-token-sum"``: ``loss_agg`` ``"token-mean"``, ``"seq-mean-token-mean"``,
  ``"seq-mean-token-sum"`` (sequences without a completion token excluded, as in
  Tunix); ``"sequence-mean-token-scale"``: ``"seq-mean-token-sum-norm"`` with
  ``loss_normalizer = T * (sequences with a token)``;
- no ``old_per_token_logps``: on-policy (``old_logps=None``); ``sampler_is_weights``:
  ``importance_weights``; ``temperature``: ``temperature``.

Differences that remain: ratiokl bounds the log-ratio at ``+-20`` (``log_ratio_bound``)
and GSPO's sequence log-ratio at ``+-20``, where Tunix clips the token's at ``+-20`` and the
sequence's at ``+10`` only. Refused with a ``ValueError`` naming the field:
``kl_clamp_value``, another ``kl_loss_mode`` or ``loss_agg_mode``. The ids are not checked
on the host (``check_ids=False``: the loss runs under ``jit``); an out-of-range active id
makes its token's loss NaN.

``aux`` holds the keys the GRPO learner logs and those whose definitions agree with
Tunix's: ``kl`` (token mean of the KL), ``pg_clipfrac``, ``ppo_kl`` (mean ``old - logp``),
``is_ratio/mean``; and ratiokl's ``entropy_mean`` (the token mean, whatever the
aggregation).
"""

from __future__ import annotations

from typing import Any, Dict, NoReturn, Tuple

from ratiokl._requirements import import_framework

# Each says which extra to install when absent or too old (``ratiokl[tunix]`` brings both).
import_framework("jax", needed_by="ratiokl.adapters.tunix", extra="tunix")
import_framework("google-tunix", module="tunix", needed_by="ratiokl.adapters.tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tunix.rl import function_registry  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

from ratiokl.adapters import _tunix_batch, _tunix_heads, refuse  # noqa: E402
from ratiokl.adapters._tunix_heads import LMHead, register_lm_head  # noqa: E402
from ratiokl.jax.loss import (  # noqa: E402
    linear_policy_loss,
    linear_selected_logprobs,
    policy_loss,
    policy_objective,
)

__all__ = ["LOGITS_NAME", "NAME", "GRPOLearner", "LMHead", "grpo_logits_loss_fn",
           "grpo_loss_fn", "loss_options", "register_lm_head"]

#: The policy loss's name in Tunix's registry (``GRPOConfig(policy_loss_fn=NAME)``): from
#: the last hidden states and the lm_head.
NAME = "ratiokl_grpo"
#: The same loss from the model's full logits, for a model with no registered head.
LOGITS_NAME = "ratiokl_grpo_logits"
_KL = {"kl": "k1", "mse_kl": "k2", "low_var_kl": "k3"}
_RATIO_LEVEL = {"grpo": "token", "gspo-token": "sequence"}
_LOSS_AGG = {"token-mean": "token-mean", "sequence-mean-token-mean": "seq-mean-token-mean",
             "seq-mean-token-sum": "seq-mean-token-sum",
             "sequence-mean-token-scale": "seq-mean-token-sum-norm"}


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse(f"the {NAME!r} policy loss", "Tunix's 'grpo' policy loss", field, value, why)


def loss_options(algo_config: Any) -> Dict[str, Any]:
    """The :func:`~ratiokl.jax.loss.policy_loss` options of a Tunix ``GRPOConfig`` (the
    module docstring has the mapping); ``ValueError`` naming what is not computed alike."""
    kl_mode = getattr(algo_config, "kl_loss_mode", "kl")
    if kl_mode not in _KL:
        _refuse("kl_loss_mode", kl_mode, f"ratiokl maps {sorted(_KL)}")
    if getattr(algo_config, "kl_clamp_value", None) is not None:
        _refuse("kl_clamp_value", algo_config.kl_clamp_value, "ratiokl does not clamp the "
                "KL value (it bounds the log-ratio before exp)")
    loss_algo = getattr(algo_config, "loss_algo", "grpo")
    if loss_algo not in _RATIO_LEVEL:
        _refuse("loss_algo", loss_algo, f"ratiokl maps {sorted(_RATIO_LEVEL)}")
    agg = algo_config.loss_agg_mode
    if agg not in _LOSS_AGG:
        _refuse("loss_agg_mode", agg, f"ratiokl maps {sorted(_LOSS_AGG)}")
    epsilon = algo_config.epsilon
    return {
        "clip_eps": epsilon,
        "clip_eps_high": getattr(algo_config, "epsilon_high", None) or epsilon,
        "dual_clip": getattr(algo_config, "epsilon_c", None),
        "kl_coef": float(algo_config.beta or 0.0),
        "kl_estimator": _KL[kl_mode],
        "ratio_level": _RATIO_LEVEL[loss_algo],
        "loss_agg": _LOSS_AGG[agg],
        "temperature": float(getattr(algo_config, "temperature", 1.0) or 1.0),
    }


def _split(options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any], str]:
    """``loss_options``' dict as ``(objective options, kernel options, ratio_level)``: the
    kernel's ``temperature`` (and a ``backend``, where one is set) apart."""
    options = dict(options)
    kernel = {key: options.pop(key) for key in ("temperature", "backend") if key in options}
    return options, kernel, options.pop("ratio_level")


def _inputs(example: Any,
            options: Dict[str, Any]) -> Tuple[_tunix_batch.Targets, Dict[str, Any]]:
    """The scored tokens of ``example`` and the keyword arguments every route shares:
    the reference (none given: no KL term), the weights, the packing's segments and the
    normaliser of ``"sequence-mean-token-scale"``."""
    batch = _tunix_batch.targets(example)
    if batch.ref_logps is None:
        options["kl_coef"] = 0.0
    normalizer = None
    if options["loss_agg"] == "seq-mean-token-sum-norm":
        if batch.segment_ids is not None:
            _refuse("segment_ids", "given", "'sequence-mean-token-scale' divides by the padded "
                    "completion length, which a packed row does not have")
        rows = jnp.maximum(jnp.sum(jnp.any(batch.mask, axis=-1)), 1)  # Tunix: / T / rows
        normalizer = (batch.ids.shape[1] * rows).astype(jnp.float32)
    shared = {"ref_logps": batch.ref_logps, "loss_normalizer": normalizer,
              "importance_weights": batch.importance_weights,
              "segment_ids": batch.segment_ids, **options}
    return batch, shared


def _aux(metrics: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    return {"kl": metrics["kl_mean"], "pg_clipfrac": metrics["clip_fraction"],
            "ppo_kl": metrics["approx_kl"], "is_ratio/mean": metrics["ratio_mean"],
            "entropy_mean": metrics["entropy_mean"]}


def _head_of(model: Any) -> _tunix_heads.HeadOf:
    head_of = _tunix_heads.lm_head_of(model)
    if head_of is None:
        raise ValueError(
            f"the {NAME!r} policy loss does not know where a {type(model).__qualname__} "
            "keeps its hidden states and lm_head (it knows Gemma, Gemma3, Qwen2, Qwen3 and "
            "Tunix's ToyTransformer). Register its head with "
            "ratiokl.adapters.tunix.register_lm_head, or select the loss on the model's "
            f"full logits: GRPOConfig(policy_loss_fn={LOGITS_NAME!r})")
    return head_of


def grpo_loss_fn(model: Any, train_example: Any, algo_config: Any, pad_id: int, eos_id: int,
                 **kwargs: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Tunix's policy-loss signature: ``(loss, aux)`` of one ``TrainExample``, from the
    model's last hidden states and its lm_head (``"ratiokl_grpo"``).

    The model runs as Tunix runs it (``common.process_ids``), with
    ``output_hidden_states=True``; the hidden states ``[B, T, H]`` of the scoring
    positions and the head (:func:`register_lm_head`'s ``LMHead``: weight, bias, softcap)
    go to :func:`ratiokl.jax.loss.linear_policy_loss` (``loss_algo="gspo-token"``:
    :func:`~ratiokl.jax.loss.linear_selected_logprobs` then
    :func:`~ratiokl.jax.loss.policy_objective`), so no ``[B, T, V]`` float32 logits are
    built (on a GPU; the CPU's ``"native"`` backend builds the scored rows' logits at
    once). Differentiable w.r.t. the model's parameters through the hidden states and the
    head. A model class with no registered head is refused (``ValueError``).
    """
    del kwargs
    objective, kernel, ratio_level = _split(loss_options(algo_config))
    head_of = _head_of(model)
    tokens, call = _tunix_batch.model_call(model, train_example, pad_id, eos_id)
    hidden = _tunix_batch.scoring(_tunix_heads.hidden_states(model, tokens, call),
                                  train_example)
    head = head_of(model)
    dtype = head.dtype or jnp.result_type(hidden, head.weight)
    cast = {"bias": None if head.bias is None else head.bias.astype(dtype),
            "logit_softcap": head.logit_softcap, "check_ids": False, **kernel}
    hidden, weight = hidden.astype(dtype), head.weight.astype(dtype)
    batch, shared = _inputs(train_example, objective)
    if ratio_level == "token":
        loss, metrics = linear_policy_loss(hidden, weight, batch.ids, batch.mask,
                                           batch.old_logps, batch.advantages, **cast, **shared)
    else:
        logp, entropy = linear_selected_logprobs(hidden, weight, batch.ids, batch.mask,
                                                 return_entropy=True, **cast)
        loss, metrics = policy_objective(logp, batch.old_logps, batch.advantages, batch.mask,
                                         entropy=entropy, ratio_level=ratio_level, **shared)
    return loss, _aux(metrics)


def grpo_logits_loss_fn(model: Any, train_example: Any, algo_config: Any, pad_id: int,
                        eos_id: int, **kwargs: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """:func:`grpo_loss_fn` from the model's full logits (``"ratiokl_grpo_logits"``), for a
    model whose head is not registered: the model returns ``(logits [B, L, V], cache)``,
    and :func:`ratiokl.jax.loss.policy_loss` runs on the scoring positions' logits (one
    fused kernel on a GPU). Differentiable through the logits."""
    del kwargs
    objective, kernel, ratio_level = _split(loss_options(algo_config))
    tokens, call = _tunix_batch.model_call(model, train_example, pad_id, eos_id)
    logits, _ = model(tokens, **call)
    batch, shared = _inputs(train_example, objective)
    loss, metrics = policy_loss(
        _tunix_batch.scoring(logits, train_example), None, batch.ids, batch.mask,
        batch.old_logps, batch.advantages, ratio_level=ratio_level, check_ids=False,
        **kernel, **shared)
    return loss, _aux(metrics)


function_registry.register_policy_loss_fn(NAME)(grpo_loss_fn)
function_registry.register_policy_loss_fn(LOGITS_NAME)(grpo_logits_loss_fn)


class GRPOLearner(grpo_learner.GRPOLearner):
    """Tunix's ``GRPOLearner`` (same arguments) that refuses, when built, what the
    ``"ratiokl_grpo"`` / ``"ratiokl_grpo_logits"`` loss would refuse at the first train
    step: the module docstring's list (and, for ``"ratiokl_grpo"``, an actor whose head is
    not registered), each ``ValueError`` naming its field. Nothing has run yet then (no
    rollout)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # sets the fields read here; runs nothing
        config = self.algo_config
        if config.policy_loss_fn not in (NAME, LOGITS_NAME):
            raise ValueError(
                f"ratiokl.adapters.tunix.GRPOLearner runs the {NAME!r} or {LOGITS_NAME!r} "
                f"policy loss; got `policy_loss_fn={config.policy_loss_fn!r}`. Set "
                f"GRPOConfig(policy_loss_fn={NAME!r}), or use tunix's "
                "grpo_learner.GRPOLearner for its own loss")
        options = loss_options(config)
        packing = getattr(self._training_config, "max_seq_token_per_tpu", None)
        if packing is not None and options["loss_agg"] == "seq-mean-token-sum-norm":
            _refuse("max_seq_token_per_tpu", packing, "'sequence-mean-token-scale' divides "
                    "by the padded completion length, which a packed row does not have")
        if config.policy_loss_fn == NAME:
            _head_of(self.rl_cluster.actor_trainer.model)
