"""Quick GPU correctness and timing of the Triton backends (torch and JAX launches).

Usage (on the H200)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/gpu_smoke.py --out results.json

Times ``ratio_kl`` (reference logits, k3) forward and forward+backward at
N=8192, V=151,936 bf16 (PERF.md's anchor shape), mask density 1.0 and 0.5,
few rows (N=128), the reference-log-probs variant, and the same forward and
forward+backward launched from JAX through jax-triton. Median times from
``triton.testing.do_bench`` (L2 flushed); a JAX call is timed to its
``block_until_ready``. Bandwidth is minimum bytes / time. Before timing, the
torch outputs are checked against the native backend on a slice of rows.
``--cpu`` runs the same plumbing at a tiny size through the interpreter
(no timings), to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402

from ratiokl.torch import _launch, _native, _triton  # noqa: E402

GB = 1e9


def _inputs(n, vocab, density, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    policy = torch.randn(n, vocab, generator=g, device=device).to(torch.bfloat16)
    ref = torch.randn(n, vocab, generator=g, device=device).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (n,), generator=g, device=device)
    mask = torch.rand(n, generator=g, device=device) < density
    typical = -(math.log(vocab) + 0.5)  # a typical log-prob of these logits
    old = torch.randn(n, generator=g, device=device) * 0.1 + typical
    ref_logps = torch.randn(n, generator=g, device=device) * 0.1 + typical
    return policy, ref, ids, mask, old, ref_logps


def _torch_fns(policy, ref, ids, mask, old, ref_logps, use_ref_logits=True):
    leaf = policy.detach().requires_grad_(True)
    ref_arg, lp_arg = (ref, None) if use_ref_logits else (None, ref_logps)

    def fwd():
        return _triton.ratio_kl(policy, ref_arg, ids, mask, old, lp_arg, 3, 1.0)

    def fwd_bwd():
        ratio, kl = _triton.ratio_kl(leaf, ref_arg, ids, mask, old, lp_arg, 3, 1.0)
        return torch.autograd.grad((ratio + kl).sum(), leaf)[0]

    return fwd, fwd_bwd


def _jax_fns(policy, ref, ids, mask, old):
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import _triton as jt_backend

    x, r = jax.dlpack.from_dlpack(policy), jax.dlpack.from_dlpack(ref)
    i, m, o = (jnp.asarray(t.cpu().numpy()) for t in (ids, mask, old))

    def ratio_kl(x, r, i, m, o):
        return jt_backend.ratio_kl(x, r, i, m, o, None, 3, 1.0)

    fwd = jax.jit(ratio_kl)
    grad = jax.jit(jax.grad(lambda *a: sum(jnp.sum(v) for v in ratio_kl(*a))))
    return (lambda: jax.block_until_ready(fwd(x, r, i, m, o))), (
        lambda: jax.block_until_ready(grad(x, r, i, m, o)))


def _sweep(results, policy, ref, ids, mask, old, do_bench):
    """Forward and backward timings over launch configurations (data for the heuristics)."""
    from triton import cdiv

    from ratiokl._kernels import LaunchConfig

    def raw(kernel):  # launch the JITFunction itself
        return kernel

    n, vocab = policy.shape
    temp = torch.ones(1, device="cuda")
    lse = _launch.row_forward(raw, policy, ref, ids, mask, old, None, temp, 3)[4]
    coef = torch.ones(n, device="cuda")
    row_bytes = vocab * policy.element_size()
    for block in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            if cdiv(block, 32 * warps) < 8:  # fewer than one 16-byte load per thread
                continue
            cfg = LaunchConfig(block, warps)
            ms = do_bench(lambda: _launch.row_forward(
                raw, policy, ref, ids, mask, old, None, temp, 3, config=cfg))
            _record(results, f"sweep fwd BLOCK_V={block} warps={warps}", ms, 2 * n * row_bytes)
            ms = do_bench(lambda: _launch.row_backward(
                raw, policy, ids, mask, temp, lse, coef, config=cfg))
            _record(results, f"sweep bwd BLOCK_V={block} warps={warps}", ms, 2 * n * row_bytes)


def _check(policy, ref, ids, mask, old, rows=64):
    """Triton vs native torch on the first ``rows`` rows (forward and gradient)."""
    sl = slice(0, rows)
    out = {}
    for name, mod in (("triton", _triton), ("native", _native)):
        leaf = policy[sl].detach().requires_grad_(True)
        ratio, kl = mod.ratio_kl(leaf, ref[sl], ids[sl], mask[sl], old[sl], None, 3, 1.0, False)
        grad = torch.autograd.grad((ratio + kl).sum(), leaf)[0]
        out[name] = (ratio.detach(), kl.detach(), grad.float())
    return {
        key: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        for key, a, b in zip(("ratio", "kl", "grad"), out["triton"], out["native"])
    }


def _record(results, name, ms, nbytes):
    rec = {"case": name, "ms": ms, "gbps": nbytes / (ms * 1e-3) / GB, "bytes": nbytes}
    results.append(rec)
    print(f"{name:44s} {ms:8.3f} ms  {rec['gbps']:8.0f} GB/s", flush=True)


def run_gpu(n, vocab, with_jax, sweep):
    from triton.testing import do_bench

    results = []
    policy, ref, ids, mask, old, ref_logps = _inputs(n, vocab, 1.0, "cuda")
    print("max |triton - native| / max |native| on 64 rows:", _check(policy, ref, ids, mask, old), flush=True)
    row_bytes = vocab * policy.element_size()
    copy_src = torch.empty(2 * n * row_bytes // 4, dtype=torch.float32, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    _record(results, "ceiling: device copy (read+write)",
            do_bench(lambda: copy_dst.copy_(copy_src)), 2 * copy_src.numel() * 4)
    del copy_src, copy_dst

    fwd, fwd_bwd = _torch_fns(policy, ref, ids, mask, old, ref_logps)
    _record(results, f"torch ratio_kl fwd N={n}", do_bench(fwd), 2 * n * row_bytes)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    _record(results, f"torch ratio_kl fwd+bwd N={n}", do_bench(fwd_bwd), 4 * n * row_bytes)
    results[-1]["peak_extra_bytes"] = peak
    print(f"  extra peak memory fwd+bwd: {peak / 2**30:.2f} GiB", flush=True)

    fwd_lp, fwd_bwd_lp = _torch_fns(policy, ref, ids, mask, old, ref_logps, use_ref_logits=False)
    _record(results, "torch ratio_kl(ref_logps) fwd", do_bench(fwd_lp), n * row_bytes)
    _record(results, "torch ratio_kl(ref_logps) fwd+bwd", do_bench(fwd_bwd_lp), 3 * n * row_bytes)

    half = mask & (torch.arange(n, device="cuda") % 2 == 0)
    fwd_half, _ = _torch_fns(policy, ref, ids, half, old, ref_logps)
    _record(results, "torch ratio_kl fwd density 0.5", do_bench(fwd_half), n * row_bytes)
    few = slice(0, 128)
    fwd_few, _ = _torch_fns(policy[few], ref[few], ids[few], mask[few], old[few], ref_logps[few])
    _record(results, "torch ratio_kl fwd N=128", do_bench(fwd_few), 2 * 128 * row_bytes)

    if sweep:
        _sweep(results, policy, ref, ids, mask, old, do_bench)
    if with_jax:
        jfwd, jfwd_bwd = _jax_fns(policy, ref, ids, mask, old)
        _record(results, f"jax ratio_kl fwd N={n}", do_bench(jfwd), 2 * n * row_bytes)
        _record(results, f"jax ratio_kl fwd+bwd N={n}", do_bench(jfwd_bwd), 4 * n * row_bytes)
        _record(results, f"torch ratio_kl fwd N={n} (host-synced like jax)",
                do_bench(lambda: (fwd(), torch.cuda.synchronize())), 2 * n * row_bytes)
    return results


def run_cpu():
    policy, ref, ids, mask, old, _ = _inputs(8, 300, 1.0, "cpu")
    print("max |interpret - native| / max |native| on 8 rows:", _check(policy, ref, ids, mask, old, rows=8))
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--no-jax", action="store_true", help="skip the jax-triton launches")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations")
    parser.add_argument("--cpu", action="store_true", help="tiny interpreter dry run, no timings")
    parser.add_argument("--out", default=None, help="write the records as JSON here")
    args = parser.parse_args()
    results = run_cpu() if args.cpu else run_gpu(args.n, args.vocab, not args.no_jax, args.sweep)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "torch": torch.__version__, "python": platform.python_version()}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "records": results}, f, indent=1)


if __name__ == "__main__":
    main()
