"""Drop-in adapters: a trainer's own loss step computed by ratiokl.

``import ratiokl`` imports no adapter. Each module imports its framework and trainer when
it is imported (an ``ImportError`` naming the extra to install where one is missing) and
translates that trainer's configuration into ratiokl's options once, when the trainer is
built, refusing with a ``ValueError`` that names the configuration field whatever
ratiokl would compute differently:

- :mod:`ratiokl.adapters.trl` -- TRL's ``GRPOTrainer`` (``trl >= 1.15``) with the policy
  loss and its gradients from the last hidden states and the lm_head weight
  (:func:`ratiokl.torch.loss.linear_policy_loss`), never the ``[N, V]`` logits;
- :mod:`ratiokl.adapters.tunix` -- Tunix's GRPO learner (``google-tunix >= 0.1.7``, JAX)
  with the policy loss ``"ratiokl_grpo"`` (:func:`ratiokl.jax.loss.linear_policy_loss` on
  the last hidden states and the model's head) and ``"ratiokl_grpo_logits"`` (on the
  model's logits), registered in Tunix's function registry on import; its
  ``GRPOLearner`` checks the configuration when built;
- :mod:`ratiokl.adapters.verl` -- verl's policy losses ``"ratiokl"``, ``"ratiokl_gspo"``,
  ``"ratiokl_cispo"`` (:func:`ratiokl.torch.loss.policy_objective` on the log-probs
  verl's engine hands them) and its fused-kernel backend ``"ratiokl"`` (the log-probs and
  entropies from :func:`ratiokl.torch.loss.linear_selected_logprobs`), registered when
  ``import verl`` loads the ``verl.plugins`` entry point (``verl >= 0.9.1``); the
  configuration is checked at the first call (verl runs no hook before).
- :mod:`ratiokl.adapters.openrlhf` -- OpenRLHF's PPO actor (``openrlhf >= 0.11``):
  ``install()`` makes ``ActorPPOTrainer`` build a ``PolicyLoss`` computed by
  :func:`ratiokl.torch.loss.policy_objective` and ``Actor.forward`` take its log-probs and
  entropies from the last hidden states (:func:`ratiokl.torch.loss.linear_selected_logprobs`).
"""

from __future__ import annotations

from typing import Any, NoReturn


def refuse(adapter: str, fallback: str, field: str, value: Any, why: str) -> NoReturn:
    """Raise the adapters' one ``ValueError``: ``adapter`` cannot compute ``field=value``
    (``why``); ``fallback`` is the trainer's own code path for that configuration."""
    raise ValueError(
        f"{adapter} cannot compute `{field}={value!r}`: {why}. Use {fallback} for this "
        "configuration, or change the field"
    )
