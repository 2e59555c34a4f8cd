"""The suite's ``vocab-parallel`` preset: ratiokl on tp GPUs against one unsharded GPU
(values, time, memory, faults).

Usage (a machine with at least ``tp`` CUDA GPUs, from the repository root)::

    PYTHONPATH=src python benchmarks/run.py --preset vocab-parallel [--tp N] [--out PATH]

``--tp``: 2, 4 or 8 (default: every visible GPU). ``--out``: a file, or a folder
that gets ``h200x<tp>_vocab_parallel.json`` (the default: ``benchmarks/results/``).
``--cpu`` is the dry run: gloo ranks and ``tp`` JAX host devices at a tiny size
(it must pass the same checks; its timings mean nothing).

PyTorch: ``tp`` processes over NCCL, one per GPU (``vocab_group=``), each holding
a contiguous block of the vocabulary. JAX (a subprocess, so the frameworks never
share a GPU allocator): ``shard_map`` over a ``tp``-device mesh (``vocab_axis=``).
The inputs are the benchmark suite's (``_inputs.make_inputs``: bf16 logits,
``ref`` = policy + noise, ``old_logps`` the exact log-probs + noise, N = 8192 as
``[8, 1024]``, V = 151,936), the same on every rank; the linear cases
(``linear_selected_logprobs`` with the entropy, ``linear_policy_loss`` with and without
``entropy_coef``) take bf16 hidden states ``[N, H]`` (H = 4096) and the lm_head ``weight
[V, H]`` instead (:func:`head_inputs`), sharded by rows. For every case of
:func:`cases` (``ratio_kl``; ``selected_logprobs`` and its entropy; ``policy_loss``
over every ``loss_agg``, GSPO, ``entropy_coef``, each rollout correction, CISPO; the two
linear ops):

- the first sharded call says whether the installed ratiokl supports the case
  (a ``NotImplementedError`` or ``TypeError`` records it as ``unsupported``, with
  the reason; JAX traces it without compiling, ``jax.eval_shape``), so the
  script runs the options that other issues add once they are there;
- values: the sharded outputs against the unsharded single-GPU call on the
  same inputs, and each rank's gradient against its slice of the unsharded
  gradient, within the fixture tolerances (``ratiokl.spec.forward_tolerance`` /
  ``grad_tolerance``; the linear cases: ``linear_forward_tolerance`` /
  ``linear_grad_tolerance``, for ``d hidden`` and the rank's rows of ``d weight``) and a
  relative L2 error within the same rtol (outputs) or two bf16 roundings (gradient;
  :func:`case_tolerance`);
- time, user timing (PERF.md): one forward+backward per rank against the
  unsharded single-GPU call, and the case's all-reduces alone (the ``[N]``
  collectives it makes, recorded from a call and replayed on their own); the
  target ``sharded <= 1.15 * unsharded / tp + all-reduces`` is recorded as met
  or not. torch: ``triton.testing.do_bench``'s method and defaults (25 ms
  warm-up, 100 ms of runs, a 256 MB L2 flush before each, the mean), except that
  the run counts come from the slowest rank's estimate, so that every rank calls
  the collectives as often; JAX: a wall loop ending in ``block_until_ready``
  (``_harness.jax_wall_ms``);
- memory per rank: the peak of one sharded and one unsharded step (torch
  ``max_memory_allocated``: inputs + what the step allocates; JAX: XLA's memory
  analysis per device).

Last, the fault check: the last rank passes one row fewer; every rank must raise
a ``ValueError`` naming it, and the group must still work afterwards (JAX's
program is one for the whole mesh: there, the mismatches a caller can make are
checked to fail at trace time). One JSON document per run.

NVLink multicast stays off: every process of this script runs with
``NCCL_NVLS_ENABLE=0`` (and PyTorch's and NVSHMEM's multicast switches off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: Set in this process and every process it starts (KINDS.md: multicast stays off).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
#: The issue's target: sharded fwd+bwd <= FACTOR * unsharded / tp + the all-reduces alone.
FACTOR = 1.15
#: Exceptions of a first call that mean "not in the installed ratiokl" (unknown keyword,
#: or not yet with vocabulary-sharded logits).
UNSUPPORTED = (NotImplementedError, TypeError)


# ----------------------------------------------------------------------------- configuration


@dataclass
class Config:
    """One run; travels to the child processes as JSON."""

    tp: int
    rows: int = 8192
    vocab: int = 151936
    hidden: int = 4096  # the linear cases' H
    density: float = 0.9
    cpu: bool = False
    backend: str = "auto"
    iters: int = 2  # timed calls per measurement on the CPU (GPU: do_bench's budget)
    seed: int = 0
    cases: Optional[List[str]] = None  # names to run (None: all)
    parts: Tuple[str, ...] = ("torch", "jax")
    collective_timeout_s: int = 180
    deadline_s: int = 540  # the whole run's processes are stopped after this

    def case(self):
        """The benchmark suite's input configuration for these sizes."""
        from _cases import Case as InputCase

        return InputCase(n=self.rows, v=self.vocab, density=self.density, dtype="bfloat16")

    def bounds(self, rank: int) -> Tuple[int, int]:
        """Rank ``rank``'s columns ``[start, stop)``: contiguous, the first ``V % tp`` wider."""
        sizes = [self.vocab // self.tp + (r < self.vocab % self.tp) for r in range(self.tp)]
        return sum(sizes[:rank]), sum(sizes[: rank + 1])


def head_inputs(cfg: Config, device: Any) -> Dict[str, Any]:
    """The linear cases' inputs, the same on every rank: the suite's lm_head step's recipe
    (``_inputs._step_inputs``, without its ``[N, V]`` gradients): bf16 ``hidden [N, H]`` and
    ``weight [V, H]`` scaled so that the logits spread as standard normals times 2, the
    per-token inputs ``[B, T]`` (``old_logps`` / ``ref_logps``: the exact log-probs plus
    noise), and ``logit_scale``, the largest ``|logit|`` (from one pass of row chunks)."""
    import torch

    from _inputs import _Random

    case = cfg.case()
    r = _Random(device, cfg.seed)
    hidden = r.randn(case.n, cfg.hidden, dt=torch.bfloat16)
    weight = r.randn(case.v, cfg.hidden, dt=torch.bfloat16).mul_(2.0 / cfg.hidden**0.5)
    ids, mask = r.ids(case), r.mask(case)
    logps = torch.empty(case.n, dtype=torch.float32, device=device)
    scale = 0.0
    with torch.no_grad():
        for start in range(0, case.n, 1024):
            rows = slice(start, min(start + 1024, case.n))
            logits = (hidden[rows] @ weight.T).float()
            scale = max(scale, float(logits.abs().max()))
            logps[rows] = torch.log_softmax(logits, dim=-1).gather(
                1, ids.reshape(-1)[rows, None])[:, 0]
    lead = (case.batch, case.seq)
    logps = logps.reshape(lead)
    return {"hidden": hidden, "weight": weight, "ids": ids, "mask": mask,
            "old_logps": logps + 0.05 * r.randn(*lead), "ref_logps": logps + 0.05 * r.randn(*lead),
            "advantages": r.randn(case.batch), "cot_a": r.randn(*lead), "cot_b": r.randn(*lead),
            "logit_scale": scale}


def default_name(tp: int, cpu: bool) -> str:
    return f"{'cpu' if cpu else 'h200'}x{tp}_vocab_parallel.json"


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One call checked and timed: ``op`` with ``options`` (given to both calls).

    ``rollout``: pass the engine's ``rollout_logps`` too.
    """

    name: str
    op: str  # "ratio_kl" | "selected_logprobs" | "policy_loss" | "linear_*"
    options: Dict[str, Any] = field(default_factory=dict)
    rollout: bool = False

    @property
    def linear(self) -> bool:
        """An op from hidden states: the lm_head ``weight [V, H]`` sharded by rows."""
        return self.op.startswith("linear_")


def cases() -> List[Case]:
    """Every case of a run (``--cases`` picks some). The rollout modes are named here too,
    for a ratiokl without them (the first call then records them as unsupported)."""
    from ratiokl import spec

    modes = getattr(spec, "ROLLOUT_CORRECTIONS", (
        "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"))

    out = [Case("ratio_kl", "ratio_kl"),
           Case("ratio_kl_unchecked", "ratio_kl", {"check_ids": False}),
           Case("selected_logprobs", "selected_logprobs"),
           Case("selected_logprobs_entropy", "selected_logprobs", {"return_entropy": True})]
    out += [Case(f"policy_loss_{agg}", "policy_loss", {"loss_agg": agg}) for agg in spec.LOSS_AGGS]
    out += [Case("policy_loss_gspo", "policy_loss",
                 {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"}),
            Case("policy_loss_entropy", "policy_loss", {"entropy_coef": 0.01})]
    out += [Case(f"policy_loss_rollout_{mode}", "policy_loss", {"rollout_correction": mode},
                 rollout=True) for mode in modes]
    out += [Case("policy_loss_cispo", "policy_loss",
                 {"objective": "cispo", "clip_eps_high": 0.28})]
    out += [Case("linear_selected_logprobs_entropy", "linear_selected_logprobs",
                 {"return_entropy": True}),
            Case("linear_policy_loss", "linear_policy_loss"),
            Case("linear_policy_loss_entropy", "linear_policy_loss", {"entropy_coef": 0.01})]
    return out


def selected(cfg: Config) -> List[Case]:
    known = cases()
    if cfg.cases is None:
        return known
    names = {c.name for c in known}
    unknown = sorted(set(cfg.cases) - names)
    if unknown:
        raise SystemExit(f"unknown --cases {unknown}; known: {sorted(names)}")
    return [c for c in known if c.name in cfg.cases]


def run_case(loss: Any, case: Case, policy: Any, ref: Any, x: Dict[str, Any], backend: str,
             **sharding: Any) -> Tuple[Any, Dict[str, Any]]:
    """``(scalar to differentiate, {output: array})`` of one call; torch or JAX ``loss``.

    ``policy``, ``ref``: the policy and reference logits, or for the linear cases the hidden
    states ``[N, H]`` and the lm_head ``weight [V, H]`` (a rank's rows when sharded).
    ``x``: the per-token inputs (``_inputs`` names); ``sharding``: ``vocab_group=`` or
    ``vocab_axis=`` (nothing: the unsharded call).
    """
    kw = dict(case.options, backend=backend, **sharding)
    if case.linear:
        return _run_linear_case(loss, case, policy, ref, x, kw)
    if case.op == "ratio_kl":
        ratio, kl = loss.ratio_kl(policy, ref, x["ids"], x["mask"], x["old_logps"], **kw)
        return (x["cot_a"] * ratio + x["cot_b"] * kl).sum(), {"ratio": ratio, "kl": kl}
    if case.op == "selected_logprobs":
        out = loss.selected_logprobs(policy, x["ids"], x["mask"], **kw)
        if not case.options.get("return_entropy"):
            return (x["cot_a"] * out).sum(), {"logp": out}
        logp, entropy = out
        return ((x["cot_a"] * logp + x["cot_b"] * entropy).sum(),
                {"logp": logp, "entropy": entropy})
    from _cases import CLIP_EPS, KL_COEF

    if case.rollout:
        kw["rollout_logps"] = x["rollout_logps"]
    value, metrics = loss.policy_loss(policy, ref, x["ids"], x["mask"], x["old_logps"],
                                      x["advantages"], clip_eps=CLIP_EPS, kl_coef=KL_COEF, **kw)
    if kw.get("loss_agg") == "none":  # the per-token loss: a per-token upstream gradient
        return (x["cot_a"] * value).sum(), {"loss": value, **metrics}
    return value, {"loss": value, **metrics}


def _run_linear_case(loss: Any, case: Case, hidden: Any, weight: Any, x: Dict[str, Any],
                     kw: Dict[str, Any]) -> Tuple[Any, Dict[str, Any]]:
    """:func:`run_case` of the two ops from hidden states (``ids`` etc. flattened to ``[N]``,
    as the hidden states are)."""
    ids, mask = x["ids"].reshape(-1), x["mask"].reshape(-1)
    if case.op == "linear_selected_logprobs":
        logp, entropy = loss.linear_selected_logprobs(hidden, weight, ids, mask, **kw)
        cot_a, cot_b = x["cot_a"].reshape(-1), x["cot_b"].reshape(-1)
        return ((cot_a * logp + cot_b * entropy).sum(), {"logp": logp, "entropy": entropy})
    from _cases import CLIP_EPS, KL_COEF

    # The per-token inputs keep their [B, T] shape: the sequence aggregations need it.
    lead = x["ids"].shape
    value, metrics = loss.linear_policy_loss(
        hidden.reshape(*lead, hidden.shape[-1]), weight, x["ids"], x["mask"], x["old_logps"],
        x["advantages"], ref_logps=x["ref_logps"], clip_eps=CLIP_EPS, kl_coef=KL_COEF, **kw)
    return value, {"loss": value, **metrics}


#: The per-token inputs a case reads (``_inputs.TorchInputs`` fields).
TOKEN_FIELDS = ("ids", "mask", "old_logps", "advantages", "rollout_logps", "cot_a", "cot_b")
#: The linear cases' (``_vocab_parallel.head_inputs``), beside the hidden states and weight.
HEAD_FIELDS = ("ids", "mask", "old_logps", "ref_logps", "advantages", "cot_a", "cot_b")


# ----------------------------------------------------------------------------- checks (shared)


def tolerances(logit_scale: float, grad_scale: float):
    """``(outputs, gradient)`` fixture tolerances of bf16 logits at these scales."""
    from ratiokl import spec

    return (spec.forward_tolerance(logit_scale),
            spec.grad_tolerance("bfloat16", logit_scale, grad_scale))


def grad_rel_limit() -> float:
    """Relative L2 error allowed between two bf16 gradients: two roundings of bf16."""
    from ratiokl.spec import GRAD_ROUNDOFF

    return 2.0 * GRAD_ROUNDOFF["bfloat16"]


def error_stats(xp: Any, actual: Any, expected: Any, rtol: float, atol: float) -> Tuple:
    """0-d arrays ``(worst |a-e| / (atol + rtol |e|), ||a-e||, ||e||, NaN mismatches,
    max |a-e|, max |e|)`` of float32 arrays; ``xp`` is ``torch`` or ``jax.numpy``."""
    nan_a, nan_e = xp.isnan(actual), xp.isnan(expected)
    both = ~(nan_a | nan_e)
    err = xp.where(both, xp.abs(actual - expected), 0.0)
    size = xp.where(both, xp.abs(expected), 0.0)
    return (xp.max(err / (atol + rtol * size)), xp.sqrt(xp.sum(err * err)),
            xp.sqrt(xp.sum(size * size)), xp.sum(nan_a != nan_e), xp.max(err), xp.max(size))


def judge(stats: Sequence[Any], tol: Any, rel_limit: float) -> Dict[str, Any]:
    """The record of one comparison from :func:`error_stats`: passed when every element is
    within ``tol``, NaN where NaN, and ``||a-e|| / max(||e||, atol) <= rel_limit``."""
    worst, err_norm, norm, nan_mismatch, max_err, max_size = (float(s) for s in stats)
    rel = err_norm / max(norm, tol.atol)
    return {"passed": worst <= 1.0 and nan_mismatch == 0 and rel <= rel_limit,
            "worst_over_tolerance": worst, "rel_l2": rel, "rel_l2_limit": rel_limit,
            "max_abs_error": max_err, "max_abs_expected": max_size,
            "nan_mismatches": int(nan_mismatch), "tolerance": tol.as_dict()}


def case_tolerance(case: Case, name: str, logit_scale: float, cfg: Config,
                   magnitude: Optional[float] = None) -> Tuple[Any, float]:
    """``(tolerance, relative L2 limit)`` of one output (``magnitude`` None) or gradient
    (``magnitude``: its largest entry) of ``case``: the fixture tolerances at the logits'
    scale; for the linear cases ``ratiokl.spec``'s linear ones (the logits rounded to bf16
    by their GEMM, the gradients GEMM sums relative to their largest entry) and a relative
    L2 error within two bf16 roundings, outputs and gradients alike, except ``d hidden``:
    the sum of ``tp`` partial products ``du_r W_r``, each rounded to bf16 and summed in
    bf16 by the all-reduce, where one GEMM rounds once: its limit grows as ``sqrt(tp)``."""
    from ratiokl import spec

    if magnitude is not None:
        if not case.linear:
            return tolerances(logit_scale, magnitude)[1], grad_rel_limit()
        tol = spec.linear_grad_tolerance("bfloat16", logit_scale, magnitude)
        return tol, grad_rel_limit() * (math.sqrt(cfg.tp) if name == "grad" else 1.0)
    if case.linear:  # the entropy's looser rule for every output but logp
        return spec.linear_forward_tolerance("bfloat16", logit_scale, cfg.vocab,
                                             entropy=name != "logp"), grad_rel_limit()
    tol = spec.forward_tolerance(logit_scale)
    return tol, tol.rtol


def target(sharded_ms: float, unsharded_ms: float, allreduce_ms: float, tp: int) -> Dict:
    """The issue's time target for one case."""
    limit = FACTOR * unsharded_ms / tp + allreduce_ms
    return {"limit_ms": limit, "met": sharded_ms <= limit,
            "sharded_over_unsharded_per_tp": sharded_ms / (unsharded_ms / tp),
            "rule": f"sharded <= {FACTOR} * unsharded / {tp} + all-reduces alone"}


def case_record(checks: Dict[str, Dict], ms: Dict[str, float], memory: Dict[str, Any],
                tp: int, **extra: Any) -> Dict[str, Any]:
    """One framework's result for one case (both frameworks' records have this form)."""
    return {"status": "ok", "passed": all(c["passed"] for c in checks.values()),
            "checks": checks, "ms": ms, "memory": memory,
            "target": target(ms["sharded"], ms["unsharded"], ms["allreduce_alone"], tp),
            **extra}


def outcome(err: BaseException) -> Dict[str, str]:
    return {"raised": type(err).__name__, "message": str(err)[:2000]}


def _progress(message: str) -> None:
    print(f"[vocab_parallel {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- PyTorch ranks


def _torch_bench(fn: Callable[[], Any], cuda: bool, iters: int,
                 agree: Optional[Callable[[float], float]] = None) -> float:
    """User-timing milliseconds of ``fn`` (the mean). CUDA without ``agree``:
    ``triton.testing.do_bench(fn)``. CUDA with ``agree`` (calls that make collectives):
    do_bench's method with its defaults, the run counts from ``agree(estimate)`` (the
    slowest rank's) so every rank runs ``fn`` as often. CPU: the median of ``iters`` calls
    after one (``_harness.cpu_ms``)."""
    if not cuda:
        from _harness import cpu_ms

        fn()
        return cpu_ms(fn, lambda _: None, iters)
    if agree is None:
        from _harness import user_ms

        return user_ms(fn)
    return _agreed_do_bench(fn, agree)


def _agreed_do_bench(fn: Callable[[], Any], agree: Callable[[float], float],
                     warmup_ms: float = 25.0, rep_ms: float = 100.0) -> float:
    """``do_bench(fn)`` as Triton does it (one call, 5 estimated, warm-up, then CUDA events
    around each run after a flush of L2, the mean), with the estimate agreed over ranks."""
    from triton import runtime

    driver = runtime.driver.active
    device = driver.get_device_interface()
    fn()
    device.synchronize()
    cache = driver.get_empty_cache_for_benchmark()
    begin, end = device.Event(enable_timing=True), device.Event(enable_timing=True)
    begin.record()
    for _ in range(5):
        driver.clear_cache(cache)
        fn()
    end.record()
    device.synchronize()
    estimate = agree(begin.elapsed_time(end) / 5)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(device.Event(enable_timing=True), device.Event(enable_timing=True))
              for _ in range(max(1, int(rep_ms / estimate)))]
    for start, stop in events:
        driver.clear_cache(cache)
        start.record()
        fn()
        stop.record()
    device.synchronize()
    return float(np.mean([start.elapsed_time(stop) for start, stop in events]))


class _TorchRank:
    """One rank's state: its device, group, the global inputs and its shard of them (the
    logits' columns; for the linear cases the lm_head's rows, built on their first use)."""

    def __init__(self, cfg: Config, rank: int) -> None:
        import torch
        import torch.distributed as dist

        from _inputs import make_inputs

        self.cfg, self.rank, self.torch, self.dist = cfg, rank, torch, dist
        self.cuda = not cfg.cpu
        self.device = torch.device("cuda", rank) if self.cuda else torch.device("cpu")
        self.group = dist.group.WORLD
        self.cols = slice(*cfg.bounds(rank))
        self.head: Optional[Dict[str, Any]] = None
        if all(case.linear for case in selected(cfg)):
            return
        inputs = make_inputs(cfg.case(), self.device, cfg.seed)  # the same on every rank
        self.whole = inputs.policy.detach().requires_grad_(True)
        self.whole_ref = inputs.ref
        self.x = {k: getattr(inputs, k) for k in TOKEN_FIELDS}
        self.shard = self.whole.detach()[..., self.cols].contiguous().requires_grad_(True)
        self.shard_ref = self.whole_ref[..., self.cols].contiguous()
        self.logit_scale = float(self.whole.detach().abs().max())

    def operands(self, case: Case, sharded: bool) -> List[Any]:
        """``[policy, ref]`` of the call (linear cases: ``[hidden, weight]``, their own
        leaves for the sharded and the unsharded call; the weight's rows when sharded)."""
        if not case.linear:
            return [self.shard, self.shard_ref] if sharded else [self.whole, self.whole_ref]
        if self.head is None:
            head = head_inputs(self.cfg, self.device)
            weight = head.pop("weight")
            self.head = {"hidden": head.pop("hidden"), "weight": weight,
                         "weight_shard": weight[self.cols].contiguous(),
                         "scale": head.pop("logit_scale"), "x": head}
            for key in ("hidden", "weight", "weight_shard"):
                self.head[key].requires_grad_(True)
            self.head["hidden_shard"] = self.head["hidden"].detach().clone().requires_grad_(True)
        h = self.head
        return [h["hidden_shard"], h["weight_shard"]] if sharded else [h["hidden"], h["weight"]]

    def agree(self, value: float) -> float:
        """The largest ``value`` over the ranks."""
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return float(t)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def step(self, case: Case, sharded: bool) -> Tuple[Any, Dict[str, Any]]:
        """One forward+backward (fresh gradients in the operands' ``.grad``)."""
        from ratiokl.torch import loss

        operands = self.operands(case, sharded)
        leaves = operands if case.linear else operands[:1]
        for leaf in leaves:
            leaf.grad = None
        sharding = {"vocab_group": self.group} if sharded else {}
        x = self.head["x"] if case.linear else self.x
        scalar, outputs = run_case(loss, case, *operands, x, self.cfg.backend, **sharding)
        scalar.backward()
        return scalar, outputs

    def grads(self, case: Case, sharded: bool) -> Dict[str, Any]:
        """The gradients a case compares, the unsharded ones cut to this rank's block:
        ``grad`` (the logits', or the hidden states') and, linear, ``grad_weight``."""
        operands = self.operands(case, sharded)
        if not case.linear:
            return {"grad": operands[0].grad if sharded else operands[0].grad[..., self.cols]}
        weight = operands[1].grad if sharded else operands[1].grad[self.cols]
        return {"grad": operands[0].grad, "grad_weight": weight}

    def clear(self, case: Case) -> None:
        for sharded in (True, False):
            for leaf in self.operands(case, sharded)[: 2 if case.linear else 1]:
                leaf.grad = None

    def collectives(self, fn: Callable[[], Any]) -> List[Tuple[Tuple[int, ...], Any, Any]]:
        """``(shape, dtype, op)`` of every ``all_reduce`` one ``fn()`` makes, in order."""
        dist, calls = self.dist, []
        real = dist.all_reduce

        def recording(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            calls.append((tuple(tensor.shape), tensor.dtype, op))
            return real(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = recording
        try:
            fn()
        finally:
            dist.all_reduce = real
        return calls

    def replay(self, calls) -> Callable[[], None]:
        """The all-reduces of :meth:`collectives` alone, on buffers of their shapes."""
        buffers = [(self.torch.zeros(shape, dtype=dtype, device=self.device), op)
                   for shape, dtype, op in calls]

        def run() -> None:
            for buf, op in buffers:
                self.dist.all_reduce(buf, op=op, group=self.group)

        return run

    def peak(self, fn: Callable[[], Any], inputs: Sequence[Any]) -> Optional[int]:
        """Bytes held at the peak of one ``fn()``: ``inputs`` + what it allocates (CUDA)."""
        from _harness import torch_peak_extra

        extra = torch_peak_extra(fn)
        return None if extra is None else extra + sum(t.numel() * t.element_size()
                                                      for t in inputs)

    def compare(self, case: Case, whole: Tuple, sharded: Tuple) -> Dict[str, Dict]:
        """The sharded outputs and gradient slices against the unsharded call's (``({output:
        tensor}, {gradient: tensor})`` each, the unsharded gradients cut to the block)."""
        scale = self.head["scale"] if case.linear else self.logit_scale
        checks = {}
        for kind, (values_1, values) in enumerate(zip(whole, sharded)):
            for name, expected in values_1.items():
                expected = expected.detach().float()
                magnitude = float(expected.abs().max()) if kind else None
                tol, limit = case_tolerance(case, name, scale, self.cfg, magnitude)
                stats = error_stats(self.torch, values[name].detach().float(), expected,
                                    tol.rtol, tol.atol)
                checks[name] = judge(stats, tol, limit)
        return checks

    def first_step(self, case: Case) -> Tuple[Optional[str], Dict[str, Any]]:
        """The first sharded call: ``(None, outputs)``, or ``(why not, {})`` where the
        installed ratiokl does not support the case sharded (the same on every rank)."""
        try:
            _, outputs = self.step(case, sharded=True)
        except UNSUPPORTED as err:
            why, outputs = f"{type(err).__name__}: {err}", {}
        else:
            why = None
        if self.agree(float(why is not None)) and why is None:
            why = "unsupported on another rank"
        return why, {k: v.detach() for k, v in outputs.items()}

    def run_case(self, case: Case) -> Dict[str, Any]:
        why, outputs = self.first_step(case)
        if why is not None:
            return {"status": "unsupported", "reason": why}
        cfg = self.cfg
        grads = {k: v.clone() for k, v in self.grads(case, sharded=True).items()}
        _, outputs_1 = self.step(case, sharded=False)
        whole = ({k: v.detach() for k, v in outputs_1.items()},
                 {k: v.clone() for k, v in self.grads(case, sharded=False).items()})
        self.clear(case)
        checks = self.compare(case, whole, (outputs, grads))
        del whole, outputs, outputs_1, grads
        one = lambda: self.step(case, sharded=False)  # noqa: E731
        split = lambda: self.step(case, sharded=True)  # noqa: E731
        calls = self.collectives(split)
        ms = {"unsharded": _torch_bench(one, self.cuda, cfg.iters),
              "sharded": _torch_bench(split, self.cuda, cfg.iters, self.agree),
              "allreduce_alone": _torch_bench(self.replay(calls), self.cuda, cfg.iters,
                                              self.agree)}
        self.clear(case)
        memory = {"sharded_step_peak_bytes": self.peak(split, self.operands(case, True)),
                  "unsharded_step_peak_bytes": self.peak(one, self.operands(case, False))}
        self.clear(case)
        return {"status": "ok", "checks": checks, "ms": ms, "memory": memory,
                "collectives": [[list(s), str(d).replace("torch.", ""), str(op)]
                                for s, d, op in calls]}

    def facts(self) -> Dict[str, Any]:
        """What the run learnt besides the cases: the rank's peak memory over all of it."""
        cuda = self.torch.cuda
        return {"rank": self.rank,
                "max_memory_allocated_bytes": cuda.max_memory_allocated() if self.cuda else None}

    def close(self) -> None:
        self.dist.destroy_process_group()

    def fault_check(self) -> Dict[str, Any]:
        """The last rank passes one row fewer: this rank's outcome, then a normal call."""
        from ratiokl.torch import loss

        torch, last = self.torch, self.cfg.tp - 1
        vocab = 4 * self.cfg.tp

        def call(rows: int):
            policy = torch.randn(rows, vocab // self.cfg.tp, device=self.device,
                                 requires_grad=True)
            ids = torch.zeros(rows, dtype=torch.long, device=self.device)
            return loss.ratio_kl(policy, policy.detach(), ids, ids == 0, ids.float(),
                                 vocab_group=self.group)

        try:
            call(7 if self.rank == last else 8)
        except Exception as err:  # noqa: BLE001 - which error, and its message, is the result
            result = outcome(err)
        else:
            result = {"raised": None, "message": ""}
        call(8)
        self.sync()
        result["group_usable_after"] = True
        return result


def _start_torch_rank(cfg: Config, rank: int, port: int) -> _TorchRank:
    """Join the process group (NCCL on GPUs, gloo on the CPU), then build the rank's state."""
    import torch
    import torch.distributed as dist

    cuda = not cfg.cpu
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=cfg.tp, timeout=datetime.timedelta(seconds=cfg.collective_timeout_s),
        device_id=torch.device("cuda", rank) if cuda else None)
    return _TorchRank(cfg, rank)


# ----------------------------------------------------------------------------- JAX part


class _JaxRun:
    """The JAX part in one process: ``shard_map`` over ``tp`` devices vs device 0 alone."""

    def __init__(self, cfg: Config) -> None:
        import jax
        import jax.numpy as jnp
        import torch
        from jax.sharding import AxisType, Mesh
        from jax.sharding import PartitionSpec as P

        from _inputs import jax_inputs, make_inputs

        self.cfg, self.jax = cfg, jax
        kind = "cpu" if cfg.cpu else "gpu"
        devices = [d for d in jax.devices() if d.platform == kind]
        if len(devices) < cfg.tp:
            raise RuntimeError(f"needs {cfg.tp} JAX {kind} devices; {len(devices)} visible")
        if cfg.vocab % cfg.tp:
            raise RuntimeError(f"shard_map splits V evenly: V={cfg.vocab} over tp={cfg.tp}")
        self.devices = devices[: cfg.tp]
        self.mesh = Mesh(np.array(self.devices), ("tp",), axis_types=(AxisType.Auto,))
        self.P = P
        self.torch_device = torch.device("cpu") if cfg.cpu else torch.device("cuda", 0)
        self._stats = jax.jit(lambda a, e, rtol, atol: error_stats(  # one jit: compiled per shape
            jnp, a.astype(jnp.float32), e.astype(jnp.float32), rtol, atol))
        self.head: Optional[Dict[str, Any]] = None
        if all(case.linear for case in selected(cfg)):
            return
        arrays = jax_inputs(make_inputs(cfg.case(), self.torch_device, cfg.seed))
        self.whole, self.split = self._place(
            [arrays["policy"], arrays["ref"]], {k: arrays[k] for k in TOKEN_FIELDS},
            P(None, None, "tp"), P(None, None, "tp"))
        del arrays
        self.logit_scale = float(jnp.max(jnp.abs(self.whole[0].astype(jnp.float32))))

    def _place(self, operands: List[Any], x: Dict[str, Any], *specs: Any) -> Tuple[List, List]:
        """``(whole, split)`` argument lists: everything on device 0, and the operands
        placed by ``specs`` over the mesh with ``x`` replicated."""
        from jax.sharding import NamedSharding

        jax = self.jax
        one = lambda a: jax.device_put(a, self.devices[0])  # noqa: E731
        replicated = NamedSharding(self.mesh, self.P())
        whole = [one(a) for a in operands] + [{k: one(v) for k, v in x.items()}]
        split = [jax.device_put(a, NamedSharding(self.mesh, spec))
                 for a, spec in zip(operands, specs)]
        return whole, split + [{k: jax.device_put(v, replicated) for k, v in x.items()}]

    def arguments(self, case: Case, sharded: bool) -> List[Any]:
        """The call's ``[policy, ref, x]`` (linear cases: ``[hidden, weight, x]``, built on
        their first use: the weight's rows over the mesh when sharded)."""
        if not case.linear:
            return self.split if sharded else self.whole
        if self.head is None:
            from _inputs import _to_jax

            head = head_inputs(self.cfg, self.torch_device)
            scale = head.pop("logit_scale")
            operands = [_to_jax(head.pop(k)) for k in ("hidden", "weight")]
            x = {k: _to_jax(v) for k, v in head.items()}
            whole, split = self._place(operands, x, self.P(), self.P("tp", None))
            self.head = {"whole": whole, "split": split, "scale": scale}
        return self.head["split" if sharded else "whole"]

    def step(self, case: Case, sharded: bool) -> Callable:
        """The jitted ``value_and_grad`` of the case w.r.t. the policy logits (linear: the
        hidden states and the weight)."""
        jax, P = self.jax, self.P
        from ratiokl.jax import loss

        backend = self.cfg.backend
        specs = (P(), P("tp", None)) if case.linear else (P(None, None, "tp"),) * 2

        def whole(policy, ref, x):
            return run_case(loss, case, policy, ref, x, backend)

        def split(policy, ref, x):
            body = lambda p, r, t: run_case(loss, case, p, r, t, backend,  # noqa: E731
                                            vocab_axis="tp")
            return jax.shard_map(body, mesh=self.mesh, in_specs=(*specs, P()),
                                 out_specs=P())(policy, ref, x)

        argnums = (0, 1) if case.linear else 0
        return jax.jit(jax.value_and_grad(split if sharded else whole, argnums=argnums,
                                          has_aux=True))

    def probe(self, case: Case) -> Optional[str]:
        """Why ``case`` cannot run sharded here (None: it runs): traced only, no compile."""
        try:
            self.jax.eval_shape(self.step(case, sharded=True), *self.arguments(case, True))
        except UNSUPPORTED as err:
            return f"{type(err).__name__}: {err}"
        return None

    def compare(self, case: Case, whole: Tuple, split: Tuple) -> Dict[str, Dict]:
        """The sharded outputs and gradients (assembled over the mesh) against the
        unsharded call's (``((value, outputs), gradients)`` each)."""
        import jax
        import jax.numpy as jnp

        def named(g):  # the gradients by check name (linear: hidden, then weight)
            return dict(zip(("grad", "grad_weight"), g if case.linear else (g,)))

        ((_, outputs_1), grads_1), ((_, outputs), grads) = whole, split
        scale = self.head["scale"] if case.linear else self.logit_scale
        checks = {}
        for kind, (values_1, values) in enumerate(((outputs_1, outputs),
                                                   (named(grads_1), named(grads)))):
            for name, expected in values_1.items():
                actual = values[name]
                magnitude = float(jnp.max(jnp.abs(expected.astype(jnp.float32)))) if kind \
                    else None
                tol, limit = case_tolerance(case, name, scale, self.cfg, magnitude)
                checks[name] = judge(self._stats(actual, jax.device_put(expected, actual.sharding),
                                                 tol.rtol, tol.atol), tol, limit)
        return checks

    def replay(self, hlo: str) -> Tuple[Callable[[], Any], List]:
        """The all-reduces of a compiled program (its HLO) alone, on buffers of their shapes."""
        jax, P = self.jax, self.P
        from jax.sharding import NamedSharding

        shapes = hlo_all_reduces(hlo)
        if not shapes:
            return (lambda: None), []
        buffers = [jax.device_put(np.zeros((self.cfg.tp,) + shape, dtype),
                                  NamedSharding(self.mesh, P("tp"))) for dtype, shape in shapes]
        body = lambda *xs: [jax.lax.psum(x, "tp") for x in xs]  # noqa: E731
        run = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("tp"), out_specs=P("tp")))
        return (lambda: run(*buffers)), [[str(np.dtype(d)), list(s)] for d, s in shapes]

    def time(self, call: Callable[[], Any]) -> float:
        """User timing (``_harness.jax_wall_ms``); on the CPU the median of synchronised
        calls (``cpu_ms``: queued host-device collectives can deadlock XLA's CPU client)."""
        from _harness import cpu_ms, jax_wall_ms

        block = self.jax.block_until_ready
        block(call())
        if self.cfg.cpu:
            return cpu_ms(call, block, self.cfg.iters)
        start = time.perf_counter()
        block(call())
        return jax_wall_ms(call, (time.perf_counter() - start) * 1e3)

    def run_case(self, case: Case) -> Dict[str, Any]:
        why = self.probe(case)
        if why is not None:
            return {"status": "unsupported", "reason": why}
        compiled = {}
        args = {"unsharded": self.arguments(case, False), "sharded": self.arguments(case, True)}
        for name, sharded in (("unsharded", False), ("sharded", True)):
            compiled[name] = self.step(case, sharded).lower(*args[name]).compile()
        whole = compiled["unsharded"](*args["unsharded"])
        checks = self.compare(case, whole, compiled["sharded"](*args["sharded"]))
        del whole
        replay, shapes = self.replay(compiled["sharded"].as_text())
        ms = {"unsharded": self.time(lambda: compiled["unsharded"](*args["unsharded"])),
              "sharded": self.time(lambda: compiled["sharded"](*args["sharded"])),
              "allreduce_alone": self.time(replay)}
        memory = {f"{name}_step_peak_bytes": xla_peak_bytes(c) for name, c in compiled.items()}
        return {"status": "ok", "checks": checks, "ms": ms, "memory": memory,
                "collectives": shapes}

    def facts(self) -> Dict[str, Any]:
        return {"devices": [str(d) for d in self.devices]}

    def close(self) -> None:
        pass

    def fault_check(self) -> Dict[str, Any]:
        """The mismatches a caller can make with one program for the whole mesh: per-token
        inputs of another N than the logits, and a vocabulary that the mesh cannot split."""
        jax, jnp, P = self.jax, self.jax.numpy, self.P
        from ratiokl.jax import loss

        tp = self.cfg.tp

        def call(rows: int, ids_rows: int, vocab: int) -> None:
            body = lambda p, i: loss.selected_logprobs(p, i, vocab_axis="tp")  # noqa: E731
            run = jax.shard_map(body, mesh=self.mesh, in_specs=(P(None, "tp"), P()),
                                out_specs=P())
            jax.eval_shape(run, jnp.zeros((rows, vocab)), jnp.zeros(ids_rows, jnp.int32))

        result = {"note": "one program for the whole mesh: devices cannot disagree on shapes"}
        for name, args in (("ids_rows_differ", (8, 7, 4 * tp)),
                           ("vocab_not_divisible", (8, 8, 4 * tp + 1))):
            try:
                call(*args)
            except Exception as err:  # noqa: BLE001 - which error, and its message, is the result
                result[name] = outcome(err)
            else:
                result[name] = {"raised": None, "message": ""}
        return result


