"""Time the fused ``policy_loss`` (forward + backward) on a CUDA GPU; prints one JSON line per case.

    PYTHONPATH=src python benchmarks/fused_loss_timing.py [--sweep] [--jax]

Shape of PERF.md: N = 8192 tokens, V = 151,936, bf16, reference log-probs
given (the policy logits are the only ``[N, V]`` input). Medians of
``triton.testing.do_bench`` (L2 flushed). ``--sweep`` also tries other
(tile, warps, spans per row) launch plans of the fused kernel; ``--jax`` times
the JAX launch (jit of value_and_grad) too.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
import triton.testing  # noqa: E402

from ratiokl._kernels import LaunchConfig, split_plan  # noqa: E402
from ratiokl._kernels.fused_loss import FusedPlan  # noqa: E402
from ratiokl.torch import _launch, loss  # noqa: E402

N, V = 8192, 151_936
#: (tile, warps, at most this many spans per row; 1: one program per row).
SWEEP = [
    (4096, 4, 13), (4096, 4, 8), (4096, 4, 19), (4096, 4, 10), (4096, 4, 1),
    (2048, 4, 19), (2048, 2, 25), (8192, 8, 6),
]
#: The subset swept through the JAX launch (each plan is one more compile).
JAX_SWEEP = [SWEEP[i] for i in (0, 1)]


def _inputs(density: float = 1.0):
    g = torch.Generator(device="cuda").manual_seed(0)
    cuda = dict(device="cuda", generator=g)
    return dict(
        policy=torch.randn(N, V, **cuda).to(torch.bfloat16).requires_grad_(True),
        ids=torch.randint(0, V, (N,), **cuda), mask=torch.rand(N, **cuda) < density,
        old=torch.randn(N, **cuda) * 0.1 - 12.0, adv=torch.randn(N, **cuda),
        ref_logps=torch.randn(N, **cuda) * 0.1 - 12.0,
    )


def _step(x, backward: bool):
    def run():
        x["policy"].grad = None
        value, _ = loss.policy_loss(
            x["policy"], None, x["ids"], x["mask"], x["old"], x["adv"],
            ref_logps=x["ref_logps"], kl_coef=0.05, backend="triton", check_ids=False)
        if backward:
            value.backward()
    return run


def _record(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _time_torch(sweep: bool) -> None:
    for density in (1.0, 0.5):
        x = _inputs(density)
        for mode, backward in (("fwd", False), ("fwd+bwd", True)):
            ms = triton.testing.do_bench(_step(x, backward), warmup=50, rep=300)
            gbps = 2 * N * V * 2 * density / ms / 1e6  # read policy + write grad
            _record(provider="torch-triton-fused", mode=mode, density=density, ms=ms,
                    gbps_min_traffic=gbps)
    if not sweep:
        return
    x = _inputs()
    original = _launch.launch_plan
    for block, warps, splits in SWEEP:
        _launch.launch_plan = _plan(block, warps, splits)
        ms = triton.testing.do_bench(_step(x, True), warmup=30, rep=200)
        _record(provider="torch-triton-fused", mode="fwd+bwd", block_v=block, num_warps=warps,
                splits=_plan(block, warps, splits)(V, 2, N, True).spans.splits, ms=ms)
    _launch.launch_plan = original


def _plan(block: int, warps: int, splits: int):
    """A ``launch_plan`` substitute with a fixed configuration (a program per span)."""
    def plan(vocab, itemsize, n_rows, write_grad, interpreted=False):
        spans = split_plan(vocab, block, splits)
        return FusedPlan(LaunchConfig(block, warps), spans, spans.splits if interpreted else 1)
    return plan


def _time_jax(sweep: bool) -> None:
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import _launch as jax_fused
    from ratiokl.jax import loss as jax_loss

    key = jax.random.PRNGKey(0)
    policy = jax.random.normal(key, (N, V), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(key, (N,), 0, V)
    mask = jnp.ones((N,), bool)
    old = jnp.full((N,), -12.0)
    adv = jax.random.normal(key, (N,))

    def objective(p):
        return jax_loss.policy_loss(p, None, ids, mask, old, adv, ref_logps=old, kl_coef=0.05,
                                    backend="triton", check_ids=False)[0]

    def timed(**plan) -> None:
        step = jax.jit(jax.value_and_grad(objective))
        ms = triton.testing.do_bench(
            lambda: jax.block_until_ready(step(policy)), warmup=30, rep=200)
        _record(provider="jax-triton-fused", mode="fwd+bwd", density=1.0, ms=ms, **plan)

    timed()
    if not sweep:
        return
    original = jax_fused.launch_plan
    for block, warps, splits in JAX_SWEEP:
        jax_fused.launch_plan = _plan(block, warps, splits)
        jax_fused.fused_op.cache_clear()
        timed(block_v=block, num_warps=warps, splits=splits)
    jax_fused.launch_plan = original
    jax_fused.fused_op.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    parser.add_argument("--jax", action="store_true", help="also time the JAX launch")
    args = parser.parse_args()
    _record(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__)
    _time_torch(args.sweep)
    if args.jax:
        _time_jax(args.sweep)


if __name__ == "__main__":
    main()
