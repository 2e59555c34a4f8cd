"""PyTorch front end of ratiokl: ``from ratiokl.torch import loss`` (and ``advantages``).

``loss`` and ``advantages`` hold the public functions; every other module here is private.
"""

from ratiokl._requirements import import_framework

import_framework("torch", needed_by="ratiokl.torch")  # says which extra to install

from ratiokl.torch import advantages, loss  # noqa: E402

__all__ = ["advantages", "loss"]
