"""Run the ratiokl benchmark suite: every provider side by side, in one process.

    python benchmarks/run.py --preset headline --out benchmarks/results/h200.json
    python benchmarks/run.py --preset cpu-smoke --out /tmp/smoke.json
    python benchmarks/run.py --preset vocab-parallel --tp 2   # several GPUs (_vocab_parallel)

Every (provider, op, mode, case) is measured under both timings, ``user``
(what a trainer sees) and ``device`` (the kernels, host hidden). Writes
tidy records (JSON + CSV beside it) after every measurement, then
the summary (speedups against each peer, PERF.md's targets) and prints it.
A provider that fails (import, compile, OOM) gets an ``error`` record and
the run goes on; one that cannot run here gets ``skipped``. See README.md.
"""

from __future__ import annotations

import os

# JAX shares the GPU with torch: allocate on demand instead of 75 % up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from _cases import (  # noqa: E402
    LINEAR_LOGP,
    LMHEAD,
    OPS,
    PRESETS,
    ROLLOUT_OPS,
    TIMED_MODES,
    TIMINGS,
    Case,
    Preset,
    timed_modes,
)
from _ceilings import measure_ceilings  # noqa: E402
from _harness import ResultsWriter, metadata  # noqa: E402
from _inputs import jax_inputs, make_inputs  # noqa: E402
from _measure import derive_bwd, make_record, measure_jax, measure_torch  # noqa: E402
from _summary import LEGEND, check_targets, render, speedups, tables  # noqa: E402
from providers import PROVIDERS, Provider  # noqa: E402

_START = time.perf_counter()
#: Every op ``--ops`` may name: the logits-in ops, the rollout-correction ones, the hidden-state
#: ops (the lm_head step, the log-prob seam).
_ALL_OPS = OPS + tuple(ROLLOUT_OPS) + (LMHEAD, LINEAR_LOGP)


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _error_text(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:300]}"


class _Run:
    """One suite run: the writer, the ceilings, and the per-case state."""

    def __init__(self, writer: ResultsWriter, preset: Preset, ceilings: Dict[str, Any]) -> None:
        self.writer, self.preset, self.ceilings = writer, preset, ceilings
        self.unavailable: Dict[str, Optional[str]] = {}
        # (provider, op, mode, N, V, dtype, check_ids) -> compiled
        self.jax_compiled: Dict[Any, Any] = {}
        self.shape: Optional[tuple] = None  # (N, V, H, dtype) of the previous case

    def record(self, prov: Provider, op: str, mode: str, timing: str, case: Case,
               measured: Dict[str, Any], status: str = "ok",
               reason: Optional[str] = None) -> Dict[str, Any]:
        rec = make_record(op, prov.name, prov.framework, mode, timing, case, self.ceilings,
                          measured, status, reason)
        self.writer.add(rec)
        ms = f"{rec['ms']:.3f} ms" if rec["ms"] is not None else rec["status"]
        pct = f" {rec['pct_read_ceiling']:.0f}% read" if rec["pct_read_ceiling"] else ""
        issue = f", issue {rec['issue_ms']:.3f} ms" if rec["issue_ms"] is not None else ""
        why = f" ({reason})" if reason and status != "ok" else ""
        _log(f"{case.label()} {op} {mode} {prov.name} [{timing}]: {ms}{pct}{issue}{why}")
        return rec

    def add_bwd(self, recs: List[Dict[str, Any]], case: Case) -> None:
        """The derived ``bwd`` record of one timing's ``[fwd, fwd+bwd]`` records."""
        if [r["mode"] for r in recs] == list(TIMED_MODES):
            self.writer.add(derive_bwd(recs[0], recs[1], case, self.ceilings))

    def no_inputs(self, case: Case, names: Sequence[str], ops: Sequence[str], why: str) -> None:
        """Error records for every measurement of a case whose inputs could not be made."""
        _free()
        for name in names:
            for op in ops:
                for timing in TIMINGS:
                    self.add_bwd([self.record(PROVIDERS[name], op, mode, timing, case, {},
                                              "error", f"inputs: {why}")
                                  for mode in timed_modes(op)], case)

    def measure(self, prov: Provider, op: str, mode: str, timing: str, case: Case, x: Any,
                xj: Callable[[], Any], built: Dict[Optional[bool], Any]) -> Dict[str, Any]:
        """One timed record (``built``: the provider's torch ops by ``check_ids``)."""
        why = self.unavailable[prov.name] or prov.why_not(op, mode)
        if why:
            return self.record(prov, op, mode, timing, case, {}, "skipped", why)
        check_ids = prov.check_ids(timing)
        try:
            if prov.framework == "torch":
                if check_ids not in built:
                    built[check_ids] = prov.build(op, x, check_ids)
                measured = measure_torch(built[check_ids], op, mode, x, self.preset.timing,
                                         timing, prov.graphed)
            else:
                key = (prov.name, op, mode, case.n, case.v, case.dtype, check_ids)
                measured = measure_jax(lambda: prov.build(op, check_ids), op, mode, xj(),
                                       self.preset.timing, timing, self.jax_compiled, key)
            return self.record(prov, op, mode, timing, case, measured)
        except Exception as exc:  # noqa: BLE001 - one failure must not end the run
            return self.record(prov, op, mode, timing, case, {}, "error", _error_text(exc))
        finally:
            _free()

    def provider_op(self, prov: Provider, op: str, case: Case, x: Any,
                    xj: Callable[[], Any]) -> None:
        """Every timed mode of one (provider, op) under both timings, then the derived
        backwards. A torch op is built once per ``check_ids`` value (peers: once)."""
        built: Dict[Optional[bool], Any] = {}
        for timing in TIMINGS:
            self.add_bwd([self.measure(prov, op, mode, timing, case, x, xj, built)
                          for mode in timed_modes(op)], case)

    def case(self, case: Case, names: Sequence[str], ops: Sequence[str]) -> None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            x = make_inputs(case, device)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the largest cases
            self.no_inputs(case, names, ops, _error_text(exc))
            return
        cache: Dict[str, Any] = {}

        def xj() -> Any:  # JAX views of the inputs, made on first use
            if "jax" not in cache:
                cache["jax"] = jax_inputs(x)
            return cache["jax"]

        shape = (case.n, case.v, case.hidden, case.dtype)
        if shape != self.shape:
            # New shapes: drop compiled code of the old ones, so torch.compile never
            # reaches its recompile limit (and silently falls back to eager).
            if any("compile" in name for name in names):
                torch._dynamo.reset()
            self.jax_compiled.clear()
            self.shape = shape
        for name in names:
            prov = PROVIDERS[name]
            if name not in self.unavailable:
                self.unavailable[name] = prov.unavailable()
            for op in ops:
                self.provider_op(prov, op, case, x, xj)
        del x, cache
        _free()


