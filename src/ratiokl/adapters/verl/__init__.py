"""verl (``verl >= 0.9.1``) with ratiokl's policy loss and fused actor forward.

Importing this module registers, in verl's own registries:

- the policy losses ``"ratiokl"`` (verl's ``vanilla``: PPO with the dual clip),
  ``"ratiokl_gspo"`` and ``"ratiokl_cispo"`` with ``core_algos.register_policy_loss``,
  selected by ``actor_rollout_ref.actor.policy_loss.loss_mode``: the loss is
  :func:`ratiokl.torch.loss.policy_objective` on the log-probs verl's ``ppo_loss`` hands a
  policy loss (:mod:`ratiokl.adapters.verl._loss` maps the ``ActorConfig``);
- the fused-kernel backend ``"ratiokl"``, selected by
  ``actor_rollout_ref.model.use_fused_kernels=True`` and
  ``actor_rollout_ref.model.fused_kernel_options.impl_backend=ratiokl``: the FSDP engine's
  model forward returns ``log_probs`` and ``entropy`` through
  :func:`ratiokl.torch.loss.linear_selected_logprobs` (:mod:`ratiokl.adapters.verl._forward`).

verl imports it by itself: ``pip install 'ratiokl[verl]'`` declares it as a
``verl.plugins`` entry point, which ``import verl`` loads in every process (the driver
and each Ray worker; ``VERL_USE_EXTERNAL_PLUGINS=none`` turns that off). Without the
entry point, ``actor_rollout_ref.model.external_lib=ratiokl.adapters.verl`` or
``VERL_USE_EXTERNAL_MODULES=ratiokl.adapters.verl`` imports it the same way.
docs/trainers.md has the switch and the mapping table.
"""

from __future__ import annotations

from ratiokl._requirements import import_framework

# Each says which extra to install when absent or too old (``ratiokl[verl]`` brings both).
import_framework("torch", needed_by="ratiokl.adapters.verl", extra="verl")
import_framework("verl", needed_by="ratiokl.adapters.verl")

from verl.trainer.ppo import core_algos  # noqa: E402

from ratiokl.adapters.verl import _advantages  # noqa: E402,F401 (ratiokl_* estimators)
from ratiokl.adapters.verl._forward import (  # noqa: E402
    BACKEND, forward, install, use_ratiokl_forward)
from ratiokl.adapters.verl._loss import (  # noqa: E402
    LOSS_NAMES, loss_normalizer, loss_options, make_policy_loss)

__all__ = ["BACKEND", "LOSS_NAMES", "forward", "loss_normalizer", "loss_options",
           "use_ratiokl_forward"]

for _name, _variant in LOSS_NAMES.items():
    core_algos.register_policy_loss(_name)(make_policy_loss(_variant))
install()
