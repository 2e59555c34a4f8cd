"""Time ``ratio_kl`` (reference logits, k3) on a CUDA GPU over row counts; one JSON line per case.

    PYTHONPATH=src python benchmarks/few_rows_timing.py [--sweep] [--jax]

V = 151,936, bf16. The forward reads policy + reference logits (GB/s
counts those bytes; PERF.md's read ceiling is ~4,500 GB/s); forward +
backward adds a read of the policy and a write of the gradient. ``--sweep``
times the forward's split path (a program per (row, vocabulary split) +
combine) against the one-program-per-row kernel for several split counts
(data for ``heuristics.split_plan`` / ``use_split_forward``); ``--jax`` times
the JAX launch at the default heuristics too.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
import triton.testing  # noqa: E402

from ratiokl._kernels import forward_config, split_plan  # noqa: E402
from ratiokl.torch import _launch, _triton  # noqa: E402

V = 151_936
ROWS = (128, 1024, 8192)


def _inputs(n: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    cuda = dict(device="cuda", generator=g)
    policy = torch.randn(n, V, **cuda).to(torch.bfloat16)
    return dict(
        policy=policy, ref=torch.randn(n, V, **cuda).to(torch.bfloat16),
        ids=torch.randint(0, V, (n,), **cuda), mask=torch.ones(n, dtype=torch.bool, device="cuda"),
        old=torch.randn(n, **cuda) * 0.1 - 12.0,
    )


def _record(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _bench(fn, nbytes: float, graph: bool = False, **fields) -> float:
    """Median ms; ``graph``: replayed as a CUDA graph (GPU time, without the launch overhead)."""
    if graph:
        ms = triton.testing.do_bench_cudagraph(fn, rep=100)
    else:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    _record(ms=ms, gbps=nbytes / ms / 1e6, graph=graph, **fields)
    return ms


def _time_torch(n: int, sweep: bool) -> None:
    x = _inputs(n)
    fwd_bytes = 2 * n * V * 2
    temp = torch.ones(1, device="cuda")
    args = (x["policy"], x["ref"], x["ids"], x["mask"], x["old"], None, temp, 3)
    for graph in (False, True):
        _bench(lambda: _launch.row_forward(torch_raw, *args), fwd_bytes, graph,
               provider="torch-triton", op="ratio_kl", mode="fwd", N=n)
    policy = x["policy"].clone().requires_grad_(True)

    def step():
        policy.grad = None
        ratio, kl = _triton.ratio_kl(policy, x["ref"], x["ids"], x["mask"], x["old"], None, 3,
                                     1.0)
        (ratio + kl).sum().backward()

    _bench(step, 2 * fwd_bytes, provider="torch-triton", op="ratio_kl", mode="fwd+bwd", N=n)
    if not sweep:
        return
    block = forward_config(V, 2).block_v
    for splits in (1, 4, 8, 16):
        plan = split_plan(V, block, splits)
        split = n < 1024 and plan.splits > 1  # the path that the heuristic would take
        _bench(lambda: _launch.row_forward(torch_raw, *args, plan=plan, split=split),
               fwd_bytes, True, provider="torch-triton", op="ratio_kl", mode="fwd", N=n,
               splits=plan.splits, split_path=split)


def torch_raw(kernel):
    """Launch the JITFunction itself (outside a ``triton_op``)."""
    return kernel


def _time_jax(n: int) -> None:
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    key = jax.random.PRNGKey(0)
    policy = jax.random.normal(key, (n, V), jnp.float32).astype(jnp.bfloat16)
    ref = jax.random.normal(jax.random.PRNGKey(1), (n, V), jnp.float32).astype(jnp.bfloat16)
    ids = jax.random.randint(key, (n,), 0, V)
    mask = jnp.ones((n,), bool)
    old = jnp.full((n,), -12.0)

    def objective(p):
        ratio, kl = jax_loss.ratio_kl(p, ref, ids, mask, old, kl_estimator="k3",
                                      backend="triton", check_ids=False)
        return (ratio + kl).sum()

    fwd = jax.jit(objective)
    both = jax.jit(jax.value_and_grad(objective))
    fwd_bytes = 2 * n * V * 2
    _bench(lambda: jax.block_until_ready(fwd(policy)), fwd_bytes,
           provider="jax-triton", op="ratio_kl", mode="fwd", N=n)
    _bench(lambda: jax.block_until_ready(both(policy)), 2 * fwd_bytes,
           provider="jax-triton", op="ratio_kl", mode="fwd+bwd", N=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep the split count")
    parser.add_argument("--jax", action="store_true", help="also time the JAX launch")
    args = parser.parse_args()
    _record(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for n in ROWS:
        _time_torch(n, args.sweep)
        torch.cuda.empty_cache()
    if args.jax:
        for n in (128, 8192):
            _time_jax(n)


if __name__ == "__main__":
    main()
