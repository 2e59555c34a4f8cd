"""Print the summary tables of a results file (plain text, or Markdown for the README).

    python benchmarks/report.py benchmarks/results/h200.json --markdown

The headline tables are user timing; device timing stands beside them,
labelled (the legend printed first says what each timing and the issue
time's ``(waits)`` label mean).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from _summary import LEGEND, render, tables


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a JSON written by benchmarks/run.py")
    ap.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = ap.parse_args(argv)
    data = json.loads(args.results.read_text())
    meta, ceil = data["metadata"], data["ceilings"]
    gpu = (meta.get("gpu") or {}).get("name", "CPU")
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    print(f"{gpu}, {meta['date_utc']}; {versions}")
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, read {ceil['read_gbps']:.0f} GB/s "
          f"({ceil['read_method']})")
    for found in ceil.get("few_rows_read", []):
        print(f"pure read of [{found.get('rows', 128)} x {found['V']}] bf16 x {found['tensors']}: "
              f"{found['gbps']:.0f} GB/s ({found['method']})")
    print("\n" + LEGEND + "\n")
    for title, headers, rows in tables(data["records"], ceil):
        print(render(title, headers, rows, args.markdown) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
