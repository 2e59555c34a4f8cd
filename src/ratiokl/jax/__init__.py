"""JAX front end of ratiokl: ``from ratiokl.jax import loss``.

``loss`` holds the public functions; every other module here is private.
"""

from ratiokl.jax import loss

__all__ = ["loss"]