def hlo_all_reduces(hlo: str) -> List[Tuple[Any, Tuple[int, ...]]]:
    """``(numpy dtype, shape)`` of every array that an ``all-reduce`` of ``hlo`` reduces."""
    names = {"f32": np.float32, "f64": np.float64, "f16": np.float16, "s32": np.int32,
             "s64": np.int64, "u32": np.uint32, "s8": np.int8, "u8": np.uint8,
             "pred": np.int8, "bf16": np.float16}  # bf16 / pred: same-size stand-ins
    found = []
    for line in hlo.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match is None:
            continue
        for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", match.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            found.append((names.get(dtype, np.float32), shape))
    return found


def xla_peak_bytes(compiled: Any) -> Optional[int]:
    """Arguments + temporaries + outputs - aliased bytes per device (XLA's memory analysis)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes
               + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def _child_main(out_path: Path, label: str, start: Callable[[], Any], verbose: bool) -> int:
    """A child's work, for either framework: ``start()`` builds the part's state
    (:class:`_TorchRank` or :class:`_JaxRun`), then every case and the fault check run, the
    JSON at ``out_path`` rewritten after each; a failure's traceback goes into it (exit 1)."""
    result: Dict[str, Any] = {"cases": {}}

    def write() -> None:
        out_path.write_text(json.dumps(result))

    try:
        state = start()
        for case in selected(state.cfg):
            if verbose:
                _progress(f"{label}: {case.name}")
            result["cases"][case.name] = state.run_case(case)
            write()
        result["fault_check"] = state.fault_check()
        result.update(state.facts())
        write()
        state.close()
    except BaseException:  # noqa: BLE001 - the traceback goes into the results
        result["error"] = traceback.format_exc()[-6000:]
        write()
        print(f"{label}:\n{result['error']}", file=sys.stderr, flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------- the parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env(cfg: Config) -> Dict[str, str]:
    """The children's environment: this process's ratiokl and the benchmark modules first,
    multicast off, and on the CPU ``tp`` JAX host devices and no GPU."""
    import ratiokl

    first = (str(Path(ratiokl.__file__).resolve().parents[1]), str(HERE))
    path = os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1",
               XLA_PYTHON_CLIENT_PREALLOCATE="false", **SAFE_ENV)
    if cfg.cpu:
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={cfg.tp}")
    return env


