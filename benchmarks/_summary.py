"""Summary of a run: speedups against each peer, PERF.md's targets, printable tables.

Speedup of a provider against a peer = peer ms / provider ms on the same
(op, mode, N, V, density, dtype). Targets are checked on ratiokl's
providers at PERF.md's shapes; a target whose records are missing is
reported as ``missing`` (never as passed).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from _cases import uses_ref_logits

__all__ = ["PEERS", "check_targets", "render", "speedups", "tables"]

PEERS = ("torch-eager", "torch-compile", "ratiokl-jax-native", "liger")
_KEY = ("op", "mode", "N", "V", "density", "dtype")
_TT, _JT = "ratiokl-torch-triton", "ratiokl-jax-triton"
_HEAD = {"N": 8192, "V": 151936, "dtype": "bfloat16"}
_FEW = {"N": 128, "V": 151936, "dtype": "bfloat16"}
#: The ``cpu`` preset's shape: native paths within 1.5x of eager PyTorch on the CPU.
_CPU = {"N": 1024, "V": 32768, "dtype": "float32"}
_NATIVE_PROVIDERS = ("ratiokl-torch-native", "ratiokl-jax-native")
_OPS = ("selected_logprobs", "ratio_kl", "ratio_kl_ref_logps", "policy_loss",
        "policy_loss_ref_logps")
#: PERF.md's anchor for the seed's op (RL-Kernel TritonRatioKLOp), ratio_kl fwd+bwd.
_SEED_FWD_BWD_MS = 6.08
#: "O(N)" memory allowance: bytes per row plus a fixed slack (allocator rounding).
_PER_ROW_BYTES, _SLACK_BYTES = 256, 4 * 1024**2


def _ok(records: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [r for r in records if r["status"] == "ok" and r["ms"] is not None]


def _index(records: Iterable[Dict[str, Any]]) -> Dict[Tuple, Dict[str, Any]]:
    return {tuple(r[k] for k in _KEY) + (r["provider"],): r for r in _ok(records)}


def speedups(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per timed record: its ms and ``x_<peer>`` = peer ms / its ms."""
    idx = _index(records)
    rows = []
    for r in _ok(records):
        row = {k: r.get(k) for k in _KEY + ("provider", "ms", "gbps", "pct_read_ceiling",
                                             "host_ms")}
        for peer in PEERS:
            other = idx.get(tuple(r[k] for k in _KEY) + (peer,))
            row[f"x_{peer}"] = other["ms"] / r["ms"] if other and r["ms"] > 0 else None
        rows.append(row)
    return rows


def _get(idx, provider: str, op: str, mode: str, density: float, shape=None):
    s = shape or _HEAD
    return idx.get((op, mode, s["N"], s["V"], density, s["dtype"], provider))


def _check(name: str, value: Optional[float], cmp: str, threshold: float) -> Dict[str, Any]:
    if value is None:
        status = "missing"
    else:
        status = "pass" if (value <= threshold if cmp == "<=" else value >= threshold) else "fail"
    return {"target": name, "value": value, "cmp": cmp, "threshold": threshold, "status": status}


def _ratio(a, b) -> Optional[float]:
    return a["ms"] / b["ms"] if a and b and b["ms"] > 0 else None


def _same_bytes_read(ceilings: Optional[Dict[str, Any]], op: str) -> str:
    """`` (a pure read of the same bytes: X %)`` from the run's few-rows yardstick, or ``""``."""
    tensors = 2 if uses_ref_logits(op) else 1
    for found in (ceilings or {}).get("few_rows_read", []):
        if found.get("tensors") == tensors:
            return f" (a pure read of the same bytes: {found['pct_read_ceiling']:.1f} %)"
    return ""


