"""The one place ratiokl imports and calls ``jax_triton`` (0.3.1 and 0.4.x).

What differs between the supported releases, and how it is handled here:

- Both empty ``TRITON_CACHE_DIR`` on import, after which every later Triton
  compile in the process (PyTorch's too) fails: :func:`import_jax_triton`
  puts a usable value back and removes an empty one.
- 0.4 renamed ``triton_call``'s ``out_shape=`` to ``out_type=`` (the old name
  still works there, with a ``DeprecationWarning``): :func:`call_keywords`
  passes the name the installed release expects.
- 0.4 deprecates ``input_output_aliases=`` and ``zeroed_outputs=`` in favour of
  ``jax.Ref`` arguments, which 0.3.1 does not have; ratiokl keeps the one
  spelling both take and silences those two warnings around its own call
  (:func:`triton_call`).

Versions are checked against :data:`ratiokl._requirements.REQUIREMENTS`
before the import, so a missing or too-old release fails with the installed
and the needed versions and the extra to install.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Any, Dict, Tuple

from ratiokl._requirements import installed_version, parse_version, require

__all__ = ["OUT_TYPE_SINCE", "call_keywords", "import_jax_triton", "triton_call"]

#: The first jax-triton release whose ``triton_call`` takes ``out_type=``.
OUT_TYPE_SINCE: Tuple[int, ...] = (0, 4)

#: jax-triton 0.4's deprecation messages for the keywords both releases take.
_DEPRECATED_KEYWORDS = ("input_output_aliases is deprecated", "zeroed_outputs is deprecated")


def import_jax_triton() -> ModuleType:
    """``import jax_triton`` once Triton's and jax-triton's versions are checked, without
    letting it clear ``TRITON_CACHE_DIR`` for the process.

    Raises :class:`ratiokl._requirements.MissingDependency` (an ``ImportError``)
    naming the installed and needed versions; any other import failure (a CPU
    jaxlib) propagates with jax-triton's own message.
    """
    for distribution in ("triton", "jax-triton"):
        require(distribution, needed_by="backend='triton' in ratiokl.jax", extra="jax-triton")
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    finally:
        if saved:
            os.environ["TRITON_CACHE_DIR"] = saved
        else:
            os.environ.pop("TRITON_CACHE_DIR", None)
    return jax_triton


def call_keywords(version: str, keywords: Dict[str, Any]) -> Dict[str, Any]:
    """``triton_call`` keywords as ratiokl writes them (``out_shape=``), spelled for
    jax-triton ``version``."""
    if parse_version(version) < OUT_TYPE_SINCE or "out_shape" not in keywords:
        return keywords
    keywords = dict(keywords)
    keywords["out_type"] = keywords.pop("out_shape")
    return keywords


def triton_call(*args: Any, **keywords: Any) -> Any:
    """``jax_triton.triton_call`` with the keywords of the installed release."""
    module = import_jax_triton()
    keywords = call_keywords(installed_version("jax-triton") or "0", keywords)
    with warnings.catch_warnings():
        for message in _DEPRECATED_KEYWORDS:
            warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
        return module.triton_call(*args, **keywords)