def run_children(commands: Sequence[List[str]], env: Dict[str, str],
                 deadline_s: float) -> List[Optional[int]]:
    """Run ``commands`` together; their exit codes (None: stopped at the deadline, or
    because another one failed: ranks left waiting in a collective would never return)."""
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands]
    end = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            if any(p.poll() not in (None, 0) for p in procs):
                end = min(end, time.monotonic() + 20)  # give the others a moment, then stop
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode if p.returncode is not None and p.returncode >= 0 else None
            for p in procs]


def _child_command(cfg: Config, *role: str) -> List[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", *role,
            "--config", json.dumps(asdict(cfg))]


def _read(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_torch(cfg: Config, seconds: float) -> Dict[str, Any]:
    """The PyTorch part: ``tp`` ranks, merged into one record per case; they are stopped
    after ``seconds``."""
    if not cfg.cpu:
        import torch

        if torch.cuda.device_count() < cfg.tp:
            return {"skipped": f"needs {cfg.tp} CUDA GPUs; {torch.cuda.device_count()} visible"}
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"rank{r}.json" for r in range(cfg.tp)]
        codes = run_children([_child_command(cfg, "torch", str(r), str(port), str(paths[r]))
                              for r in range(cfg.tp)], _child_env(cfg), seconds)
        ranks = [_read(p) for p in paths]
    return merge_ranks(cfg, ranks, codes)


