"""Which ``shard_map`` mesh axes an array is typed as varying over (JAX's ``vma``).

Below every module that asks: the GEMMs (``_lm_head``), the Triton launches (``_triton``,
``_triton_shard``) and the vocabulary-parallel paths (``_vocab_parallel``,
``_vocab_linear``).
"""

from __future__ import annotations

import jax

__all__ = ["varies_over", "varying_axes"]


def varying_axes(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` is typed as varying over inside ``shard_map`` (none outside it,
    or with ``check_vma=False``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # JAX < 0.9 spelling
    if vma is None:
        manual = getattr(aval, "manual_axis_type", None)
        vma = frozenset() if manual is None else manual.varying
    return frozenset(vma)


def varies_over(x: jax.Array, axis: str) -> bool:
    """Whether ``x`` is typed as varying over mesh ``axis`` (never with ``check_vma=False``)."""
    return axis in varying_axes(x)
