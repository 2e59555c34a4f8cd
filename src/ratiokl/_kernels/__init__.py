"""Triton kernels of ratiokl and their launch heuristics; imports only ``triton``.

Both frameworks launch these very functions: PyTorch directly (and through
Triton's interpreter on CPU tensors: :func:`interpreted` gives the twin), JAX through
``jax_triton.triton_call``.

Kernels (one program per row of ``[N, V]`` logits):
    logp_forward_kernel   -- log-prob, ratio, KL, dKL/dlogp and log-sum-exp per row
    logp_backward_kernel  -- ``c * (onehot - softmax) / T`` in the logits' dtype
    shard_stats_kernel    -- a vocabulary shard's partial log-sum-exp and selected logit
    lse_partials_kernel   -- few rows: partial log-sum-exps per (row, vocabulary split)
    logp_combine_kernel   -- few rows: folds the partials into the forward's outputs

The fused policy loss (``fused_loss``, with ``objective``) and its row-vector kernels
(``loss_rows``) are imported from their modules by the launchers.
"""

from ratiokl._kernels import heuristics
from ratiokl._kernels.backward import logp_backward_kernel
from ratiokl._kernels.forward import logp_forward_kernel
from ratiokl._kernels.heuristics import *  # noqa: F401,F403 (its __all__: the launch heuristics)
from ratiokl._kernels.interpret import interpreted
from ratiokl._kernels.shard_stats import shard_stats_kernel
from ratiokl._kernels.split_forward import logp_combine_kernel, lse_partials_kernel

__all__ = [
    *heuristics.__all__,
    "interpreted",
    "logp_backward_kernel",
    "logp_combine_kernel",
    "logp_forward_kernel",
    "lse_partials_kernel",
    "shard_stats_kernel",
]
