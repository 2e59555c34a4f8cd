"""Draw PNG plots from a results JSON written by ``benchmarks/run.py``.

    python benchmarks/plot.py benchmarks/results/h200.json [--out-dir DIR] [--timing device]
        [--ops OP,...] [--providers NAME,...]

One figure per operation: for each timed mode, ms per provider (log scale)
and % of the read ceiling, grouped by case, under one timing (default
``user``, the headline; ``device`` figures get a ``_device`` suffix). Needs matplotlib;
without it the script says so and exits 0 (nothing else depends on it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_MODES = ("fwd", "fwd+bwd", "bwd")
_METRICS = (("ms", "ms (log)"), ("pct_read_ceiling", "% of read ceiling"))


def _case(r: Dict[str, Any]) -> str:
    return f"N={r['N']}\nV={r['V']}\nd={r['density']:g}\n{r['dtype']}"


def _draw_op(plt: Any, op: str, recs: List[Dict[str, Any]], path: Path) -> None:
    modes = [m for m in _MODES if any(r["mode"] == m for r in recs)]
    cases = list(dict.fromkeys(_case(r) for r in recs))
    provs = list(dict.fromkeys(r["provider"] for r in recs))
    fig, axes = plt.subplots(len(_METRICS), len(modes), squeeze=False,
                             figsize=(4.5 * len(modes), 7), constrained_layout=True)
    width = 0.8 / max(len(provs), 1)
    for col, mode in enumerate(modes):
        by = {(_case(r), r["provider"]): r for r in recs if r["mode"] == mode}
        for row, (metric, label) in enumerate(_METRICS):
            ax = axes[row][col]
            for i, prov in enumerate(provs):
                xs, ys = [], []
                for j, c in enumerate(cases):
                    value = by.get((c, prov), {}).get(metric)
                    if value:
                        xs.append(j + (i - (len(provs) - 1) / 2) * width)
                        ys.append(value)
                ax.bar(xs, ys, width, label=prov)
            ax.set_xticks(range(len(cases)), cases, fontsize=7)
            ax.set_ylabel(label)
            ax.set_title(f"{op} {mode} ({recs[0].get('timing', 'device')} timing)")
            if metric == "ms":
                ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a JSON written by benchmarks/run.py")
    ap.add_argument("--out-dir", type=Path, help="default: beside the results file")
    ap.add_argument("--timing", choices=("user", "device"), default="user",
                    help="which timing's records to draw (default: user)")
    ap.add_argument("--ops", help="comma list of ops to draw (default: every op)")
    ap.add_argument("--providers", help="comma list of providers to draw (default: all)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; no plots drawn "
              "(pip install matplotlib, then run again)")
        return 0
    data = json.loads(args.results.read_text())
    ops = None if args.ops is None else set(args.ops.split(","))
    provs = None if args.providers is None else set(args.providers.split(","))
    ok = [r for r in data["records"] if r["status"] == "ok" and r["ms"]
          and r.get("timing", "device") == args.timing
          and (ops is None or r["op"] in ops) and (provs is None or r["provider"] in provs)]
    out_dir = args.out_dir or args.results.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.timing == "user" else f"_{args.timing}"
    for op in dict.fromkeys(r["op"] for r in ok):
        path = out_dir / f"{args.results.stem}_{op}{suffix}.png"
        _draw_op(plt, op, [r for r in ok if r["op"] == op], path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
