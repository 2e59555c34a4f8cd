"""``python -m ratiokl.adapters.openrlhf ARGS``: OpenRLHF's ``train_ppo_ray`` with ratiokl.

OpenRLHF builds its actors in Ray worker processes, where a patch made in the launching
process does not reach. This runs ``python -m openrlhf.cli.train_ppo_ray ARGS`` (the same
arguments) after starting Ray with :func:`ratiokl.adapters.openrlhf.install` as the
workers' ``worker_process_setup_hook``: every worker calls it before it builds anything.
Ray is started with OpenRLHF's own environment variables (``train_ppo_ray.train`` then
finds it started and keeps it).
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

#: The hook every Ray worker runs (Ray imports the module and calls the function).
HOOK = "ratiokl.adapters.openrlhf.install"
#: ``openrlhf.cli.train_ppo_ray.train``'s ``ray.init`` variables and their defaults.
_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN",
                 "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}


def runtime_env() -> dict:
    """The ``ray.init`` runtime environment: OpenRLHF's variables and the setup hook."""
    return {"env_vars": {k: os.environ.get(k, v) for k, v in _ENV_DEFAULTS.items()},
            "worker_process_setup_hook": HOOK}


def main(argv: Sequence[str]) -> None:
    """Start Ray with :func:`runtime_env` (unless started) and run OpenRLHF's CLI on
    ``argv``."""
    import ray

    if not ray.is_initialized():
        ray.init(runtime_env=runtime_env())
    sys.argv = ["openrlhf.cli.train_ppo_ray", *argv]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
