"""JAX front end of ratiokl: ``from ratiokl.jax import loss`` (and ``advantages``).

``loss`` and ``advantages`` hold the public functions; every other module here is private.
"""

from ratiokl._requirements import import_framework

import_framework("jax", needed_by="ratiokl.jax")  # says which extra to install

from ratiokl.jax import advantages, loss  # noqa: E402

__all__ = ["advantages", "loss"]