def merge_ranks(cfg: Config, ranks: List[Dict], codes: List[Optional[int]]) -> Dict[str, Any]:
    """One record per case from the ranks' (the slowest rank's time; every rank's checks)."""
    merged: Dict[str, Any] = {"exit_codes": codes, "cases": {}}
    errors = {r: d["error"] for r, d in enumerate(ranks) if "error" in d}
    if errors or any(c != 0 for c in codes):
        merged["errors"] = errors or {"all": "a rank stopped without a traceback (see exit codes)"}
    for case in selected(cfg):
        per_rank = [d.get("cases", {}).get(case.name) for d in ranks]
        merged["cases"][case.name] = _merge_case(cfg, per_rank)
    merged["fault_check"] = _merge_fault(cfg, [d.get("fault_check") for d in ranks])
    merged["max_memory_allocated_bytes"] = [d.get("max_memory_allocated_bytes") for d in ranks]
    return merged


def _merge_case(cfg: Config, per_rank: List[Optional[Dict]]) -> Dict[str, Any]:
    if any(r is None for r in per_rank):
        return {"status": "failed", "reason": "not finished on every rank (see errors)"}
    if per_rank[0]["status"] != "ok":
        return per_rank[0]
    checks = {name: dict(min((r["checks"][name] for r in per_rank),
                             key=lambda c: (c["passed"], -c["worst_over_tolerance"])),
                         passed_on_ranks=[r["checks"][name]["passed"] for r in per_rank])
              for name in per_rank[0]["checks"]}
    per = lambda key, sub: [r[key][sub] for r in per_rank]  # noqa: E731
    ms = {"sharded": max(per("ms", "sharded")),
          "unsharded": float(np.median(per("ms", "unsharded"))),
          "allreduce_alone": max(per("ms", "allreduce_alone")),
          "sharded_per_rank": per("ms", "sharded"),
          "unsharded_per_rank": per("ms", "unsharded"),
          "allreduce_alone_per_rank": per("ms", "allreduce_alone")}
    memory = {f"{k}_per_rank": per("memory", k) for k in per_rank[0]["memory"]}
    return case_record(checks, ms, memory, cfg.tp, collectives=per_rank[0]["collectives"])


