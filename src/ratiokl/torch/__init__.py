"""PyTorch front end of ratiokl: ``from ratiokl.torch import loss``.

``loss`` holds the public functions; every other module here is private.
"""

from ratiokl.torch import loss

__all__ = ["loss"]
