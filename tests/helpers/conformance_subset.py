"""Which conformance fixtures a target that runs a subset by default runs (``conftest.py``):
the rule, in one place."""

from __future__ import annotations

from typing import Dict, Iterable, List

from ratiokl import harness

#: Targets that run :func:`representative_cases` of the fixtures unless ``--backends`` is
#: given: each ``jax-interpret`` case pays a JAX compilation (about as long as the whole
#: case takes on ``jax-native``), and ``torch-interpret`` runs every fixture through the
#: same kernels.
SUBSET_TARGETS = ("jax-interpret",)
#: ``(target fixture, target)`` pairs that run the subset too: the strided second pass
#: (``torch_target``) through the interpreter. The strides are the same pointer arithmetic
#: for every dtype of a group, and at about 3 s a case the full pass cost CI minutes in
#: two of its blocks (``ratiokl check --backend torch-interpret`` runs it on all).
SUBSET_PAIRS = frozenset({("torch_target", "torch-interpret")})


def representative_cases(names: Iterable[str]) -> List[str]:
    """One case of each fixture group (a group: one scenario in each dtype), the dtypes
    taken in turn over the groups in sorted order; a group without the dtype whose turn
    it is gives its first case."""
    manifest = harness.load_manifest()["cases"]
    groups: Dict[str, Dict[str, str]] = {}
    for name in sorted(names):
        entry = manifest[name]
        groups.setdefault(entry["group"], {}).setdefault(entry["dtype"], name)
    dtypes = harness.LOGIT_DTYPES
    chosen = []
    for turn, group in enumerate(sorted(groups)):
        by_dtype = groups[group]
        chosen.append(by_dtype.get(dtypes[turn % len(dtypes)], next(iter(by_dtype.values()))))
    return sorted(chosen)
