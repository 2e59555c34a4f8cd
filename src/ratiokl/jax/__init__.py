"""JAX front end of ratiokl: ``from ratiokl.jax import loss``.

``loss`` holds the public functions; every other module here is private.
"""

from ratiokl._requirements import import_framework

import_framework("jax", needed_by="ratiokl.jax")  # says which extra to install

from ratiokl.jax import loss  # noqa: E402

__all__ = ["loss"]
