"""Triton kernels of ratiokl and their launch heuristics; imports only ``triton``.

Both frameworks launch these very functions: PyTorch directly (and through
Triton's interpreter on CPU tensors: :func:`interpreted` gives the twin), JAX through
``jax_triton.triton_call``.

Kernels (one program per row of ``[N, V]`` logits):
    logp_forward_kernel   -- log-prob, ratio, KL, dKL/dlogp and log-sum-exp per row
    logp_backward_kernel  -- ``c * (onehot - softmax) / T`` in the logits' dtype
"""

from ratiokl._kernels.backward import logp_backward_kernel
from ratiokl._kernels.forward import logp_forward_kernel
from ratiokl._kernels.heuristics import LaunchConfig, backward_config, forward_config
from ratiokl._kernels.interpret import interpreted

__all__ = [
    "LaunchConfig",
    "backward_config",
    "forward_config",
    "interpreted",
    "logp_backward_kernel",
    "logp_forward_kernel",
]
