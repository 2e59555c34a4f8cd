"""Tunix's GRPO loss computed by :func:`ratiokl.jax.loss.policy_loss`.

Importing this module registers the policy loss ``"ratiokl_grpo"`` in Tunix's function
registry (``tunix.rl.function_registry``). Select it by name and build the learner from
this module (Tunix's ``GRPOLearner`` with the configuration checked when it is built)::

    from ratiokl.adapters.tunix import GRPOLearner  # registers "ratiokl_grpo"
    from tunix.rl.grpo.grpo_learner import GRPOConfig

    algo_config = GRPOConfig(..., policy_loss_fn="ratiokl_grpo")
    learner = GRPOLearner(rl_cluster, algo_config, reward_fns)

The learner then calls :func:`grpo_loss_fn` where it would call Tunix's ``grpo`` loss.
The model call is Tunix's own (``common.process_ids`` for positions and the causal
mask, then the model, which returns the logits). One fused kernel then computes the
loss, its metrics and the policy-logit gradient (``backend="auto"``: Triton through
jax-triton on a GPU, else the native path), instead of log-softmax, the loss terms,
and an entropy pass over the logits. Inactive (padding) positions are isolated by
construction: whatever their logits hold, they add nothing and get an exact zero
gradient.

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
``kl_clamp_value``, another ``kl_loss_mode`` or ``loss_agg_mode``, packed sequences
(``segment_ids``). The ids are not checked on the host (``check_ids=False``: the loss
runs under ``jit``); an out-of-range active id makes its token's loss NaN.

``aux`` holds the keys the GRPO learner logs and those whose definitions agree with
Tunix's: ``kl`` (token mean of the KL), ``pg_clipfrac``, ``ppo_kl`` (mean ``old - logp``),
``is_ratio/mean``; and ratiokl's ``entropy_mean`` (the token mean, whatever the
aggregation).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, NoReturn, Tuple

from ratiokl._requirements import import_framework

# Each says which extra to install when absent or too old (``ratiokl[tunix]`` brings both).
import_framework("jax", needed_by="ratiokl.adapters.tunix", extra="tunix")
import_framework("google-tunix", module="tunix", needed_by="ratiokl.adapters.tunix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from tunix.rl import common, function_registry  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402

from ratiokl.adapters import refuse  # noqa: E402
from ratiokl.jax.loss import policy_loss  # noqa: E402

__all__ = ["NAME", "GRPOLearner", "grpo_loss_fn", "loss_options"]

#: The policy loss's name in Tunix's registry (``GRPOConfig(policy_loss_fn=NAME)``).
NAME = "ratiokl_grpo"
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


def _takes_segment_ids(model: Any) -> bool:
    """Whether the model's call takes ``segment_ids`` (Tunix passes its non-pad mask there,
    for attention kernels without a 2-D mask)."""
    try:
        params = inspect.signature(model.__call__).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "segment_ids" or p.kind is p.VAR_KEYWORD for p in params)


def grpo_loss_fn(model: Any, train_example: Any, algo_config: Any, pad_id: int, eos_id: int,
                 **kwargs: Any) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Tunix's policy-loss signature: ``(loss, aux)`` of one ``TrainExample``.

    ``model`` returns ``(logits [B, L, V], cache)``; the completions' logits are the
    positions before each completion token. Differentiable w.r.t. the model's
    parameters through the logits only.
    """
    del kwargs
    options = loss_options(algo_config)
    if getattr(train_example, "segment_ids", None) is not None:
        _refuse("segment_ids", "given", "packed sequences are not mapped yet")
    completion_ids = train_example.completion_ids
    tokens, positions, attn_mask, seg_ids = common.process_ids(
        train_example.prompt_ids, completion_ids, pad_id, eos_id)
    call: Dict[str, Any] = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    if seg_ids is not None and _takes_segment_ids(model):  # as Tunix passes them
        call["segment_ids"] = seg_ids
    logits, _ = model(tokens, **call)
    completions = completion_ids.shape[1]
    logits = logits[:, -completions - 1:-1]
    mask = train_example.completion_mask.astype(jnp.bool_)
    ref = train_example.ref_per_token_logps
    if ref is None:
        options["kl_coef"] = 0.0
    normalizer = None
    if options["loss_agg"] == "seq-mean-token-sum-norm":  # Tunix: / T / sequences with a token
        rows = jnp.maximum(jnp.sum(jnp.any(mask, axis=-1)), 1)
        normalizer = (completions * rows).astype(jnp.float32)
    weights = getattr(train_example, "sampler_is_weights", None)
    loss, metrics = policy_loss(
        logits, None, completion_ids, mask, train_example.old_per_token_logps,
        train_example.advantages, ref_logps=ref, loss_normalizer=normalizer,
        importance_weights=weights, check_ids=False, **options)
    aux = {"kl": metrics["kl_mean"], "pg_clipfrac": metrics["clip_fraction"],
           "ppo_kl": metrics["approx_kl"], "is_ratio/mean": metrics["ratio_mean"],
           "entropy_mean": metrics["entropy_mean"]}
    return loss, aux


function_registry.register_policy_loss_fn(NAME)(grpo_loss_fn)


class GRPOLearner(grpo_learner.GRPOLearner):
    """Tunix's ``GRPOLearner`` (same arguments) that refuses, when built, what the
    ``"ratiokl_grpo"`` loss would refuse at the first train step: the module docstring's
    list, each ``ValueError`` naming its field. Nothing has run yet then (no rollout)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # sets the fields read here; runs nothing
        config = self.algo_config
        if config.policy_loss_fn != NAME:
            raise ValueError(
                f"ratiokl.adapters.tunix.GRPOLearner runs the {NAME!r} policy loss; got "
                f"`policy_loss_fn={config.policy_loss_fn!r}`. Set GRPOConfig(policy_loss_fn="
                f"{NAME!r}), or use tunix's grpo_learner.GRPOLearner for its own loss")
        loss_options(config)
        packing = getattr(self._training_config, "max_seq_token_per_tpu", None)
        if packing is not None:
            _refuse("max_seq_token_per_tpu", packing, "packed sequences are not mapped yet")