def check_targets(records: Sequence[Dict[str, Any]],
                  ceilings: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """PERF.md's targets, one check each (value, comparison, threshold, status).

    Only targets whose op and shape were part of the run are listed. With the
    run's ``ceilings``, each few-rows check names what the best pure read of
    the same bytes reached under the same timer.
    """
    idx = _index(records)
    ran = {(r["op"], r["N"], r["V"], r["dtype"]) for r in records}
    has = lambda op, s=_HEAD: (op, s["N"], s["V"], s["dtype"]) in ran  # noqa: E731
    val = lambda r, k: r[k] if r else None  # noqa: E731
    rk = lambda mode: _get(idx, _TT, "ratio_kl", mode, 1.0)  # noqa: E731
    pl = _get(idx, _TT, "policy_loss_ref_logps", "fwd+bwd", 1.0)
    checks = []
    if has("ratio_kl"):
        checks += [
            _check("ratio_kl fwd ms", val(rk("fwd"), "ms"), "<=", 1.20),
            _check("ratio_kl fwd % read ceiling", val(rk("fwd"), "pct_read_ceiling"), ">=", 92.0),
            _check("ratio_kl fwd+bwd ms", val(rk("fwd+bwd"), "ms"), "<=", 2.40),
            _check("ratio_kl fwd+bwd speedup vs torch-eager",
                   _ratio(_get(idx, "torch-eager", "ratio_kl", "fwd+bwd", 1.0), rk("fwd+bwd")),
                   ">=", 10.0),
            _check("ratio_kl fwd+bwd speedup vs seed op (PERF.md anchor 6.08 ms)",
                   _ratio({"ms": _SEED_FWD_BWD_MS}, rk("fwd+bwd")), ">=", 2.5),
        ]
    if has("policy_loss_ref_logps"):
        checks += [
            _check("policy_loss_ref_logps fwd+bwd ms", val(pl, "ms"), "<=", 1.50),
            _check("policy_loss_ref_logps fwd+bwd speedup vs liger",
                   _ratio(_get(idx, "liger", "policy_loss_ref_logps", "fwd+bwd", 1.0), pl),
                   ">=", 1.27),
        ]
    if has("policy_loss_ref_logps"):
        inplace = _get(idx, _TT + "-inplace", "policy_loss_ref_logps", "fwd+bwd", 1.0)
        checks.append(_check(
            f"policy_loss_ref_logps fwd+bwd {_TT}-inplace extra peak bytes (O(N))",
            val(inplace, "peak_extra_bytes"), "<=", _PER_ROW_BYTES * _HEAD["N"] + _SLACK_BYTES))
    for op in (o for o in _OPS if has(o)):
        for prov in (_TT, _JT):
            checks.append(_check(
                f"{op} fwd {prov} time(d=0.5) / time(d=1.0)",
                _ratio(_get(idx, prov, op, "fwd", 0.5), _get(idx, prov, op, "fwd", 1.0)),
                "<=", 0.55))
        for mode in ("fwd", "fwd+bwd"):
            for d in (1.0, 0.5):
                checks.append(_check(
                    f"{op} {mode} d={d:g} jax-triton / torch-triton time",
                    _ratio(_get(idx, _JT, op, mode, d), _get(idx, _TT, op, mode, d)),
                    "<=", 1.03))
        checks += _memory_checks(idx, op)
    for op in (o for o in _OPS if has(o, _CPU)):
        for prov in _NATIVE_PROVIDERS:
            for mode in ("fwd", "fwd+bwd"):
                checks.append(_check(
                    f"{op} {mode} {prov} N=1024 V=32768 fp32 time / torch-eager time",
                    _ratio(_get(idx, prov, op, mode, 1.0, _CPU),
                           _get(idx, "torch-eager", op, mode, 1.0, _CPU)), "<=", 1.5))
    for op in (o for o in _OPS if has(o, _FEW)):
        for prov in (_TT, _JT):
            checks.append(_check(
                f"{op} fwd {prov} N=128 % read ceiling{_same_bytes_read(ceilings, op)}",
                val(_get(idx, prov, op, "fwd", 1.0, _FEW), "pct_read_ceiling"), ">=", 70.0))
    return checks


def _memory_checks(idx, op: str) -> List[Dict[str, Any]]:
    """Extra peak memory: forward O(N); forward + backward one bf16 gradient + O(N)."""
    n, v = _HEAD["N"], _HEAD["V"]
    o_n = _PER_ROW_BYTES * n + _SLACK_BYTES
    grad = n * v * 2
    out = []
    for prov in (_TT, _JT):
        fwd = _get(idx, prov, op, "fwd", 1.0)
        out.append(_check(f"{op} fwd {prov} extra peak bytes (O(N))",
                          fwd and fwd["peak_extra_bytes"], "<=", o_n))
        fb = _get(idx, prov, op, "fwd+bwd", 1.0)
        out.append(_check(f"{op} fwd+bwd {prov} extra peak bytes (1 grad + O(N))",
                          fb and fb["peak_extra_bytes"], "<=", grad + o_n))
    return out


def tables(records: Sequence[Dict[str, Any]], ceilings: Optional[Dict[str, Any]] = None,
           ) -> List[Tuple[str, List[str], List[List[str]]]]:
    """(title, headers, rows) of the summary tables: ms per provider; ratiokl detail; targets
    (``ceilings``: as for :func:`check_targets`)."""
    rows = speedups(records)
    modes = ("fwd", "fwd+bwd", "bwd")
    cases = sorted({tuple(r[k] for k in _KEY) for r in rows},
                   key=lambda k: (k[2], k[3], -k[4], k[5], k[0], modes.index(k[1])))
    provs = [p for p in ("ratiokl-torch-triton", "ratiokl-torch-triton-inplace",
                         "ratiokl-jax-triton", "ratiokl-torch-native",
                         "ratiokl-jax-native", "torch-eager", "torch-compile", "liger")
             if any(r["provider"] == p for r in rows)]
    by = {tuple(r[k] for k in _KEY) + (r["provider"],): r for r in rows}
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    pivot = [[f"N={c[2]} V={c[3]} d={c[4]:g} {c[5]}", c[0], c[1]]
             + [fmt(by.get(c + (p,), {}).get("ms"), ".3f") for p in provs] for c in cases]
    detail = [[f"N={r['N']} V={r['V']} d={r['density']:g} {r['dtype']}", r["op"], r["mode"],
               r["provider"], fmt(r["ms"], ".3f"), fmt(r["gbps"], ".0f"),
               fmt(r["pct_read_ceiling"], ".1f"), fmt(r["host_ms"], ".3f")]
              + [fmt(r[f"x_{p}"], ".2f") for p in PEERS]
              for c in cases for r in [by.get(c + (p,)) for p in provs]
              if r and r["provider"].startswith("ratiokl-")]
    targets = [[c["target"], fmt(c["value"], ".4g"), f"{c['cmp']} {c['threshold']:g}",
                c["status"].upper()] for c in check_targets(records, ceilings)]
    return [
        ("median ms by provider", ["case", "op", "mode"] + provs, pivot),
        ("ratiokl: bandwidth and speedups",
         ["case", "op", "mode", "provider", "ms", "GB/s", "% read", "host ms"]
         + [f"x {p}" for p in PEERS],
         detail),
        ("PERF.md targets", ["target", "value", "needs", "status"], targets),
    ]


def render(title: str, headers: List[str], rows: List[List[str]], markdown: bool) -> str:
    """A plain (aligned) or Markdown table."""
    if not rows:
        return f"{title}: nothing to show for this run"
    if markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(headers) + " |",
                 "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([f"== {title} ==", line(headers)] + [line(r) for r in rows])
