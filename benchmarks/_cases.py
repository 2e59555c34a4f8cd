"""What the suite measures: operations, modes, timings, shapes, presets and minimum bytes.

A *case* is one input configuration ``(N, V, density, dtype)`` (and, for the
in-situ lm_head step, the hidden size ``H``); every (provider, op, mode) of a
preset group runs on it under both timings (``TIMINGS``). Minimum bytes follow PERF.md:
the forward reads the policy logits (and the reference logits when the op
takes them) once for active rows; the backward reads the policy logits once
for active rows and writes the whole ``[N, V]`` gradient once (inactive rows
must hold exact zeros, so they are written too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

__all__ = [
    "BWD",
    "CISPO_OP",
    "CLIP_EPS",
    "Case",
    "DEVICE",
    "ENTROPY_COEF",
    "ENTROPY_OP",
    "FWD",
    "FWD_BWD",
    "Group",
    "KL_COEF",
    "HIDDEN_OPS",
    "LINEAR_LOGP",
    "LMHEAD",
    "LOGP_ENTROPY_OP",
    "OPS",
    "PRESETS",
    "Preset",
    "ROLLOUT_OPS",
    "TIMED_MODES",
    "TIMINGS",
    "Timing",
    "TorchOp",
    "USER",
    "min_bytes",
    "timed_modes",
    "uses_ref_logits",
]

#: Operations: the public function and how the reference enters.
OPS: Tuple[str, ...] = (
    "selected_logprobs",
    "ratio_kl",  # reference logits given
    "ratio_kl_ref_logps",  # precomputed reference log-probs given
    "policy_loss",  # reference logits given
    "policy_loss_ref_logps",  # precomputed reference log-probs given
    "policy_loss_ref_logps_entropy",  # the same with the entropy bonus (ENTROPY_COEF)
    "policy_loss_ref_logps_cispo",  # the same with objective="cispo"
    "selected_logprobs_entropy",  # selected_logprobs(return_entropy=True)
)
#: The policy loss with an entropy bonus: against ``policy_loss_ref_logps`` (PERF.md's
#: target: fwd+bwd <= 1.05x without).
ENTROPY_OP = "policy_loss_ref_logps_entropy"
#: The CISPO objective: against ``policy_loss_ref_logps`` (PPO; PERF.md: fwd+bwd <= 1.02x).
CISPO_OP = "policy_loss_ref_logps_cispo"
#: The log-probs with the entropy from the same pass: against ``selected_logprobs``
#: (PERF.md: fwd <= 1.05x, fwd+bwd with the entropy's gradient <= 1.08x).
LOGP_ENTROPY_OP = "selected_logprobs_entropy"

#: ``policy_loss_ref_logps`` with a rollout correction (``rollout_logps`` given), by op; its
#: target is PERF.md's policy loss with any correction <= 1.02x the same call without.
ROLLOUT_OPS: Dict[str, str] = {
    "policy_loss_rollout_token": "token-truncate",
    "policy_loss_rollout_sequence": "sequence-truncate",
}

#: The in-situ lm_head step: ``logits = hidden @ W.T`` -> loss -> gradients of hidden and W.
#: Its cases have ``hidden > 0`` and their own inputs (``_inputs.StepInputs``).
LMHEAD = "lmhead-step"
#: The log-prob seam from hidden states: ``hidden @ W.T`` -> per-token ``(logp, entropy)``
#: (what verl's, OpenRLHF's and TRL's actor forwards return), timed forward and forward +
#: backward to hidden and W with the entropy's gradient (random upstream gradients of both).
LINEAR_LOGP = "lmhead-logprobs"
#: The ops whose inputs are hidden states and the lm_head weight (``_inputs.StepInputs``).
HIDDEN_OPS: Tuple[str, ...] = (LMHEAD, LINEAR_LOGP)

FWD, BWD, FWD_BWD = "fwd", "bwd", "fwd+bwd"
#: Modes that are timed; ``bwd`` is derived as ``fwd+bwd - fwd`` (see README).
TIMED_MODES: Tuple[str, ...] = (FWD, FWD_BWD)

#: Timings, both measured for every (provider, op, mode, case) in one run (PERF.md):
#: ``user``: ``triton.testing.do_bench(fn)`` with its defaults, every provider with its
#: default arguments (ratiokl ``check_ids=True``); ``device``: the head-start timer,
#: ratiokl ``check_ids=False``.
USER, DEVICE = "user", "device"
TIMINGS: Tuple[str, ...] = (USER, DEVICE)

#: Policy-loss hyperparameters shared by every provider (PPO clip, KL weight; the entropy
#: bonus of ``ENTROPY_OP``).
CLIP_EPS = 0.2
KL_COEF = 0.04
ENTROPY_COEF = 0.01

#: Bytes per element of the logits dtypes the suite runs.
_ITEMSIZE: Dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}

#: Longest sequence of the ``[B, T]`` leading shape; ``B = N / T``.
_MAX_SEQ = 1024


class TorchOp(NamedTuple):
    """A torch provider's op: ``forward() -> (diff, aux)`` and the leaves the gradient reaches.

    ``grad_outputs``: the upstream gradients of ``diff`` when the provider fixes them
    (the bare GEMMs of the lm_head step); None: the op's own (``_measure``).
    """

    forward: Callable[[], Any]
    wrt: Any  # torch.Tensor [B, T, V] (or a copy of it), or a tuple of leaves; requires_grad
    grad_outputs: Optional[Tuple[Any, ...]] = None


def uses_ref_logits(op: str) -> bool:
    """Whether ``op`` reads a second ``[N, V]`` tensor (the reference logits)."""
    return op in ("ratio_kl", "policy_loss")


def timed_modes(op: str) -> Tuple[str, ...]:
    """The modes timed for ``op``: the lm_head step is a training step (``fwd+bwd``) only;
    the log-prob seam is timed both ways (a rollout's or reference's forward, a step)."""
    return (FWD_BWD,) if op == LMHEAD else TIMED_MODES


@dataclass(frozen=True)
class Case:
    """One input configuration: ``n`` tokens of vocabulary ``v``, a mask density, a dtype;
    ``hidden > 0``: hidden states ``[n, hidden]`` and ``W [v, hidden]`` in (the lm_head step)."""

    n: int
    v: int
    density: float
    dtype: str  # "bfloat16" | "float32"
    hidden: int = 0

    def __post_init__(self) -> None:
        if self.n % self.seq:
            raise ValueError(f"N={self.n} must be a multiple of the sequence length {self.seq}")

    @property
    def seq(self) -> int:
        """Tokens per sequence ``T`` of the ``[B, T]`` leading shape."""
        return min(self.n, _MAX_SEQ)

    @property
    def batch(self) -> int:
        """Sequences ``B``; one advantage each (GRPO)."""
        return self.n // self.seq

    @property
    def active(self) -> int:
        """Active (mask true) tokens: exactly ``round(density * n)``."""
        return int(round(self.density * self.n))

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    def label(self) -> str:
        h = f" H={self.hidden}" if self.hidden else ""
        return f"N={self.n} V={self.v}{h} d={self.density:g} {self.dtype}"


def min_bytes(op: str, mode: str, case: Case) -> Optional[int]:
    """Minimum HBM traffic of ``op`` in ``mode`` on ``case`` (per-row vectors ignored);
    None for the lm_head step (GEMM-bound: its yardstick is the bare GEMMs, not bytes)."""
    if op in HIDDEN_OPS:
        return None
    row_bytes = case.v * case.itemsize
    fwd = case.active * row_bytes * (2 if uses_ref_logits(op) else 1)
    bwd = case.active * row_bytes + case.n * row_bytes
    return {FWD: fwd, BWD: bwd, FWD_BWD: fwd + bwd}[mode]


@dataclass(frozen=True)
class Timing:
    """Timer budget: warmup and repetition time (ms) on a GPU; on a CPU, ``warmup_ms`` of
    warm-up calls (``_harness.cpu_ms``), then ``cpu_reps`` repetitions."""

    warmup_ms: int
    rep_ms: int
    cpu_reps: int


class Group(NamedTuple):
    """Cases, the providers that run on them, and their ops (None: the preset's)."""

    cases: Tuple[Case, ...]
    providers: Tuple[str, ...]
    ops: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class Preset:
    """Groups of cases (each with its providers, and optionally its own ops), and the ops."""

    groups: Tuple[Group, ...]
    ops: Tuple[str, ...]
    timing: Timing


_ALL = (
    "ratiokl-torch-triton",
    "ratiokl-torch-triton-unchecked",
    "ratiokl-torch-triton-compiled",
    "ratiokl-torch-triton-inplace",
    "ratiokl-torch-triton-graph",
    "ratiokl-jax-triton",
    "ratiokl-torch-native",
    "ratiokl-jax-native",
    "torch-eager",
    "torch-compile",
    "liger",
)
#: ratiokl's GPU paths and the fastest peer: every target at the headline shape.
_GPU = ("ratiokl-torch-triton", "ratiokl-torch-triton-unchecked",
        "ratiokl-torch-triton-compiled", "ratiokl-torch-triton-inplace",
        "ratiokl-torch-triton-graph", "ratiokl-jax-triton", "liger")
_FAST = ("ratiokl-torch-triton", "ratiokl-torch-triton-inplace", "ratiokl-torch-triton-graph",
         "ratiokl-jax-triton", "torch-eager", "liger")
#: The density target's providers (inactive rows skipped).
_DENSITY = ("ratiokl-torch-triton", "ratiokl-jax-triton")
#: The slow peers, on the op of PERF.md's eager / torch.compile columns only.
_SLOW = ("torch-eager", "torch-compile")
_NATIVE = ("ratiokl-torch-native", "ratiokl-jax-native", "torch-eager")
_HEADLINE_OPS = ("selected_logprobs", "ratio_kl", "ratio_kl_ref_logps", "policy_loss_ref_logps")
#: The lm_head step's providers on a GPU: ratiokl's loss on the logits and from the hidden
#: states (row chunks), Liger's, and the bare GEMMs.
_STEP = ("ratiokl-torch-triton", "ratiokl-torch-triton-linear", "liger", "gemm-only")
#: PERF.md's lm_head shape: N = 8192 tokens, hidden size 4096, V = 151,936, bf16.
_STEP_CASE = Case(8192, 151936, 1.0, "bfloat16", hidden=4096)
_STEP_GROUP = Group((_STEP_CASE,), _STEP, (LMHEAD,))
#: The log-prob seam's providers: ratiokl from the hidden states (both frameworks) and on
#: materialised logits, the trainers' own fused heads (TRL's chunked function, verl's
#: kernel, cut-cross-entropy's NLL without entropy) and the bare GEMMs.
_SEAM = ("ratiokl-torch-triton-linear", "ratiokl-jax-triton-linear", "ratiokl-torch-triton",
         "trl-chunked", "verl-fused", "cce", "gemm-only")
#: Memory flat in N: the two chunked ops at 4x and 8x the headline rows, beside the GEMMs.
_GROWTH = Group(tuple(Case(n, 151936, 1.0, "bfloat16", hidden=4096) for n in (32768, 65536)),
                ("ratiokl-torch-triton-linear", "gemm-only"), (LMHEAD, LINEAR_LOGP))


def _grid(ns, vs, densities, dtypes) -> Tuple[Case, ...]:
    return tuple(Case(n, v, d, t) for t in dtypes for n in ns for v in vs for d in densities)


PRESETS: Dict[str, Preset] = {
    # Every shape of issue 5; far more than one device session.
    "full": Preset(
        groups=(Group(_grid((128, 8192, 32768), (32768, 151936, 262144), (1.0, 0.5),
                            ("bfloat16", "float32")), _ALL), _STEP_GROUP),
        ops=OPS,
        timing=Timing(warmup_ms=25, rep_ms=100, cpu_reps=10),
    ),
    # PERF.md's targets in one device call: the headline shape for ratiokl's GPU paths
    # and Liger; density 0.5 for the density target; eager and torch.compile on
    # ratio_kl only (their column in PERF.md; minutes of compilation otherwise); the
    # few-rows shapes (N = 128 and 1024, against the CUDA graph) for ratiokl and the
    # cheap peers; the lm_head step; the policy loss with an entropy bonus, with CISPO and
    # with each rollout correction, and the log-probs with their entropy (one case each,
    # the torch Triton provider: the cost against the same call without).
    "headline": Preset(
        groups=(
            Group(_grid((8192,), (151936,), (1.0,), ("bfloat16",)), _GPU),
            # The entropy bonus and the rollout correction beside the default
            # (policy_loss_ref_logps, above).
            Group(_grid((8192,), (151936,), (1.0,), ("bfloat16",)), ("ratiokl-torch-triton",),
                  (ENTROPY_OP, CISPO_OP, LOGP_ENTROPY_OP, *ROLLOUT_OPS)),
            Group(_grid((8192,), (151936,), (1.0,), ("bfloat16",)), _SLOW, ("ratio_kl",)),
            Group(_grid((8192,), (151936,), (0.5,), ("bfloat16",)), _DENSITY),
            Group(_grid((128, 1024), (151936,), (1.0,), ("bfloat16",)), _FAST),
            _STEP_GROUP,
        ),
        ops=_HEADLINE_OPS,
        timing=Timing(warmup_ms=10, rep_ms=60, cpu_reps=10),
    ),
    # The CPU native paths against eager PyTorch at a moderate size (issue 5: within 1.5x).
    "cpu": Preset(
        groups=(Group(_grid((1024,), (32768,), (1.0,), ("float32",)), _NATIVE),),
        ops=OPS,
        timing=Timing(warmup_ms=1, rep_ms=5, cpu_reps=7),
    ),
    # The hidden-state ops (issue 35's targets): the log-prob seam with the trainers' fused
    # heads, the lm_head loss step with its JAX twin; "linear-growth": both chunked ops at
    # 4x / 8x rows (memory flat in N).
    "linear": Preset(
        groups=(
            Group((_STEP_CASE,), _SEAM, (LINEAR_LOGP,)),
            Group((_STEP_CASE,), _STEP + ("ratiokl-jax-triton-linear",), (LMHEAD,)),
        ),
        ops=(LINEAR_LOGP,),
        timing=Timing(warmup_ms=10, rep_ms=60, cpu_reps=3),
    ),
    "linear-growth": Preset(groups=(_GROWTH,), ops=(LINEAR_LOGP,),
                            timing=Timing(warmup_ms=10, rep_ms=60, cpu_reps=3)),
    # CI on the CPU: tiny, native providers, every op; a tiny lm_head step (bf16, as on
    # the GPU) with ratiokl's native loss and the bare GEMMs.
    "cpu-smoke": Preset(
        groups=(
            Group(_grid((32,), (256,), (0.5,), ("float32",)), _NATIVE),
            Group((Case(32, 256, 0.5, "bfloat16", hidden=64),),
                  ("ratiokl-torch-native", "ratiokl-torch-native-linear", "gemm-only"),
                  HIDDEN_OPS),
        ),
        ops=OPS,
        timing=Timing(warmup_ms=20, rep_ms=5, cpu_reps=5),
    ),
}
