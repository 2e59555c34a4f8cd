"""Vocabulary-parallel ratio/KL on 2 GPUs: correctness and time next to one unsharded GPU.

Usage (on a machine with 2 CUDA GPUs, from the repository root)::

    PYTHONPATH=src python benchmarks/vocab_parallel_gpu.py OUT.json [--rows N] [--vocab V]

PyTorch part: 2 processes over NCCL (``vocab_group=``), each holding half of
the vocabulary. JAX part (a subprocess, so the two frameworks never share a
GPU allocator): ``shard_map`` over a 2-device mesh (``vocab_axis=``), and plain
``jit`` on vocabulary-sharded ``NamedSharding`` arrays through the ordinary
API. Each part checks the sharded outputs and gradients against the float64
spec on a small case and against the unsharded call at the benchmark size,
then times one forward+backward of ``ratio_kl`` (loss ``sum(0.5 * ratio +
kl)``) sharded over 2 GPUs and unsharded on one GPU at the same total size.
The sharded paths run on each per-shard backend: ``native`` and ``triton``
(the Triton statistics and backward kernels; ``interpret`` in the CPU dry
run for PyTorch), in PyTorch and inside JAX's ``shard_map``.
Everything needing CUDA is skipped (and says so in the JSON) when fewer than
2 GPUs are visible. Writes one JSON document to OUT.json. ``--cpu`` runs the
same script on the CPU (gloo, 2 host devices) to check it before using a GPU;
its timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict

import numpy as np

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines

SMALL = (64, 1001)  # rows, vocab of the spec check (uneven halves for torch)


def _spec_case(rows: int, vocab: int, seed: int = 0) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = rng.random(rows) < 0.9
    policy = rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32)
    policy[~mask, :7] = np.nan  # inactive rows hold NaN in the first shard only
    return {"policy": policy, "ref": rng.normal(0.0, 3.0, (rows, vocab)).astype(np.float32),
            "ids": rng.integers(0, vocab, rows), "mask": mask,
            "old": rng.normal(-3.0, 1.0, rows).astype(np.float32)}


def _spec_errors(case, ratio, kl, grad, cols: slice) -> Dict[str, float]:
    """Max ``|a - e| / max(1, |e|)`` of outputs and this shard's gradient vs ``ratiokl.spec``."""
    from ratiokl import spec

    args = (case["policy"], case["ref"], case["ids"], case["mask"], case["old"])
    exp_ratio, exp_kl = spec.ratio_kl(*args)
    n = len(case["ids"])
    exp_grad = spec.ratio_kl_grad(*args, np.full(n, 0.5), np.ones(n))[:, cols]
    def err(actual, expected):
        actual = np.asarray(actual, np.float64)
        assert np.array_equal(np.isnan(actual), np.isnan(expected)), "NaN pattern differs"
        return float(np.nanmax(np.abs(actual - expected) / np.maximum(1.0, np.abs(expected))))

    return {"ratio": err(ratio, exp_ratio), "kl": err(kl, exp_kl), "grad": err(grad, exp_grad)}


