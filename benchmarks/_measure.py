"""One measurement: a provider's op in one mode on one case -> a record.

Modes: ``fwd`` is the forward's values alone, no gradient requested
(PyTorch under ``torch.no_grad``, JAX the jitted primal function: the same
work in both frameworks; the fused policy loss does its gradient work in
the autograd forward, so its training cost is ``fwd+bwd``); ``fwd+bwd`` is
the forward followed by the gradient with respect to the policy logits
(``torch.autograd.grad`` / ``jax.vjp``) for fixed random upstream gradients
(1 for a scalar loss); ``bwd`` is derived as ``fwd+bwd - fwd`` (the same
rule for every provider, including JAX, where the backward cannot be run
alone), so its memory is that of ``fwd+bwd``'s record. The lm_head step
differentiates with respect to the hidden states and ``W`` (``TorchOp.wrt``).

Each measurement is under one timing (``user`` or ``device``, ``_harness``'s
module doc) and also records the call's issue time (``issue_ms``).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from _cases import (BWD, FWD, LINEAR_LOGP, LOGP_ENTROPY_OP, USER, Case, Timing, TorchOp,
                    min_bytes)
from _harness import (
    RECORD_FIELDS,
    cpu_ms,
    cuda_graph,
    cuda_ms,
    host_ms,
    jax_gpu_ms,
    jax_issue_ms,
    jax_peak_extra,
    jax_wall_ms,
    torch_issue_ms,
    torch_peak_extra,
    user_ms,
)

__all__ = ["derive_bwd", "make_record", "measure_jax", "measure_torch"]


def _torch_cotangents(op: str, x: Any) -> Optional[Tuple[torch.Tensor, ...]]:
    if op == "selected_logprobs":
        return (x.cot_a,)
    if op.startswith("ratio_kl") or op in (LOGP_ENTROPY_OP, LINEAR_LOGP):  # two outputs
        return (x.cot_a, x.cot_b)
    return None  # scalar loss: upstream gradient 1


def _jax_cotangents(op: str, rest: Dict[str, Any]) -> Any:
    import jax.numpy as jnp

    if op == "selected_logprobs":
        return rest["cot_a"]
    if op.startswith("ratio_kl") or op in (LOGP_ENTROPY_OP, LINEAR_LOGP):
        return (rest["cot_a"], rest["cot_b"])
    return jnp.ones((), jnp.float32)


def _torch_mode(t: TorchOp, op: str, mode: str, x: Any) -> Callable[[], Any]:
    if mode == FWD:
        return torch.no_grad()(t.forward)
    cot = t.grad_outputs if t.grad_outputs is not None else _torch_cotangents(op, x)

    def fwd_bwd() -> Any:
        diff, aux = t.forward()
        outs = diff if isinstance(diff, tuple) else (diff,)
        return diff, aux, torch.autograd.grad(outs, t.wrt, grad_outputs=cot)

    return fwd_bwd


def _timed_first(call: Callable[[], Any], sync: Callable[[Any], Any]) -> Tuple[float, float]:
    """Seconds of a first call (compilation included) and ms of a second (warm)."""
    start = time.perf_counter()
    sync(call())
    first = time.perf_counter() - start
    start = time.perf_counter()
    sync(call())
    return first, (time.perf_counter() - start) * 1e3


def measure_torch(t: TorchOp, op: str, mode: str, x: Any, budget: Timing, timing: str,
                  graphed: bool = False) -> Dict[str, Any]:
    """Time ``t`` (a torch provider's op) in ``mode`` on the inputs ``x`` under ``timing``.

    ``graphed``: the call is captured as a CUDA graph and its replay is timed
    (``first_call_s`` includes the capture; no peak memory: the graph's pool holds it).
    """
    fn = _torch_mode(t, op, mode, x)
    on_gpu = torch.cuda.is_available()
    sync = (lambda _: torch.cuda.synchronize()) if on_gpu else (lambda _: None)
    start = time.perf_counter()
    if graphed:
        fn = cuda_graph(fn)
    capture_s = time.perf_counter() - start
    first_s, est_ms = _timed_first(fn, sync)
    peak = None if graphed else torch_peak_extra(fn)
    host = host_ms(fn, sync) if on_gpu else None
    issue, blocked = torch_issue_ms(fn, host)
    if not on_gpu:
        ms, timer = cpu_ms(fn, sync, budget.cpu_reps, budget.warmup_ms), "cpu-median"
    elif timing == USER:
        ms = user_ms(fn, est_ms)
        timer = "do_bench defaults (mean, L2 flushed, no head start; 20 runs over 5 ms)"
    else:
        ms = cuda_ms(fn, budget.warmup_ms, budget.rep_ms, est_ms, host)
        timer = "cuda-events (host head start)"
    if graphed:
        timer = f"cuda-graph replay, {timer}"
    return {"ms": ms, "timer": timer, "first_call_s": capture_s + first_s,
            "peak_extra_bytes": peak, "host_ms": host, "issue_ms": issue,
            "issue_blocked": blocked,
            "mem_method": "torch-max-allocated" if on_gpu and not graphed else None}


def _jax_compiled(f: Callable[..., Any], op: str, mode: str, policy: Any,
                  rest: Dict[str, Any]) -> Any:
    """``f`` (forward) or forward + vjp, jitted and compiled for these inputs' shapes."""
    import jax

    g = f
    if mode != FWD:
        def g(p: Any, r: Dict[str, Any]) -> Any:
            diff, vjp, aux = jax.vjp(lambda q: f(q, r), p, has_aux=True)
            return diff, aux, vjp(_jax_cotangents(op, r))

    return jax.jit(g).lower(policy, rest).compile()


def measure_jax(build: Callable[[], Callable[..., Any]], op: str, mode: str,
                xj: Dict[str, Any], budget: Timing, timing: str, cache: Dict[Any, Any],
                key: Any) -> Dict[str, Any]:
    """Jit ``build()`` (a JAX provider's ``f(policy, rest)``) in ``mode``, time it on ``xj``
    under ``timing``.

    ``cache[key]`` keeps the compiled op, so a case that differs only in its
    values (the mask density) does not compile again.
    """
    import jax

    # What the gradient reaches: the logits, or (hidden-state ops) the hidden states and W.
    wrt = ("policy",) if "policy" in xj else ("hidden", "weight")
    policy = xj["policy"] if "policy" in xj else (xj["hidden"], xj["weight"])
    rest = {k: v for k, v in xj.items() if k not in wrt}
    start = time.perf_counter()
    if key not in cache:
        cache[key] = _jax_compiled(build(), op, mode, policy, rest)
    compiled = cache[key]
    compile_s = time.perf_counter() - start

    def call() -> Any:
        return compiled(policy, rest)

    first_s, est_ms = _timed_first(call, jax.block_until_ready)
    on_gpu = jax.default_backend() == "gpu"
    host = host_ms(call, jax.block_until_ready) if on_gpu else None
    if not on_gpu:
        ms = cpu_ms(call, jax.block_until_ready, budget.cpu_reps, budget.warmup_ms)
        timer = "cpu-median"
    elif timing == USER:
        ms, timer = jax_wall_ms(call, est_ms), "jax wall loop (block_until_ready at the end)"
    else:
        ms = jax_gpu_ms(call, budget.warmup_ms, budget.rep_ms, est_ms, host)
        timer = "jax-batched (host head start)"
    return {"ms": ms, "timer": timer, "first_call_s": compile_s + first_s, "host_ms": host,
            "issue_ms": jax_issue_ms(call), "peak_extra_bytes": jax_peak_extra(compiled),
            "mem_method": "xla-memory-analysis"}


def make_record(op: str, provider: str, framework: str, mode: str, timing: str, case: Case,
                ceilings: Dict[str, Any], measured: Dict[str, Any],
                status: str = "ok", reason: Optional[str] = None) -> Dict[str, Any]:
    """A tidy record; bandwidth fields from ``min_bytes`` and the ceilings when timed."""
    nbytes = min_bytes(op, mode, case)
    ms = measured.get("ms")
    gbps = nbytes / (ms * 1e-3) / 1e9 if ms and nbytes is not None else None
    pct = (lambda key: 100.0 * gbps / ceilings[key] if gbps and ceilings.get(key) else None)
    rec = {
        **measured,
        "op": op, "provider": provider, "framework": framework, "mode": mode,
        "timing": timing, "N": case.n, "V": case.v, "H": case.hidden or None,
        "density": case.density, "dtype": case.dtype,
        "status": status, "reason": reason, "min_bytes": nbytes, "gbps": gbps,
        "pct_read_ceiling": pct("read_gbps"), "pct_copy_ceiling": pct("copy_gbps"),
    }
    return {k: _finite(rec.get(k)) for k in RECORD_FIELDS}


def _finite(value: Any) -> Any:
    """NaN/inf (a broken timing) become None, so the JSON stays strict."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def derive_bwd(fwd: Dict[str, Any], fwd_bwd: Dict[str, Any], case: Case,
               ceilings: Dict[str, Any]) -> Dict[str, Any]:
    """The ``bwd`` record: ``fwd+bwd`` ms minus ``fwd`` ms (clamped at 0), ``fwd+bwd`` memory,
    the same timing; no issue time (a backward is not issued alone)."""
    args = (fwd["op"], fwd["provider"], fwd["framework"], BWD, fwd["timing"], case, ceilings)
    if fwd["status"] != "ok" or fwd_bwd["status"] != "ok":
        status = "skipped" if "skipped" in (fwd["status"], fwd_bwd["status"]) else "error"
        return make_record(*args, {}, status, "needs both fwd and fwd+bwd")
    host = (fwd_bwd["host_ms"] - fwd["host_ms"]
            if fwd_bwd.get("host_ms") is not None and fwd.get("host_ms") is not None else None)
    measured = {
        "ms": max(fwd_bwd["ms"] - fwd["ms"], 0.0),
        "host_ms": host,
        "timer": f"{fwd_bwd['timer']} (fwd+bwd - fwd)",
        "peak_extra_bytes": fwd_bwd["peak_extra_bytes"],
        "mem_method": fwd_bwd["mem_method"],
    }
    return make_record(*args, measured)