#: The preset that runs on several GPUs (or, ``--cpu``, several CPU ranks): its own options,
#: ``benchmarks/run.py --preset vocab-parallel --help``.
VOCAB_PARALLEL = "vocab-parallel"


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS) + [VOCAB_PARALLEL],
                    default="headline" if torch.cuda.is_available() else "cpu-smoke")
    ap.add_argument("--out", type=Path, help="results JSON (CSV written beside it); "
                    "default benchmarks/results/<preset>.json")
    ap.add_argument("--providers", help=f"comma list, subset of: {', '.join(PROVIDERS)}")
    ap.add_argument("--ops", help=f"comma list, subset of: {', '.join(_ALL_OPS)}")
    return ap.parse_args(argv)


def _subset(arg: Optional[str], allowed: Sequence[str], what: str) -> Optional[set]:
    if arg is None:
        return None
    chosen = {s.strip() for s in arg.split(",") if s.strip()}
    bad = chosen - set(allowed)
    if bad:
        raise SystemExit(f"--{what}: unknown {sorted(bad)}; choose from {', '.join(allowed)}")
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    preset_arg = argparse.ArgumentParser(add_help=False)
    preset_arg.add_argument("--preset")
    known, rest = preset_arg.parse_known_args(argv)
    if known.preset == VOCAB_PARALLEL:
        import _vocab_parallel

        return _vocab_parallel.main(rest)
    args = _parse(argv)
    preset = PRESETS[args.preset]
    only_provs = _subset(args.providers, list(PROVIDERS), "providers")
    only_ops = _subset(args.ops, _ALL_OPS, "ops")
    out = args.out or Path(__file__).parent / "results" / f"{args.preset}.json"
    writer = ResultsWriter(out, {**metadata(), "preset": args.preset, "argv": sys.argv[1:]})
    ceilings = measure_ceilings(torch.cuda.is_available(), preset.timing)
    writer.set("ceilings", ceilings)
    _log(f"ceilings: copy {ceilings['copy_gbps']:.0f} GB/s, read {ceilings['read_gbps']:.0f} GB/s")
    run = _Run(writer, preset, ceilings)
    for group in preset.groups:
        names = [n for n in group.providers if only_provs is None or n in only_provs]
        ops = [op for op in group.ops or preset.ops if only_ops is None or op in only_ops]
        for case in group.cases:
            if names and ops:
                run.case(case, names, ops)
    writer.set("summary", {"speedups": speedups(writer.records),
                           "targets": check_targets(writer.records, ceilings)})
    print(LEGEND + "\n")
    for title, headers, rows in tables(writer.records, ceilings):
        print(render(title, headers, rows, markdown=False) + "\n")
    _log(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
