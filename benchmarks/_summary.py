"""Summary of a run: speedups against each peer, PERF.md's targets, printable tables.

Every comparison is between records of one run under one timing. Speedup
of a provider against a peer = peer ms / provider ms on the same (op, mode,
N, V, density, dtype, timing). The headline tables and the time targets use
``timing = "user"`` (what a trainer sees); ``"device"`` (the kernels, host
hidden) stands beside them, labelled, and is what the pure-read yardstick
and the issue-time targets are held to. Targets are checked on ratiokl's
providers at PERF.md's shapes; a target whose records are missing is
reported as ``missing`` (never as passed). Result files written before the
two timings existed read as device timing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from _cases import (
    CISPO_OP,
    DEVICE,
    ENTROPY_COEF,
    ENTROPY_OP,
    LINEAR_LOGP,
    LMHEAD,
    LOGP_ENTROPY_OP,
    ROLLOUT_OPS,
    USER,
    uses_ref_logits,
)

__all__ = ["LEGEND", "PEERS", "check_targets", "render", "speedups", "tables"]

PEERS = ("torch-eager", "torch-compile", "ratiokl-jax-native", "liger")
_KEY = ("op", "mode", "N", "V", "density", "dtype", "timing")
_TT, _JT = "ratiokl-torch-triton", "ratiokl-jax-triton"
_TG = "ratiokl-torch-triton-graph"
_TU, _TC = "ratiokl-torch-triton-unchecked", "ratiokl-torch-triton-compiled"
_GEMM = "gemm-only"
_PROVIDERS = (_TT, _TU, _TC, _TT + "-inplace", _TG, _JT, "ratiokl-torch-native", "ratiokl-jax-native",
              "torch-eager", "torch-compile", "liger", "ratiokl-torch-triton-linear",
              "ratiokl-jax-triton-linear", "ratiokl-torch-native-linear", "trl-chunked",
              "verl-fused", "cce", _GEMM)
_HEAD = {"N": 8192, "V": 151936, "dtype": "bfloat16"}
#: The lm_head step's shape (hidden size aside, the headline's).
_STEP = _HEAD
#: The few-rows shapes: user timing against the CUDA graph, device timing against a pure read.
_FEW_NS = (128, 1024)
#: The ``cpu`` preset's shape: native paths within 1.5x of eager PyTorch on the CPU.
_CPU = {"N": 1024, "V": 32768, "dtype": "float32"}
_NATIVE_PROVIDERS = ("ratiokl-torch-native", "ratiokl-jax-native")
_OPS = ("selected_logprobs", "ratio_kl", "ratio_kl_ref_logps", "policy_loss",
        "policy_loss_ref_logps")
#: "O(N)" memory allowance: bytes per row plus a fixed slack (allocator rounding).
_PER_ROW_BYTES, _SLACK_BYTES = 256, 4 * 1024**2
#: PERF.md's issue-time targets (ms, device records: check_ids=False), by op prefix and mode.
_ISSUE_TARGETS = (("policy_loss", "fwd+bwd", 0.30), ("ratio_kl", "fwd+bwd", 0.25),
                  ("", "fwd", 0.15))

LEGEND = (
    "Timings. user: triton.testing.do_bench(fn) with its defaults (mean; L2 flushed; no device "
    "head start, so host time counts), every provider with its default arguments (ratiokl "
    "check_ids=True); JAX: a plain wall loop ending in block_until_ready. device: the device "
    "given a head start so the host is hidden (median), ratiokl check_ids=False: what the "
    "kernels could do, not what a user gets. ratiokl-torch-triton-graph: CUDA-graph replay of "
    "the check_ids=False call, under both timings. On a CPU both timings are the median "
    "wall clock (they differ only in check_ids).\n"
    "issue ms: wall time for the host to return from one call while the GPU is kept busy. "
    "'(waits)': the call waited for the GPU (ratiokl's default check_ids=True reads its id "
    "check by design), so its issue time is the GPU backlog, not the host's cost."
)

Index = Dict[Tuple, Dict[str, Any]]


def _ok(records: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Timed records (``timing`` defaulting to device for files that predate it)."""
    return [{**r, "timing": r.get("timing") or DEVICE} for r in records
            if r["status"] == "ok" and r["ms"] is not None]


