"""Where the fixtures live, and reading/writing the manifest and case files.

Layout (the same in a source checkout and in an installed wheel)::

    <root>/manifest.json        format version, and one entry per case
    <root>/cases/<name>.npz     the case's arrays

``<root>`` is ``ratiokl/_fixtures`` inside an installed wheel, else the
repository's ``conformance/`` directory.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from ratiokl.harness._cases import Case, read_npz, sha256, write_npz
from ratiokl.spec.tolerances import Tolerance

__all__ = ["FORMAT_VERSION", "fixtures_root", "list_cases", "load_case", "load_manifest", "write_fixtures"]

#: Bumped whenever the case format (keys, manifest fields, semantics) changes.
FORMAT_VERSION = 1

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def fixtures_root() -> Path:
    """The directory holding ``manifest.json``: installed data first, then the checkout."""
    for root in (_PACKAGE_DIR / "_fixtures", _PACKAGE_DIR.parents[1] / "conformance"):
        if (root / "manifest.json").is_file():
            return root
    raise FileNotFoundError(
        "conformance fixtures not found: expected ratiokl/_fixtures/manifest.json (installed "
        "wheel) or conformance/manifest.json (source checkout); regenerate them with "
        "`python conformance/generate.py`"
    )


def load_manifest(root: Optional[Path] = None) -> Dict[str, Any]:
    """The parsed manifest; ``ValueError`` if its format version is not this library's."""
    root = Path(root) if root is not None else fixtures_root()
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{root / 'manifest.json'} has format_version {manifest.get('format_version')!r}; "
            f"this ratiokl reads {FORMAT_VERSION}; regenerate with `python conformance/generate.py`"
        )
    return manifest


def list_cases(pattern: str = "*", root: Optional[Path] = None) -> List[str]:
    """Case names, sorted, whose name (``vocab_2_fp32``) or case group (``vocab_2``, as
    ``ratiokl check`` prints it) matches the glob ``pattern``."""
    cases = load_manifest(root)["cases"]
    return sorted(name for name, entry in cases.items()
                  if fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(entry["group"], pattern))


def read_case_file(root: Path, entry: Dict[str, Any]) -> bytes:
    """The bytes of a manifest ``entry``'s file under ``root``; ``ValueError`` if they do
    not match the entry's sha256."""
    path = root / entry["file"]
    data = path.read_bytes()
    if sha256(data) != entry["sha256"]:
        raise ValueError(f"{path} does not match its sha256 in the manifest")
    return data


def load_case(name: str, root: Optional[Path] = None) -> Case:
    """Read one case; ``ValueError`` if its file does not match the manifest's hash."""
    root = Path(root) if root is not None else fixtures_root()
    entry = load_manifest(root)["cases"][name]
    data = read_case_file(root, entry)
    return Case(
        name=name,
        group=entry["group"],
        op=entry["op"],
        dtype=entry["dtype"],
        arrays=read_npz(data),
        options=entry["options"],
        tolerances={k: Tolerance(**t) for k, t in entry["tolerances"].items()},
        expect_error=entry["expect_error"],
        description=entry["description"],
        input_dtypes=entry.get("input_dtypes", {}),
    )


def write_fixtures(cases: Iterable[Case], root: Path, *, generator: str) -> None:
    """Write every case and the manifest under ``root``, removing stale case files."""
    root = Path(root)
    (root / "cases").mkdir(parents=True, exist_ok=True)
    entries: Dict[str, Any] = {}
    for case in cases:
        if case.name in entries:
            raise ValueError(f"duplicate case name {case.name!r}")
        data = write_npz(case.arrays)
        rel = f"cases/{case.name}.npz"
        (root / rel).write_bytes(data)
        entries[case.name] = {"file": rel, "sha256": sha256(data), "bytes": len(data)}
        entries[case.name].update(case.manifest_entry())
    for stale in (root / "cases").glob("*.npz"):
        if stale.stem not in entries:
            stale.unlink()
    manifest = {"format_version": FORMAT_VERSION, "generator": generator, "cases": entries}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
