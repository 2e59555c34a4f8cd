"""OpenRLHF's PPO actor with ratiokl's log-probs, entropy and policy loss.

Two drop-ins for OpenRLHF 0.11 (``ratiokl[openrlhf]``; tested: 0.11.2 on the CPU):

- :class:`PolicyLoss`: ``openrlhf.models.PolicyLoss``'s constructor, forward and five
  outputs on :func:`ratiokl.torch.loss.policy_objective` (its arguments resolve once, at
  construction; what ratiokl computes otherwise is refused there with a ``ValueError``
  naming the argument);
- :func:`actor_forward`: ``Actor.forward`` whose action log-probs and entropies come from
  the decoder's last hidden states and the lm_head weight through
  :func:`ratiokl.torch.loss.linear_selected_logprobs`: the ``[B, S, V]`` float32 logits
  OpenRLHF builds are never held.

Usage: one import and one line, before OpenRLHF builds its actors (in each process that
builds them: OpenRLHF's Ray workers too, docs/trainers.md says how)::

    from ratiokl.adapters.openrlhf import install
    install()  # ActorPPOTrainer builds ratiokl's PolicyLoss; every Actor runs ratiokl's forward

The KL term (``compute_approx_kl`` on the log-probs) and the entropy's aggregation stay
OpenRLHF's own code in ``training_step``, on the log-probs and entropies of ratiokl's
forward.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

from ratiokl._requirements import MissingDependency, import_framework


def _run_by_python_m() -> bool:
    """Whether ``python -m ratiokl.adapters.openrlhf`` is importing this package to find
    its ``__main__`` (``sys.argv[0]`` is ``"-m"`` while Python locates the module)."""
    argv = sys.orig_argv
    return (sys.argv[:1] == ["-m"] and "-m" in argv
            and argv[argv.index("-m") + 1:argv.index("-m") + 2] == [__name__])


try:  # each says which extra to install when absent or too old (``ratiokl[openrlhf]``)
    import_framework("torch", needed_by="ratiokl.adapters.openrlhf", extra="openrlhf")
    import_framework("openrlhf", needed_by="ratiokl.adapters.openrlhf")
except MissingDependency as missing:
    if not _run_by_python_m():
        raise
    print(f"python -m {__name__}: {missing}", file=sys.stderr)  # a command line's one line
    raise SystemExit(2) from None

from ratiokl.adapters.openrlhf._actor import ActorOutput, actor_forward  # noqa: E402
from ratiokl.adapters.openrlhf._options import loss_options  # noqa: E402
from ratiokl.adapters.openrlhf._policy_loss import PolicyLoss  # noqa: E402
from ratiokl.spec import BackendName  # noqa: E402

__all__ = ["ActorOutput", "PolicyLoss", "actor_forward", "install", "loss_options"]


def install(backend: BackendName = "auto",
            chunk_rows: Optional[int] = None) -> Callable[[], None]:
    """Make OpenRLHF (this process) use ratiokl: ``openrlhf.models.Actor.forward`` becomes
    :func:`actor_forward` (``backend``, ``chunk_rows``) and ``ActorPPOTrainer`` builds
    :class:`PolicyLoss` (the name in ``openrlhf.trainer.ray.ppo_actor``; trainers built
    before keep theirs). Imports OpenRLHF's actor trainer module (it needs its own
    dependencies, vLLM and flash-attn, as OpenRLHF does). Calling it again replaces the
    forward (the new ``backend``). Returns a function that puts OpenRLHF's own back."""
    from openrlhf.models.actor import Actor
    from openrlhf.trainer.ray import ppo_actor

    previous = (Actor.forward, ppo_actor.PolicyLoss)
    Actor.forward = actor_forward(backend, chunk_rows)
    ppo_actor.PolicyLoss = PolicyLoss

    def restore() -> None:
        Actor.forward, ppo_actor.PolicyLoss = previous

    return restore
