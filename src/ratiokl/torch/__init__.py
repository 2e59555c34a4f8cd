"""PyTorch front end of ratiokl: ``from ratiokl.torch import loss``.

``loss`` holds the public functions; every other module here is private.
"""

from ratiokl._requirements import import_framework

import_framework("torch", needed_by="ratiokl.torch")  # says which extra to install

from ratiokl.torch import loss  # noqa: E402

__all__ = ["loss"]
