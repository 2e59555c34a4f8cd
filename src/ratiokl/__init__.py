"""ratiokl: fused per-token importance ratio, KL penalty and PPO/GRPO policy loss.

``import ratiokl`` imports neither PyTorch nor JAX. Use the framework entry
points: ``from ratiokl.torch import loss`` or ``from ratiokl.jax import loss``.
"""

__version__ = "0.1.0"
