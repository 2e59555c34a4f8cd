"""Every jax-triton launch of the JAX binding: one call function per kernel, vmap-ready.

Each ``*_call`` function launches ``ratiokl._kernels`` on ``[N, V]`` / ``[N]``
arrays through ``call``, a :data:`TritonCall`: ``ratiokl.jax._jax_triton.triton_call``
(the ``"triton"`` backend) or ``ratiokl.jax._interpret.triton_call`` (``"interpret"``:
the same launch through Triton's CPU interpreter). Each ``*_op`` factory, cached per
``call`` and static options, wraps one in a ``jax.custom_batching.custom_vmap``
(``triton_call`` has no batching rule): row-independent kernels fold batch dimensions
into rows (:func:`row_op`), the reductions over rows (weights, metrics) map the
framework ops instead. ``ratiokl.jax._triton`` gives them their derivatives
(``jax.custom_vjp``).

Launch details: block sizes come from ``ratiokl._kernels`` heuristics (no
autotuning, so CUDA-graph capture works); ``V`` and the strides are passed
as compile-time constants, which keeps the loads vectorised (jax-triton
gives runtime integers no alignment facts); the mask travels as bool; a
scalar temperature is a ``[1]`` array read with stride 0. ``jax_triton`` is
imported on the ``"triton"`` backend's first launch, through ``_jax_triton`` (versions
checked, the differences between 0.3.1 and 0.4 handled there); this module imports
neither it nor the interpreter. The kernels clamp ids and poison bad active rows with
NaN; nothing synchronises with the host.

One module per kernel family, as in ``ratiokl.torch._launch``: ``logprobs`` (the row
forward and backward), ``loss`` (the fused loss, its metrics, the row scaling), ``weights``
(the token-mean weights, the rollout correction's weights), ``shard`` (a vocabulary
shard's statistics); ``vmap`` holds the launch function's type and the batching rules.
This package names what the bindings call.
"""

from ratiokl.jax._launch.logprobs import backward_op, forward_op
from ratiokl.jax._launch.loss import Static, fused_op, metrics_op, scale_op
from ratiokl.jax._launch.shard import stats_op
from ratiokl.jax._launch.vmap import TritonCall, row_op
from ratiokl.jax._launch.weights import native_weights, rollout_op, weights_op

__all__ = [
    "Static", "TritonCall", "backward_op", "forward_op", "fused_op", "metrics_op", "row_op",
    "native_weights", "rollout_op", "scale_op", "stats_op", "weights_op",
]
