"""``python -m ratiokl``: the same command line as the ``ratiokl`` script (``ratiokl._cli``)."""

import sys

from ratiokl._cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
