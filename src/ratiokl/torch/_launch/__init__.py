"""Every Triton launch of the PyTorch binding, each described once and bound three ways.

A launch is a plain function ``launch(kernels, *args)``; :class:`~.op.KernelOp` binds it
as an eager, a compiled and an interpreted op (``op``). One module per kernel family:

* ``logprobs``: the row forward (log-prob, ratio, KL, entropy) and its backward;
* ``loss``: the fused policy loss, its metrics and the gradient's row scaling;
* ``weights``: the token-mean weights and the rollout correction's weights;
* ``shard``: one vocabulary shard's statistics (vocab-parallel);
* ``active``: the active-row id and temperature check.

This package names the ops the backends call (the modules hold them).
"""

from ratiokl.torch._launch.active import active_flags
from ratiokl.torch._launch.logprobs import (
    BACKWARD,
    ENTROPY_FORWARD,
    FORWARD,
    entropy_forward,
    row_backward,
    row_forward,
)
from ratiokl.torch._launch.loss import (
    POLICY_LOSS,
    SCALE_ROWS,
    fused_policy_loss,
    metrics_size,
    policy_loss_rows,
    policy_metrics,
    row_scratch,
    scale_rows_,
)
from ratiokl.torch._launch.op import KernelOp, binding_for, kernels_for
from ratiokl.torch._launch.shard import SHARD_STATS, shard_stats
from ratiokl.torch._launch.weights import (
    ROLLOUT_WEIGHTS,
    TOKEN_WEIGHTS,
    rollout_weights,
    token_weights,
)

__all__ = [
    "BACKWARD", "ENTROPY_FORWARD", "FORWARD", "KernelOp", "POLICY_LOSS", "ROLLOUT_WEIGHTS",
    "SCALE_ROWS", "SHARD_STATS", "TOKEN_WEIGHTS", "active_flags", "binding_for",
    "entropy_forward", "fused_policy_loss", "kernels_for", "metrics_size", "policy_loss_rows",
    "policy_metrics", "rollout_weights", "row_backward", "row_forward", "row_scratch", "scale_rows_",
    "shard_stats", "token_weights",
]