def _by_key(rows: Iterable[Dict[str, Any]]) -> Index:
    return {tuple(r[k] for k in _KEY) + (r["provider"],): r for r in rows}


def _index(records: Iterable[Dict[str, Any]]) -> Index:
    return _by_key(_ok(records))


def speedups(records: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per timed record: its ms and ``x_<peer>`` = peer ms / its ms (same timing)."""
    idx = _index(records)
    rows = []
    for r in _ok(records):
        row = {k: r.get(k) for k in _KEY + ("provider", "ms", "gbps", "pct_read_ceiling",
                                             "host_ms", "issue_ms", "issue_blocked",
                                             "peak_extra_bytes")}
        for peer in PEERS:
            other = idx.get(tuple(r[k] for k in _KEY) + (peer,))
            row[f"x_{peer}"] = other["ms"] / r["ms"] if other and r["ms"] > 0 else None
        rows.append(row)
    return rows


def _get(idx: Index, provider: str, op: str, mode: str, density: float = 1.0,
         shape: Optional[Dict[str, Any]] = None, timing: str = USER) -> Optional[Dict[str, Any]]:
    s = shape or _HEAD
    return idx.get((op, mode, s["N"], s["V"], density, s["dtype"], timing, provider))


def _few(n: int) -> Dict[str, Any]:
    return {"N": n, "V": _HEAD["V"], "dtype": _HEAD["dtype"]}


def _check(name: str, value: Optional[float], cmp: str, threshold: float) -> Dict[str, Any]:
    if value is None:
        status = "missing"
    else:
        status = "pass" if (value <= threshold if cmp == "<=" else value >= threshold) else "fail"
    return {"target": name, "value": value, "cmp": cmp, "threshold": threshold, "status": status}


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]],
           key: str = "ms") -> Optional[float]:
    return a[key] / b[key] if a and b and a.get(key) is not None and b.get(key) else None


def _val(r: Optional[Dict[str, Any]], key: str) -> Optional[float]:
    return r.get(key) if r else None


def _pure_read(ceilings: Optional[Dict[str, Any]], op: str, n: int) -> Optional[Dict[str, Any]]:
    """The run's best pure read of the bytes of ``op``'s forward at ``n`` rows, if measured."""
    tensors = 2 if uses_ref_logits(op) else 1
    for found in (ceilings or {}).get("few_rows_read", []):
        if found.get("tensors") == tensors and found.get("rows", 128) == n:
            return found
    return None


def check_targets(records: Sequence[Dict[str, Any]],
                  ceilings: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """PERF.md's targets, one check each (value, comparison, threshold, status).

    Only targets whose op and shape were part of the run are listed. Times,
    speedups and memory: user timing; issue times and the few-rows pure-read
    yardstick (the run's ``ceilings``): device timing.
    """
    idx = _index(records)
    ran = {(r["op"], r["N"], r["V"], r["dtype"]) for r in records}
    has = lambda op, s=_HEAD: (op, s["N"], s["V"], s["dtype"]) in ran  # noqa: E731
    rk = lambda mode: _get(idx, _TT, "ratio_kl", mode)  # noqa: E731
    checks = []
    if has("ratio_kl"):
        checks += [
            _check("ratio_kl fwd ms", _val(rk("fwd"), "ms"), "<=", 1.20),
            _check("ratio_kl fwd+bwd ms", _val(rk("fwd+bwd"), "ms"), "<=", 2.40),
        ]
    if has("policy_loss_ref_logps"):
        inplace = _get(idx, _TT + "-inplace", "policy_loss_ref_logps", "fwd+bwd")
        checks += [
            _check(f"policy_loss_ref_logps {mode} time / liger time",
                   _ratio(_get(idx, _TT, "policy_loss_ref_logps", mode),
                          _get(idx, "liger", "policy_loss_ref_logps", mode)), "<=", 0.80)
            for mode in ("fwd+bwd", "fwd")
        ]
        checks.append(_check(
            f"policy_loss_ref_logps fwd+bwd {_TT}-inplace extra peak bytes (O(N))",
            _val(inplace, "peak_extra_bytes"), "<=", _PER_ROW_BYTES * _HEAD["N"] + _SLACK_BYTES))
    for op in (o for o in ROLLOUT_OPS if has(o)):  # PERF.md: any correction <= 1.02x none
        checks.append(_check(
            f"{op} fwd+bwd {_TT} time / policy_loss_ref_logps fwd+bwd time "
            f"(rollout_correction={ROLLOUT_OPS[op]!r})",
            _ratio(_get(idx, _TT, op, "fwd+bwd"),
                   _get(idx, _TT, "policy_loss_ref_logps", "fwd+bwd")), "<=", 1.02))
    if has(ENTROPY_OP):
        checks += _entropy_checks(idx)
    if has(CISPO_OP):  # PERF.md: objective="cispo" <= 1.02x "ppo"
        checks.append(_check(
            f"{CISPO_OP} fwd+bwd {_TT} time / policy_loss_ref_logps fwd+bwd time "
            "(objective='cispo')",
            _ratio(_get(idx, _TT, CISPO_OP, "fwd+bwd"),
                   _get(idx, _TT, "policy_loss_ref_logps", "fwd+bwd")), "<=", 1.02))
    if has(LOGP_ENTROPY_OP):  # PERF.md: the entropy from the same pass
        checks += [_check(
            f"{LOGP_ENTROPY_OP} {mode} {_TT} time / selected_logprobs {mode} time "
            "(return_entropy=True)",
            _ratio(_get(idx, _TT, LOGP_ENTROPY_OP, mode), _get(idx, _TT, "selected_logprobs", mode)),
            "<=", bound) for mode, bound in (("fwd", 1.05), ("fwd+bwd", 1.08))]
    if has(LMHEAD, _STEP):
        checks.append(_lmhead_check(idx))
    checks += _hidden_checks(idx, has)
    for op in (o for o in _OPS if has(o)):
        checks += _head_checks(idx, op)
    for op in (o for o in _OPS if has(o, _CPU)):
        for prov in _NATIVE_PROVIDERS:
            for mode in ("fwd", "fwd+bwd"):
                checks.append(_check(
                    f"{op} {mode} {prov} N=1024 V=32768 fp32 time / torch-eager time",
                    _ratio(_get(idx, prov, op, mode, shape=_CPU),
                           _get(idx, "torch-eager", op, mode, shape=_CPU)), "<=", 1.5))
    for n in _FEW_NS:
        for op in (o for o in _OPS if has(o, _few(n))):
            checks += _few_rows_checks(idx, ceilings, op, n)
    return checks


def _head_checks(idx: Index, op: str) -> List[Dict[str, Any]]:
    """Per-op checks at the headline shape: density, JAX against the CUDA graph, issue
    time, extra peak memory (forward O(N); forward + backward one bf16 gradient + O(N))."""
    out = []
    for prov in (_TT, _JT):
        out.append(_check(
            f"{op} fwd {prov} time(d=0.5) / time(d=1.0)",
            _ratio(_get(idx, prov, op, "fwd", 0.5), _get(idx, prov, op, "fwd", 1.0)),
            "<=", 0.55))
    for mode in ("fwd", "fwd+bwd"):
        for d in (1.0, 0.5):
            out.append(_check(
                f"{op} {mode} d={d:g} jax-triton / torch-triton CUDA graph time",
                _ratio(_get(idx, _JT, op, mode, d), _get(idx, _TG, op, mode, d)), "<=", 1.03))
    for mode in ("fwd", "fwd+bwd"):
        unchecked = _get(idx, _TU, op, mode)
        out.append(_check(f"{op} {mode} check_ids=True / check_ids=False time",
                          _ratio(_get(idx, _TT, op, mode), unchecked), "<=", 1.03))
        out.append(_check(f"{op} {mode} torch.compile(fullgraph=True) / eager time "
                          "(check_ids=False)",
                          _ratio(_get(idx, _TC, op, mode), unchecked), "<=", 1.05))
    for prefix, mode, limit in _ISSUE_TARGETS:
        if op.startswith(prefix):
            out.append(_check(f"{op} {mode} {_TT} issue ms (device record, check_ids=False)",
                              _val(_get(idx, _TT, op, mode, timing=DEVICE), "issue_ms"),
                              "<=", limit))
    o_n = _PER_ROW_BYTES * _HEAD["N"] + _SLACK_BYTES
    grad = _HEAD["N"] * _HEAD["V"] * 2
    for prov in (_TT, _JT):
        out.append(_check(f"{op} fwd {prov} extra peak bytes (O(N))",
                          _val(_get(idx, prov, op, "fwd"), "peak_extra_bytes"), "<=", o_n))
        out.append(_check(f"{op} fwd+bwd {prov} extra peak bytes (1 grad + O(N))",
                          _val(_get(idx, prov, op, "fwd+bwd"), "peak_extra_bytes"), "<=",
                          grad + o_n))
    return out


def _entropy_checks(idx: Index) -> List[Dict[str, Any]]:
    """The entropy bonus's cost: fwd+bwd with ``entropy_coef`` > 0 <= 1.05x the same call
    without (user timing, the target; device timing beside it, labelled)."""
    return [_check(f"{ENTROPY_OP} fwd+bwd {_TT} time / policy_loss_ref_logps fwd+bwd time "
                   f"(entropy_coef={ENTROPY_COEF:g}, {timing} timing)",
                   _ratio(_get(idx, _TT, ENTROPY_OP, "fwd+bwd", timing=timing),
                          _get(idx, _TT, "policy_loss_ref_logps", "fwd+bwd", timing=timing)),
                   "<=", 1.05)
            for timing in (USER, DEVICE)]


def _lmhead_check(idx: Index) -> Dict[str, Any]:
    """The lm_head step with ratiokl's loss (user timing) against the bare GEMMs on a gradient
    of the same data plus the loss's standalone device time: (step - GEMMs) / loss <= 1.15."""
    step = lambda p: _get(idx, p, LMHEAD, "fwd+bwd", shape=_STEP)  # noqa: E731
    alone = _get(idx, _TT, "policy_loss_ref_logps", "fwd+bwd", timing=DEVICE)
    ours, gemms = _val(step(_TT), "ms"), _val(step(_GEMM), "ms")
    extra = (ours - gemms) / alone["ms"] if None not in (ours, gemms) and alone else None
    return _check("lmhead-step (ratiokl - gemm-only) user time / policy_loss_ref_logps "
                  "fwd+bwd device time", extra, "<=", 1.15)


#: Issue 35's targets for the chunked hidden-state ops at the lm_head shape, user timing:
#: (op, mode, provider, yardstick provider, bound): time / yardstick's time <= bound.
_HIDDEN_TARGETS = (
    (LINEAR_LOGP, "fwd", "ratiokl-torch-triton-linear", _GEMM, 1.03),
    (LINEAR_LOGP, "fwd+bwd", "ratiokl-torch-triton-linear", _GEMM, 1.03),
    (LMHEAD, "fwd+bwd", "ratiokl-torch-triton-linear", _GEMM, 1.02),
    (LINEAR_LOGP, "fwd", "ratiokl-jax-triton-linear", "ratiokl-torch-triton-linear", 1.05),
    (LINEAR_LOGP, "fwd+bwd", "ratiokl-jax-triton-linear", "ratiokl-torch-triton-linear", 1.05),
    (LMHEAD, "fwd+bwd", "ratiokl-jax-triton-linear", "ratiokl-torch-triton-linear", 1.05),
)
#: Their memory target: extra peak beyond the gradients of hidden and W (GiB).
_HIDDEN_EXTRA_GIB = 0.35


def _hidden_checks(idx: Index, has: Callable[..., bool]) -> List[Dict[str, Any]]:
    """The hidden-state ops against the bare GEMMs (and JAX against PyTorch), and their
    memory beyond the two gradients (hidden ``[N, H]`` and W ``[V, H]`` in bf16)."""
    out = []
    for op, mode, prov, base, bound in _HIDDEN_TARGETS:
        if has(op, _STEP):
            out.append(_check(f"{op} {mode} {prov} time / {base} time (user timing)",
                              _ratio(_get(idx, prov, op, mode, shape=_STEP),
                                     _get(idx, base, op, mode, shape=_STEP)), "<=", bound))
    grads = 2 * 4096 * (_STEP["N"] + _STEP["V"])  # bf16 d hidden and d W, bytes
    for op in (LINEAR_LOGP, LMHEAD):
        if has(op, _STEP):
            peak = _val(_get(idx, "ratiokl-torch-triton-linear", op, "fwd+bwd", shape=_STEP),
                        "peak_extra_bytes")
            out.append(_check(f"{op} fwd+bwd ratiokl-torch-triton-linear extra peak beyond the "
                              "gradients (GiB)", None if peak is None else (peak - grads) / 2**30,
                              "<=", _HIDDEN_EXTRA_GIB))
    return out


def _few_rows_checks(idx: Index, ceilings: Optional[Dict[str, Any]], op: str,
                     n: int) -> List[Dict[str, Any]]:
    """N = n rows: user timing <= 1.3x the CUDA graph's; device forward >= 85 % of the best
    pure read of the same bytes."""
    shape = _few(n)
    out = [_check(f"{op} {mode} {_TT} N={n} user time / CUDA graph user time",
                  _ratio(_get(idx, _TT, op, mode, shape=shape),
                         _get(idx, _TG, op, mode, shape=shape)), "<=", 1.3)
           for mode in ("fwd", "fwd+bwd")]
    read = _pure_read(ceilings, op, n)
    label = f" ({read['gbps']:.0f} GB/s)" if read else ""
    for prov in (_TT, _JT):
        out.append(_check(
            f"{op} fwd {prov} N={n} device GB/s / pure read of the same bytes{label}",
            _ratio(_get(idx, prov, op, "fwd", shape=shape, timing=DEVICE), read, "gbps"),
            ">=", 0.85))
    return out


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _floor_note(ceilings: Optional[Dict[str, Any]]) -> str:
    """The host floor beside the issue table: an autograd op that does nothing."""
    floor = (ceilings or {}).get("autograd_floor_issue_ms")
    if not floor:
        return ""
    return (f"; floor, an autograd.Function doing nothing: fwd {floor['fwd']:.3f}, "
            f"fwd+bwd {floor['fwd+bwd']:.3f}")


def _issue(r: Optional[Dict[str, Any]]) -> str:
    """A record's issue ms, labelled ``(waits)`` where the call waited for the GPU."""
    if not r or r.get("issue_ms") is None:
        return "-"
    return _fmt(r["issue_ms"], ".3f") + (" (waits)" if r.get("issue_blocked") else "")


def _case(c: Tuple) -> str:
    return f"N={c[2]} V={c[3]} d={c[4]:g} {c[5]}"


Table = Tuple[str, List[str], List[List[str]]]


def tables(records: Sequence[Dict[str, Any]],
           ceilings: Optional[Dict[str, Any]] = None) -> List[Table]:
    """(title, headers, rows) of the summary tables: ms per provider (user timing, then
    device timing), issue ms per provider, ratiokl detail, few rows against the CUDA graph
    and a pure read, the lm_head step, targets (``ceilings``: as for :func:`check_targets`)."""
    rows = speedups(records)
    idx = _by_key(rows)
    modes = ("fwd", "fwd+bwd", "bwd")
    cases = sorted({tuple(r[k] for k in _KEY[:-1]) for r in rows},
                   key=lambda k: (k[0] == LMHEAD, k[2], k[3], -k[4], k[5], k[0],
                                  modes.index(k[1])))
    provs = [p for p in _PROVIDERS if any(r["provider"] == p for r in rows)]

    def pivot(timing: str, cell) -> List[List[str]]:
        return [[_case(c), c[0], c[1]] + [cell(idx.get(c + (timing, p))) for p in provs]
                for c in cases if any(c + (timing, p) in idx for p in provs)]

    ms = lambda r: _fmt(_val(r, "ms"), ".3f")  # noqa: E731
    head = ["case", "op", "mode"]
    detail = []
    for c in cases:
        for p in (p for p in provs if p.startswith("ratiokl-")):
            user, dev = idx.get(c + (USER, p)), idx.get(c + (DEVICE, p))
            if user or dev:
                detail.append([_case(c), c[0], c[1], p, ms(user), ms(dev),
                               _fmt(_val(dev, "gbps"), ".0f"),
                               _fmt(_val(dev, "pct_read_ceiling"), ".1f"), _issue(dev),
                               _issue(user)]
                              + [_fmt(_val(user, f"x_{peer}"), ".2f") for peer in PEERS])
    targets = [[c["target"], _fmt(c["value"], ".4g"), f"{c['cmp']} {c['threshold']:g}",
                c["status"].upper()] for c in check_targets(records, ceilings)]
    return [
        ("ms by provider, user timing (what a trainer sees)", head + provs, pivot(USER, ms)),
        ("ms by provider, device timing (host hidden; ratiokl check_ids=False)", head + provs,
         pivot(DEVICE, ms)),
        ("issue ms by provider (GPU kept busy; device records: ratiokl check_ids=False)"
         + _floor_note(ceilings), head + provs,
         [r for r in pivot(DEVICE, _issue) if r[2] != "bwd"]),
        ("ratiokl: user and device timing, bandwidth (device), issue, speedups (user)",
         head + ["provider", "user ms", "device ms", "device GB/s", "device % read",
                 "issue ms (device)", "issue ms (user)"] + [f"x {p}" for p in PEERS],
         detail),
        _few_rows_table(idx, ceilings),
        _hidden_table(idx, LMHEAD, "fwd+bwd"),
        _hidden_table(idx, LINEAR_LOGP, "fwd"),
        _hidden_table(idx, LINEAR_LOGP, "fwd+bwd"),
        ("PERF.md targets", ["target", "value", "needs", "status"], targets),
    ]


def _few_rows_table(idx: Index, ceilings: Optional[Dict[str, Any]]) -> Table:
    """N in {128, 1024}: ratiokl against its CUDA graph (user timing) and against the best
    pure read of the same bytes (device timing, forward)."""
    out = []
    for n in _FEW_NS:
        shape = _few(n)
        for op in _OPS:
            for mode in ("fwd", "fwd+bwd"):
                get = lambda p, t: _get(idx, p, op, mode, shape=shape, timing=t)  # noqa: E731
                user, graph, dev = get(_TT, USER), get(_TG, USER), get(_TT, DEVICE)
                if not (user or graph or dev):
                    continue
                read = _pure_read(ceilings, op, n) if mode == "fwd" else None
                out.append([f"N={n}", op, mode, _fmt(_val(user, "ms"), ".3f"),
                            _fmt(_val(graph, "ms"), ".3f"), _fmt(_ratio(user, graph), ".2f"),
                            _fmt(_val(dev, "ms"), ".3f"),
                            _fmt(_val(get(_TG, DEVICE), "ms"), ".3f"),
                            _fmt(_val(dev, "gbps"), ".0f"), _fmt(_val(read, "gbps"), ".0f"),
                            _fmt(_ratio(dev, read, "gbps"), ".2f")])
    return ("few rows: ratiokl-torch-triton against its CUDA graph (user timing) and a pure "
            "read of the same bytes (device timing)",
            ["N", "op", "mode", "user ms", "graph ms (user)", "user / graph", "device ms",
             "graph ms (device)", "device GB/s", "pure read GB/s", "device / pure read"], out)


#: The hidden-state ops' table titles, by op.
_HIDDEN_TITLES = {
    LMHEAD: "lmhead-step (hidden @ W.T -> loss -> grads of hidden and W)",
    LINEAR_LOGP: "lmhead-logprobs (hidden @ W.T -> per-token logp and entropy; backward to "
                 "hidden and W with the entropy's gradient)",
}


def _hidden_table(idx: Index, op: str, mode: str) -> Table:
    """A hidden-state op in ``mode`` per provider, under both timings, against the bare GEMMs
    (one GEMM forward, three forward + backward, on the op's own gradient)."""
    out = []
    for n, v, d, dtype in sorted({k[2:6] for k in idx if k[0] == op and k[1] == mode}):
        shape = {"N": n, "V": v, "dtype": dtype}
        get = lambda p, t: _get(idx, p, op, mode, d, shape, t)  # noqa: E731
        for p in _PROVIDERS:
            user, dev = get(p, USER), get(p, DEVICE)
            if not (user or dev):
                continue
            peak = _val(user, "peak_extra_bytes")
            out.append([f"N={n} V={v} d={d:g} {dtype}", p, _fmt(_val(user, "ms"), ".3f"),
                        _fmt(_ratio(user, get(_GEMM, USER)), ".3f"),
                        _fmt(_val(dev, "ms"), ".3f"), _fmt(_ratio(dev, get(_GEMM, DEVICE)), ".3f"),
                        _fmt(None if peak is None else peak / 2**30, ".2f"), _issue(dev)])
    return (f"{_HIDDEN_TITLES[op]}, {mode}",
            ["case", "provider", "user ms", "x gemm-only (user)", "device ms",
             "x gemm-only (device)", "extra peak GiB (user)", "issue ms (device)"], out)


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