def _versions(*modules: str) -> Dict[str, str]:
    out = {"python": platform.python_version()}
    for name in modules:
        # Installed metadata, not an import: a bare `import jax_triton` empties
        # TRITON_CACHE_DIR for this process and the ranks it spawns.
        try:
            out[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ----------------------------------------------------------------------------- PyTorch


def _torch_rank(rank: int, world: int, port: int, cfg: Dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist

    from ratiokl.torch import loss

    cuda = not cfg["cpu"]
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, device_id=dev if cuda else None)
    result: Dict[str, Any] = {}

    def run(policy, ref, ids, mask, old, group, backend="auto"):
        policy.grad = None
        ratio, kl = loss.ratio_kl(policy, ref, ids, mask, old, vocab_group=group, backend=backend,
                                  check_ids=False)
        (0.5 * ratio + kl).sum().backward()
        return ratio, kl, policy.grad

    kernels = "triton" if cuda else "interpret"  # the Triton kernels on each shard

    # Small case against the float64 spec (uneven shards: 501 + 500 columns).
    case = _spec_case(*SMALL)
    half = (SMALL[1] + 1) // 2
    cols = slice(0, half) if rank == 0 else slice(half, SMALL[1])
    t = lambda x, **kw: torch.tensor(x, device=dev, **kw)  # noqa: E731
    result["spec_max_rel_error"] = {}
    for backend in ("native", kernels):
        policy = t(case["policy"][:, cols], requires_grad=True)
        ratio, kl, grad = run(policy, t(case["ref"][:, cols]), t(case["ids"]), t(case["mask"]),
                              t(case["old"]), dist.group.WORLD, backend=backend)
        outputs = [x.detach().cpu() for x in (ratio, kl, grad)]
        result["spec_max_rel_error"][f"sharded_{backend}"] = _spec_errors(case, *outputs, cols)

    # Benchmark size: the same inputs on every rank (same seed), sharded vs unsharded.
    rows, vocab = cfg["rows"], cfg["vocab"]
    gen = torch.Generator(device=dev).manual_seed(0)
    full = torch.randn(rows, vocab, device=dev, generator=gen).mul_(3).to(torch.bfloat16)
    ref_full = torch.randn(rows, vocab, device=dev, generator=gen).mul_(3).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,), device=dev, generator=gen)
    mask = torch.rand(rows, device=dev, generator=gen) < 0.9
    old = torch.randn(rows, device=dev, generator=gen) - 3.0
    local = vocab // world
    cols = slice(rank * local, (rank + 1) * local)
    shard = full[:, cols].contiguous().requires_grad_(True)
    ref_shard = ref_full[:, cols].contiguous()
    whole = full.clone().requires_grad_(True)
    whole_out = [x.detach().clone() for x in run(whole, ref_full, ids, mask, old, None,
                                                   backend="native")]
    whole_out[2] = whole_out[2][:, cols]
    result["vs_unsharded_native_max_abs_error"] = {}
    timings = {}
    for backend in ("native", kernels):
        sharded_out = run(shard, ref_shard, ids, mask, old, dist.group.WORLD, backend=backend)
        result["vs_unsharded_native_max_abs_error"][f"sharded_{backend}"] = {
            name: float((a.detach().float() - b.float()).abs().max())
            for name, a, b in zip(("ratio", "kl", "grad"), sharded_out, whole_out)
        }
        timings[f"sharded_2gpu_{backend}"] = lambda b=backend: run(
            shard, ref_shard, ids, mask, old, dist.group.WORLD, backend=b)
    for backend in ("native", "auto"):
        timings[f"unsharded_1gpu_{backend}"] = lambda b=backend: run(whole, ref_full, ids, mask,
                                                                    old, None, backend=b)
    result["fwd_bwd_ms"] = {}
    for name, fn in timings.items():
        try:
            ms = _torch_time(fn, cfg["iters"], cuda)
        except Exception as err:  # noqa: BLE001 - a failing backend is recorded, not fatal
            result["fwd_bwd_ms"][name] = f"failed: {type(err).__name__}: {err}"
            continue
        slowest = torch.tensor([ms], device=dev)
        if name.startswith("sharded"):
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the step waits for the slower rank
        result["fwd_bwd_ms"][name] = float(slowest)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def _torch_time(fn: Callable[[], Any], iters: int, cuda: bool) -> float:
    """Mean milliseconds of ``fn`` over ``iters`` runs after 3 warm-up runs (CUDA events)."""
    import torch

    for _ in range(3):
        fn()
    if not cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run_torch(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    if not cfg["cpu"] and torch.cuda.device_count() < 2:
        return {"skipped": f"needs 2 CUDA GPUs; {torch.cuda.device_count()} visible"}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "torch.json")
        mp.spawn(_torch_rank, args=(2, port, cfg, out_path), nprocs=2, join=True)
        with open(out_path) as f:
            return json.load(f)


# ----------------------------------------------------------------------------- JAX


def _jax_time(fn: Callable[[], Any], iters: int) -> float:
    """Mean milliseconds of ``fn`` (blocked until ready) over ``iters`` runs after warm-up."""
    import jax

    for _ in range(3):
        jax.block_until_ready(fn())
    start = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / iters