def _merge_fault(cfg: Config, per_rank: List[Optional[Dict]]) -> Dict[str, Any]:
    """Passed when every rank raised a ValueError naming the last rank and went on."""
    named = f"rank(s) {cfg.tp - 1} "
    passed = all(r is not None and r.get("raised") == "ValueError" and named in r["message"]
                 and r.get("group_usable_after") for r in per_rank)
    return {"case": f"rank {cfg.tp - 1} passes N - 1 rows (ratio_kl, check_ids=True)",
            "passed": passed, "ranks": per_rank}


def run_jax(cfg: Config, seconds: float) -> Dict[str, Any]:
    """The JAX part in a subprocess (its own GPU allocator, no preallocation), stopped after
    ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "jax.json"
        (code,) = run_children([_child_command(cfg, "jax", str(path))], _child_env(cfg),
                               seconds)
        raw = _read(path)
    result: Dict[str, Any] = {"exit_code": code, "devices": raw.get("devices"), "cases": {}}
    if "error" in raw or code != 0:
        result["errors"] = raw.get("error", "stopped without a traceback (see exit code)")
    for case in selected(cfg):
        rec = raw.get("cases", {}).get(case.name)
        if rec is None:
            rec = {"status": "failed", "reason": "not finished (see errors)"}
        elif rec["status"] == "ok":
            rec = case_record(rec["checks"], rec["ms"], rec["memory"], cfg.tp,
                              collectives=rec["collectives"])
        result["cases"][case.name] = rec
    fault = raw.get("fault_check")
    if fault is not None:
        fault["passed"] = all(fault[k]["raised"] in ("ValueError", "TypeError")
                              for k in ("ids_rows_differ", "vocab_not_divisible"))
    result["fault_check"] = fault or {"passed": False, "reason": "not run (see errors)"}
    return result


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float spelled as a string (strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def environment(cfg: Config) -> Dict[str, Any]:
    """The machine, the software and the settings of the run."""
    from _harness import metadata

    meta = metadata()
    meta["env"] = {k: os.environ.get(k) for k in (*SAFE_ENV, "CUDA_VISIBLE_DEVICES")}
    if not cfg.cpu:
        import torch

        meta["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        meta["nccl"] = str(torch.cuda.nccl.version())
        try:
            topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                  text=True, timeout=20)
            meta["nvidia_smi_topo"] = topo.stdout
        except (OSError, subprocess.SubprocessError) as err:
            meta["nvidia_smi_topo"] = f"unavailable: {err}"
    return meta


def verdict(parts: Dict[str, Dict]) -> Dict[str, Any]:
    """What the run shows, over both frameworks."""
    out: Dict[str, Any] = {"checks_passed": True, "fault_checks_passed": True,
                           "target_met": {}, "unsupported": [], "failed": []}
    for framework, part in parts.items():
        if "skipped" in part:
            out["failed"].append(f"{framework}: skipped: {part['skipped']}")
            continue
        for name, rec in part["cases"].items():
            label = f"{framework}:{name}"
            if rec["status"] == "unsupported":
                out["unsupported"].append(f"{label}: {rec['reason'][:200]}")
            elif rec["status"] != "ok":
                out["failed"].append(f"{label}: {rec.get('reason', rec['status'])}")
                out["checks_passed"] = False
            else:
                out["checks_passed"] &= rec["passed"]
                out["target_met"][label] = rec["target"]["met"]
        out["fault_checks_passed"] &= bool(part["fault_check"].get("passed"))
    out["all_targets_met"] = bool(out["target_met"]) and all(out["target_met"].values())
    return out


def summary_lines(doc: Dict[str, Any]) -> List[str]:
    """A short table of the run (the device tool returns the end of the output)."""
    lines = [f"tp={doc['tp']}  N={doc['config']['rows']}  V={doc['config']['vocab']}  "
             f"{'CPU dry run' if doc['config']['cpu'] else 'GPU'}",
             f"{'framework:case':44} {'check':6} {'sharded':>9} {'1 GPU':>9} {'allred':>8} "
             f"{'limit':>9} target"]
    for framework in doc["parts"]:
        part = doc[framework]
        for name, rec in part.get("cases", {}).items():
            label = f"{framework}:{name}"[:44]
            if rec["status"] != "ok":
                lines.append(f"{label:44} {rec['status']}: {rec.get('reason', '')[:60]}")
                continue
            ms, tgt = rec["ms"], rec["target"]
            lines.append(f"{label:44} {'ok' if rec['passed'] else 'FAIL':6} "
                         f"{ms['sharded']:9.3f} {ms['unsharded']:9.3f} "
                         f"{ms['allreduce_alone']:8.3f} {tgt['limit_ms']:9.3f} "
                         f"{'met' if tgt['met'] else 'missed'}")
        if "skipped" in part:
            lines.append(f"{framework}: skipped: {part['skipped']}")
            continue
        fault = "passed" if part.get("fault_check", {}).get("passed") else "FAILED"
        lines.append(f"{framework}: fault check {fault}; {part.get('wall_s')} s")
        if part.get("errors"):
            lines.append(f"{framework} errors: {str(part['errors'])[-1500:]}")
    v = doc["verdict"]
    lines.append(f"checks passed: {v['checks_passed']}; fault checks passed: "
                 f"{v['fault_checks_passed']}; all targets met: {v['all_targets_met']}; "
                 f"unsupported: {len(v['unsupported'])}; failed: {len(v['failed'])}")
    return lines


def run(cfg: Config, out: Path) -> Dict[str, Any]:
    """Every part, the verdict, one JSON document at ``out`` (rewritten after each part, so
    a run stopped later keeps what it measured)."""
    started = time.monotonic()
    end = started + cfg.deadline_s
    doc: Dict[str, Any] = {"benchmark": "vocab_parallel", "tp": cfg.tp, "config": asdict(cfg),
                           "logits_dtype": "bfloat16", "environment": environment(cfg),
                           "parts": list(cfg.parts)}
    for framework, part in (("torch", run_torch), ("jax", run_jax)):
        if framework not in cfg.parts:
            continue
        begin = time.monotonic()
        if end - begin < 30:
            doc[framework] = {"skipped": f"less than 30 s left of --deadline {cfg.deadline_s}"}
        else:
            doc[framework] = part(cfg, end - begin)
        doc[framework]["wall_s"] = round(time.monotonic() - begin, 1)
        doc["verdict"] = verdict({f: doc[f] for f in cfg.parts if f in doc})
        doc["wall_s"] = round(time.monotonic() - started, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(finite(doc), indent=1, allow_nan=False) + "\n")
    print("\n".join(summary_lines(doc)), flush=True)
    print(f"wrote {out} ({doc['wall_s']} s)", flush=True)
    return doc


def _parse(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py --preset vocab-parallel",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--tp", type=int, help="ranks / devices (default: every visible GPU; "
                        "2 with --cpu)")
    parser.add_argument("--out", type=Path, help="results file, or a folder for "
                        "h200x<tp>_vocab_parallel.json (default: benchmarks/results/)")
    parser.add_argument("--rows", type=int, help="tokens N (default 8192; --cpu: 16)")
    parser.add_argument("--vocab", type=int, help="global vocabulary V (default 151936; "
                        "--cpu: 24 * tp)")
    parser.add_argument("--hidden", type=int, help="the linear cases' hidden size H "
                        "(default 4096; --cpu: 16)")
    parser.add_argument("--density", type=float, default=0.9, help="active fraction of rows")
    parser.add_argument("--backend", default="auto", help="ratiokl backend of both calls")
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--parts", default="torch,jax", help="torch, jax or both")
    parser.add_argument("--deadline", type=int, default=540,
                        help="seconds after which the run's processes are stopped (the "
                        "device tool allows one command 600 s)")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on the CPU: gloo ranks, tp JAX host devices, tiny size")
    parser.add_argument("--show", type=Path, help="print the table of a results file, run nothing")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _config(args: argparse.Namespace) -> Config:
    tp = args.tp
    if tp is None:
        if args.cpu:
            tp = 2
        else:
            import torch

            tp = torch.cuda.device_count()
    if tp < 2:
        raise SystemExit(f"--tp must be at least 2 (got {tp}: no second GPU visible?)")
    parts = tuple(p for p in args.parts.split(",") if p)
    if not set(parts) <= {"torch", "jax"}:
        raise SystemExit(f"--parts: torch and/or jax; got {args.parts}")
    return Config(tp=tp, rows=args.rows or (16 if args.cpu else 8192),
                  vocab=args.vocab or (24 * tp if args.cpu else 151936),
                  hidden=args.hidden or (16 if args.cpu else 4096), density=args.density,
                  cpu=args.cpu, backend=args.backend, parts=parts, deadline_s=args.deadline,
                  cases=args.cases.split(",") if args.cases else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    sys.path.insert(0, str(HERE))
    if args.show:
        print("\n".join(summary_lines(json.loads(args.show.read_text()))))
        return 0
    if args.child:
        cfg = Config(**json.loads(args.config))
        cfg.parts = tuple(cfg.parts)
        if args.child[0] == "torch":
            rank, port, path = args.child[1:]
            return _child_main(Path(path), f"torch rank {rank}", lambda: _start_torch_rank(
                cfg, int(rank), int(port)), verbose=rank == "0")
        return _child_main(Path(args.child[1]), "jax", lambda: _JaxRun(cfg), verbose=True)
    cfg = _config(args)
    selected(cfg)  # unknown names fail here, before any process starts
    out = args.out or RESULTS
    if out.is_dir() or not out.suffix:
        out = out / default_name(cfg.tp, cfg.cpu)
    doc = run(cfg, out)
    v = doc["verdict"]
    return 0 if v["checks_passed"] and v["fault_checks_passed"] and not v["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
