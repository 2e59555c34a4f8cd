"""The versions ratiokl needs of each optional dependency, in one table.

Read by the errors a backend raises when its dependency is missing or too old,
by ``ratiokl check`` (the reason a target is unavailable) and by the import of
``ratiokl.torch`` / ``ratiokl.jax`` and of the adapters; ``tests/test_requirements.py`` and
``tests/test_docs.py`` keep the extras in ``pyproject.toml`` and the README's
install table in step with it. Versions come from installed distribution
metadata (nothing is imported), except in :func:`import_framework`, which
imports the framework it checks and reads its ``__version__``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Optional, Tuple

__all__ = ["REQUIREMENTS", "MissingDependency", "Requirement", "import_framework",
           "installed_version", "parse_version", "require", "unmet", "version_problem"]


@dataclass(frozen=True)
class Requirement:
    """One optional dependency: its pip name, the oldest version ratiokl supports, why
    that one, and the ratiokl extra that installs it."""

    distribution: str
    minimum: str
    extra: str
    why: str
    #: Other distribution names that install the same module (PyTorch's nightly and
    #: container builds ship Triton as ``pytorch-triton``).
    aliases: Tuple[str, ...] = ()

    @property
    def specifier(self) -> str:
        return f"{self.distribution}>={self.minimum}"


REQUIREMENTS: Dict[str, Requirement] = {
    r.distribution: r
    for r in (
        Requirement("torch", "2.4", "torch",
                    "the oldest PyTorch declared (tested: 2.11 on the GPU, 2.13 on the CPU)"),
        Requirement("jax", "0.8.2", "jax", "the oldest JAX the test suite has run on"),
        Requirement("triton", "3.6", "torch-triton",
                    "the oldest Triton whose compiler and interpreter run every kernel",
                    aliases=("pytorch-triton",)),
        Requirement("jax-triton", "0.3.1", "jax-triton",
                    "the oldest jax-triton whose triton_call takes ratiokl's launches; "
                    "0.3.1 runs on Triton 3.6, 0.4.x needs Python >= 3.12, JAX >= 0.11 "
                    "and Triton >= 3.7"),
        Requirement("trl", "1.15", "trl",
                    "the first TRL whose GRPOTrainer scores completions through a patched "
                    "model forward (ratiokl.adapters.trl's seam); tested: 1.16 on the CPU"),
        Requirement("verl", "0.9.1", "verl",
                    "the verl whose model-engine ppo_loss, policy-loss registry and "
                    "fused-forward patch ratiokl.adapters.verl was written and tested "
                    "against (CPU)"),
        Requirement("openrlhf", "0.11", "openrlhf",
                    "the OpenRLHF whose PolicyLoss, Actor.forward and ActorPPOTrainer "
                    "ratiokl.adapters.openrlhf mirrors; tested: 0.11.2 on the CPU"),
        Requirement("google-tunix", "0.1.7", "tunix",
                    "the Tunix whose policy-loss registry and TrainExample "
                    "ratiokl.adapters.tunix was written and tested against (CPU)"),
    )
}


class MissingDependency(ImportError):
    """An optional dependency is not installed or too old; the message says which extra
    to install."""


def parse_version(text: str) -> Tuple[int, ...]:
    """The leading release numbers of a version string: ``"3.7.1+cu128"`` -> ``(3, 7, 1)``."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    if match is None:
        raise ValueError(f"cannot read a release number from version {text!r}")
    return tuple(int(part) for part in match.group().split("."))


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (pip name, or one of its aliases in
    :data:`REQUIREMENTS`), or ``None`` if not installed."""
    req = REQUIREMENTS.get(distribution)
    for name in (distribution, *(req.aliases if req else ())):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def version_problem(distribution: str, version: Optional[str], *,
                    extra: Optional[str] = None) -> Optional[str]:
    """Why ``version`` (``None``: not installed) of ``distribution`` does not meet
    ratiokl's requirement, or ``None`` if it does. ``extra``: the ratiokl extra to
    suggest, when not the table's (Triton for JAX users comes with ``jax-triton``)."""
    req = REQUIREMENTS[distribution]
    extra = extra or req.extra
    if version is None:
        return (f"`{distribution}` is not installed; ratiokl needs {req.specifier} "
                f"(pip install 'ratiokl[{extra}]')")
    if parse_version(version) < parse_version(req.minimum):
        return (f"{distribution} {version} is installed; ratiokl needs {req.specifier} "
                f"({req.why}): pip install -U 'ratiokl[{extra}]'")
    return None


def unmet(distribution: str, *, extra: Optional[str] = None) -> Optional[str]:
    """Why the installed ``distribution`` does not meet ratiokl's requirement, or ``None``."""
    return version_problem(distribution, installed_version(distribution), extra=extra)


def require(distribution: str, *, needed_by: str, extra: Optional[str] = None) -> None:
    """Raise :class:`MissingDependency` naming the installed and the needed versions of
    ``distribution`` and the extra to install, unless its requirement is met."""
    reason = unmet(distribution, extra=extra)
    if reason is not None:
        raise MissingDependency(f"{needed_by} needs {distribution}: {reason}")


def import_framework(distribution: str, *, needed_by: str, module: Optional[str] = None,
                     extra: Optional[str] = None) -> ModuleType:
    """Import a framework (``torch``, ``jax``, or a trainer: ``trl``, ``google-tunix``,
    ``openrlhf``) for ``needed_by``; raise :class:`MissingDependency` saying which extra to
    install if it is absent or too old (the version is the module's own ``__version__``, so
    a build without pip metadata passes too; the installed distribution's where the module
    has none, as OpenRLHF's). ``module``: the import name, when not ``distribution``;
    ``extra``: the ratiokl extra to suggest, when not the table's (an adapter's)."""
    try:
        imported = importlib.import_module(module or distribution)
    except ImportError as err:
        raise MissingDependency(
            f"{needed_by} needs {distribution}: "
            f"{version_problem(distribution, None, extra=extra)}"
        ) from err
    version = getattr(imported, "__version__", None) or installed_version(distribution)
    reason = version_problem(distribution, version, extra=extra)
    if reason is not None:
        raise MissingDependency(f"{needed_by} needs {distribution}: {reason}")
    return imported