def _max_abs_diff(a, b) -> float:
    """``max |a - b|`` computed where ``a`` lives (``b`` is moved to ``a``'s sharding)."""
    import jax
    import jax.numpy as jnp

    b = jax.device_put(b, a.sharding)
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _jax_part(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from ratiokl.jax import loss

    platform_name = "cpu" if cfg["cpu"] else "gpu"
    gpus = [d for d in jax.devices() if d.platform == platform_name]
    if len(gpus) < 2:
        return {"skipped": f"needs 2 JAX {platform_name} devices; {len(gpus)} visible"}
    mesh = Mesh(np.array(gpus[:2]), ("tp",), axis_types=(AxisType.Auto,))
    vocab_spec = NamedSharding(mesh, P(None, "tp"))

    def objective(policy, ref, ids, mask, old, **kw):
        ratio, kl = loss.ratio_kl(policy, ref, ids, mask, old, **kw)
        return (0.5 * ratio + kl).sum(), (ratio, kl)

    def sharded(backend: str) -> Callable:
        def run(policy, ref, ids, mask, old):
            body = lambda *a: objective(*a, vocab_axis="tp", backend=backend)  # noqa: E731
            return jax.shard_map(body, mesh=mesh, out_specs=(P(), (P(), P())),
                                 in_specs=(P(None, "tp"), P(None, "tp"), P(), P(), P()))(
                policy, ref, ids, mask, old)

        return run

    step = lambda f: jax.jit(jax.value_and_grad(f, has_aux=True))  # noqa: E731
    result: Dict[str, Any] = {"spec_max_rel_error": {}}

    case = _spec_case(SMALL[0], SMALL[1] + 1)  # shard_map splits evenly: 2 x 501
    args = [jnp.asarray(case[k]) for k in ("policy", "ref", "ids", "mask", "old")]
    for backend in ("native", "triton"):
        try:
            (_, (ratio, kl)), grad = step(sharded(backend))(*args)
            errors = _spec_errors(case, ratio, kl, grad, slice(None))
        except Exception as err:  # noqa: BLE001 - e.g. no jax-triton here: recorded, not fatal
            errors = f"failed: {type(err).__name__}: {err}"
        result["spec_max_rel_error"][f"shard_map_{backend}"] = errors

    rows, vocab = cfg["rows"], cfg["vocab"]
    keys = jax.random.split(jax.random.key(0), 5)
    full = (3 * jax.random.normal(keys[0], (rows, vocab))).astype(jnp.bfloat16)
    ref = (3 * jax.random.normal(keys[1], (rows, vocab))).astype(jnp.bfloat16)
    ids = jax.random.randint(keys[2], (rows,), 0, vocab)
    mask = jax.random.uniform(keys[3], (rows,)) < 0.9
    old = jax.random.normal(keys[4], (rows,)) - 3.0
    one = lambda x: jax.device_put(x, gpus[0])  # noqa: E731
    single = [one(x) for x in (full, ref, ids, mask, old)]
    split = [jax.device_put(x, vocab_spec) for x in (full, ref)] + [
        jax.device_put(x, NamedSharding(mesh, P())) for x in (ids, mask, old)]
    runs = {
        "sharded_2gpu_shard_map_native": (step(sharded("native")), split),
        "sharded_2gpu_shard_map_triton": (step(sharded("triton")), split),
        "sharded_2gpu_plain_jit_native": (step(lambda *a: objective(*a, backend="native")), split),
        "unsharded_1gpu_native": (step(lambda *a: objective(*a, backend="native")), single),
        "unsharded_1gpu_auto": (step(lambda *a: objective(*a, backend="auto")), single),
    }
    (_, (u_ratio, u_kl)), u_grad = runs["unsharded_1gpu_native"][0](*single)
    result["vs_unsharded_native_max_abs_error"] = {}
    result["fwd_bwd_ms"] = {}
    for name, (fn, inputs) in runs.items():
        try:
            (_, (ratio, kl)), grad = fn(*inputs)
            result["vs_unsharded_native_max_abs_error"][name] = {
                out: _max_abs_diff(a, b) for out, a, b in
                (("ratio", ratio, u_ratio), ("kl", kl, u_kl), ("grad", grad, u_grad))
            }
            result["fwd_bwd_ms"][name] = _jax_time(lambda: fn(*inputs), cfg["iters"])
        except Exception as err:  # noqa: BLE001 - a failing path is recorded, not fatal
            result["fwd_bwd_ms"][name] = f"failed: {type(err).__name__}: {err}"
    return result


def run_jax(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The JAX part in a subprocess (its own GPU allocator, no preallocation)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if cfg["cpu"]:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "jax.json")
        cmd = [sys.executable, __file__, out_path, "--jax-part", "--rows", str(cfg["rows"]),
               "--vocab", str(cfg["vocab"]), "--iters", str(cfg["iters"])]
        cmd += ["--cpu"] if cfg["cpu"] else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            return {"failed": proc.stderr[-4000:]}
        with open(out_path) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="path of the JSON results")
    parser.add_argument("--rows", type=int, default=4096, help="tokens N (rows of the logits)")
    parser.add_argument("--vocab", type=int, default=131072, help="global vocabulary (even)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cpu", action="store_true",
                        help="dry run on the CPU (gloo, 2 host devices)")
    parser.add_argument("--jax-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = {"rows": args.rows, "vocab": args.vocab, "iters": args.iters, "cpu": args.cpu}
    if args.jax_part:
        result = _jax_part(cfg)
    else:
        result = {"benchmark": "vocab_parallel_ratio_kl_fwd_bwd", "config": cfg,
                  "logits_dtype": "bfloat16", "host": platform.node(),
                  "versions": _versions("torch", "jax", "jaxlib", "triton", "jax_triton"),
                  "torch": run_torch(cfg), "jax": run_jax(cfg)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
