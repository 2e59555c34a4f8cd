"""The lm_head's precision and speed side by side: log-probs and entropy from hidden states
(``linear_selected_logprobs``), each provider's error against float64 beside its time.

One process, one run (user timing: ``triton.testing.do_bench`` defaults; JAX: a jitted call
timed by a wall loop ending in ``block_until_ready``), on a CUDA GPU::

    python benchmarks/lm_head_precision.py --out results.json [--n 8192 --h 4096 --v 151936]

The inputs: bf16 hidden states ``N(0, 1)`` and a bf16 weight whose logits have std
``--logit-std`` (8: max about 50), half the targets each row's argmax (as sampled tokens
often are). The reference: float64 on the same bf16 values (float32 weight for the
``fp32-weight`` providers, on its float32 values), computed on the GPU in row chunks. Per
provider: fwd and fwd+bwd ms (the upstream gradients of both outputs random), the peak
memory beyond the inputs, and the max |error| of the log-prob and entropy and the relative
max error of ``d hidden`` and ``d weight``. A provider whose import fails is skipped.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Callable, Dict, Optional

import torch


def _bench(fn) -> float:
    """``triton.testing.do_bench(fn)`` with its defaults (user timing), ms."""
    import triton.testing

    return triton.testing.do_bench(fn)


def _inputs(n: int, h: int, v: int, std: float, seed: int = 0) -> SimpleNamespace:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w32 = torch.randn(v, h, device="cuda", generator=g) * (std / h ** 0.5)
    weight = w32.to(torch.bfloat16)
    ids = torch.randint(0, v, (n,), device="cuda", generator=g)
    argmax = torch.cat([(hidden[i:i + 1024] @ weight[:, :].T).argmax(-1)
                        for i in range(0, n, 1024)])
    ids = torch.where(torch.rand(n, device="cuda", generator=g) < 0.5, argmax, ids)
    return SimpleNamespace(hidden=hidden, weight=weight, w32=w32, ids=ids,
                           mask=torch.ones(n, dtype=torch.bool, device="cuda"),
                           g_logp=torch.randn(n, device="cuda", generator=g),
                           g_ent=torch.randn(n, device="cuda", generator=g))


def _reference(hidden: torch.Tensor, weight: torch.Tensor, x: SimpleNamespace) -> Dict:
    """float64 ``logp``, entropy, ``d hidden`` and ``d weight`` in row chunks."""
    w = weight.double()
    logp, ent, dh = [], [], []
    dw = torch.zeros_like(w)
    for s in range(0, hidden.shape[0], 1024):
        hc = hidden[s:s + 1024].double()
        z = hc @ w.T
        lp_all = torch.log_softmax(z, -1)
        p = lp_all.exp()
        ids = x.ids[s:s + 1024]
        lp = lp_all.gather(1, ids[:, None])[:, 0]
        e = -(p * lp_all).sum(-1)
        onehot = torch.zeros_like(p).scatter_(1, ids[:, None], 1.0)
        du = x.g_logp[s:s + 1024, None].double() * (onehot - p) \
            - x.g_ent[s:s + 1024, None].double() * p * (lp_all + e[:, None])
        dh.append(du @ w)
        dw += du.T @ hc
        logp.append(lp)
        ent.append(e)
        del z, lp_all, p, onehot, du
    return {"logp": torch.cat(logp), "entropy": torch.cat(ent), "d_hidden": torch.cat(dh),
            "d_weight": dw}


def _errors(out, grads, ref) -> Dict[str, Optional[float]]:
    logp, ent = out
    res = {"logp_max_abs_err": float((logp.double() - ref["logp"]).abs().max()),
           "entropy_max_abs_err": None if ent is None else
           float((ent.double() - ref["entropy"]).abs().max())}
    for name, g in zip(("d_hidden", "d_weight"), grads):
        want = ref[name]
        res[f"{name}_rel_err"] = None if g is None else \
            float((g.double() - want).abs().max() / want.abs().max())
    return res


def _torch_provider(name: str, fn: Callable, leaves, x, ref, reps: Dict) -> Dict:
    """Time ``fn() -> (logp, entropy | None)`` fwd and fwd+bwd; errors; peak memory."""
    def fwd():
        with torch.no_grad():
            return fn()

    def fwd_bwd():
        logp, ent = fn()
        total = (logp * x.g_logp).sum()
        if ent is not None:
            total = total + (ent * x.g_ent).sum()
        grads = torch.autograd.grad(total, leaves)
        return (logp, ent), grads

    out, grads = fwd_bwd()
    errors = _errors(out, grads, ref)
    del out, grads
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
    t_fwd = _bench(fwd)
    t_fb = _bench(lambda: fwd_bwd())
    return {"provider": name, "fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "peak_gib": peak, **errors}


def _gemms(x) -> Dict:
    h, w = x.hidden, x.weight
    g = torch.randn(h.shape[0], w.shape[0], device="cuda", dtype=torch.bfloat16)
    t1 = _bench(lambda: h @ w.T)
    t3 = _bench(lambda: (h @ w.T, g @ w, g.T @ h))
    del g
    return {"provider": "bf16-gemms (one / three)", "fwd_ms": t1, "fwd_bwd_ms": t3}


def _providers(x, chunks=()):
    from ratiokl.torch import loss

    hb, wb = x.hidden.requires_grad_(), x.weight.requires_grad_()
    w32 = x.w32.requires_grad_()

    def ratiokl(w, **kw):
        return lambda: loss.linear_selected_logprobs(hb, w, x.ids, x.mask, return_entropy=True,
                                                     **kw)

    yield "ratiokl (default: fp32 logits)", ratiokl(wb), (hb, wb), "bf16"
    yield "ratiokl logits_dtype='input' (bf16 head)", ratiokl(wb, logits_dtype="input"), \
        (hb, wb), "bf16"
    yield "ratiokl logits_dtype='input', chunk_rows=2048 (the former default)", \
        ratiokl(wb, logits_dtype="input", chunk_rows=2048), (hb, wb), "bf16"
    for rows in chunks:
        yield f"ratiokl chunk_rows={rows}", ratiokl(wb, chunk_rows=rows), (hb, wb), "bf16"
    yield "ratiokl fp32 weight (bf16x3)", ratiokl(w32), (hb, w32), "fp32"
    yield "ratiokl fp32 weight, fp32_matmul='ieee'", ratiokl(w32, fp32_matmul="ieee"), \
        (hb, w32), "fp32"
    try:
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer import utils as trl_utils

        chunk = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE

        def trl(h, w):
            return lambda: tuple(ChunkedLogProbFunction.apply(
                h, w, None, x.ids, 1.0, chunk, None, 1.0, ("entropy",))[:2])

        yield "TRL ChunkedLogProbFunction (bf16)", trl(hb, wb), (hb, wb), "bf16"
        h32 = x.hidden.detach().float().requires_grad_()
        yield "TRL cast_lm_head_to_fp32 (fp32 hidden, fp32 weight)", trl(h32, w32), \
            (h32, w32), "fp32"
    except Exception as e:  # noqa: BLE001
        print("TRL skipped:", type(e).__name__, e)
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce

        yield "verl linear_cross_entropy", \
            lambda: tuple(verl_lce(hb, wb, x.ids, 1.0, "none")), (hb, wb), "bf16"
    except Exception as e:  # noqa: BLE001
        print("verl skipped:", type(e).__name__, e)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce_lce

        yield "cut-cross-entropy (NLL; no entropy)", \
            lambda: (-cce_lce(hb, wb, x.ids, reduction="none"), None), (hb, wb), "bf16-logp"
    except Exception as e:  # noqa: BLE001
        print("CCE skipped:", type(e).__name__, e)


def _jax(x, ref) -> Optional[Dict]:
    try:
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import loss as jloss
    except Exception as e:  # noqa: BLE001
        print("JAX skipped:", e)
        return None
    h = jnp.asarray(x.hidden.detach().float().cpu().numpy()).astype(jnp.bfloat16)
    w = jnp.asarray(x.weight.detach().float().cpu().numpy()).astype(jnp.bfloat16)
    ids = jnp.asarray(x.ids.cpu().numpy())
    mask = jnp.ones(ids.shape, bool)
    gl, ge = jnp.asarray(x.g_logp.cpu().numpy()), jnp.asarray(x.g_ent.cpu().numpy())
    fwd = jax.jit(lambda h, w: jloss.linear_selected_logprobs(h, w, ids, mask,
                                                              return_entropy=True))

    def obj(h, w):
        lp, e = jloss.linear_selected_logprobs(h, w, ids, mask, return_entropy=True)
        return jnp.sum(lp * gl) + jnp.sum(e * ge), (lp, e)

    fb = jax.jit(jax.value_and_grad(obj, argnums=(0, 1), has_aux=True))
    (_, out), grads = fb(h, w)
    to_t = lambda a: torch.from_dlpack(a.astype(jnp.float32))  # noqa: E731
    errors = _errors(tuple(map(to_t, out)), tuple(map(to_t, grads)), ref)

    def wall(f):
        jax.block_until_ready(f(h, w))
        reps, start = 20, time.perf_counter()
        for _ in range(reps):
            r = f(h, w)
        jax.block_until_ready(r)
        return (time.perf_counter() - start) / reps * 1e3

    return {"provider": "ratiokl JAX (jit, default)", "fwd_ms": wall(fwd),
            "fwd_bwd_ms": wall(fb), **errors}


def _policy_loss(x, chunks=()) -> Dict:
    """``linear_policy_loss`` (defaults, fp32 logits) against the three bf16 GEMMs."""
    from ratiokl.torch import loss

    h, w = x.hidden, x.weight
    n = h.shape[0]
    old = torch.randn(n, device="cuda") - 2.0
    adv = torch.randn(n, device="cuda")

    def step(**kw):
        value, _ = loss.linear_policy_loss(h.view(1, n, -1), w, x.ids.view(1, n),
                                           x.mask.view(1, n), old.view(1, n), adv.view(1, n),
                                           kl_coef=0.0, **kw)
        return torch.autograd.grad(value, (h, w))

    out = {}
    variants = [("linear_policy_loss (default)", {}),
                ("linear_policy_loss logits_dtype='input'", {"logits_dtype": "input"}),
                ("linear_policy_loss input, chunk_rows=2048",
                 {"logits_dtype": "input", "chunk_rows": 2048})]
    variants += [(f"linear_policy_loss chunk_rows={r}", {"chunk_rows": r}) for r in chunks]
    for name, kw in variants:
        step(**kw)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(**kw)
        torch.cuda.synchronize()
        out[name] = {"provider": name, "fwd_bwd_ms": _bench(lambda: step(**kw)),
                     "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2 ** 30}
    return out


def markdown(result: Dict) -> str:
    """The table docs/api.md shows ("The lm_head's precision"), from a result file."""
    records = result["records"]
    gemms = records[0]
    lines = ["| provider | fwd ms | fwd+bwd ms | peak GiB | max abs error: log-prob / "
             "entropy | rel. error: d hidden / d weight |", "|---|---|---|---|---|---|"]

    def num(value, fmt):
        return "–" if value is None else fmt % value

    for r in records:
        if "error" in r:
            continue
        fwd, fb = r.get("fwd_ms"), r.get("fwd_bwd_ms")
        lines.append(
            f"| {r['provider']} | {num(fwd, '%.2f')} | {num(fb, '%.2f')}"
            + (f" ({fb / gemms['fwd_bwd_ms']:.2f}x)" if fb and r is not gemms else "")
            + f" | {num(r.get('peak_gib'), '%.2f')} | "
            f"{num(r.get('logp_max_abs_err'), '%.1e')} / "
            f"{num(r.get('entropy_max_abs_err'), '%.1e')} | "
            f"{num(r.get('d_hidden_rel_err'), '%.1e')} / "
            f"{num(r.get('d_weight_rel_err'), '%.1e')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=151_936)
    ap.add_argument("--logit-std", type=float, default=8.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-jax", action="store_true")
    ap.add_argument("--chunks", default="", help="also time these chunk_rows, e.g. 512,1024")
    ap.add_argument("--markdown", metavar="RESULT_JSON",
                    help="print docs/api.md's table from a result file and exit")
    args = ap.parse_args()
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return
    x = _inputs(args.n, args.h, args.v, args.logit_std)
    refs = {"bf16": _reference(x.hidden, x.weight, x), "fp32": _reference(x.hidden, x.w32, x)}
    # A provider without the entropy: its gradients are the log-prob's alone.
    g_ent, x.g_ent = x.g_ent, torch.zeros_like(x.g_ent)
    refs["bf16-logp"] = _reference(x.hidden, x.weight, x)
    x.g_ent = g_ent
    logits = torch.cat([(x.hidden[i:i + 1024].float() @ x.weight.float().T).flatten()[:10 ** 6]
                        for i in range(0, args.n, 1024)])
    records = [_gemms(x)]
    chunks = [int(c) for c in args.chunks.split(",") if c]
    for name, fn, leaves, ref in _providers(x, chunks):
        try:
            records.append({**_torch_provider(name, fn, leaves, x, refs[ref], {}),
                            "reference": ref})
        except Exception as e:  # noqa: BLE001
            records.append({"provider": name, "error": f"{type(e).__name__}: {e}"[:300]})
        torch.cuda.empty_cache()
        print(json.dumps(records[-1]), flush=True)
    records += list(_policy_loss(x, chunks).values())
    if not args.skip_jax:
        jx = _jax(x, refs["bf16"])
        if jx:
            records.append(jx)
    meta = {"n": args.n, "h": args.h, "v": args.v, "logit_std": float(logits.std()),
            "logit_max_abs": float(logits.abs().max()), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "timing": "user: do_bench defaults (JAX: wall loop)"}
    result = {"meta": meta, "records": records}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    gemm3 = records[0]["fwd_bwd_ms"]
    gemm1 = records[0]["fwd_ms"]
    print(f"\n{meta}")
    print(f"{'provider':52s} {'fwd':>7s} {'x1':>5s} {'fwd+bwd':>8s} {'x3':>5s} {'GiB':>5s} "
          f"{'logp err':>9s} {'ent err':>9s} {'dh rel':>8s} {'dW rel':>8s}")
    for r in records:
        f = lambda k, fmt: (fmt % r[k]) if r.get(k) is not None else "-"  # noqa: E731
        fwd, fb = r.get("fwd_ms"), r.get("fwd_bwd_ms")
        print(f"{r['provider'][:52]:52s} {f('fwd_ms', '%7.2f'):>7s} "
              f"{'%5.2f' % (fwd / gemm1) if fwd else '-':>5s} {f('fwd_bwd_ms', '%8.2f'):>8s} "
              f"{'%5.2f' % (fb / gemm3) if fb else '-':>5s} {f('peak_gib', '%5.2f'):>5s} "
              f"{f('logp_max_abs_err', '%9.2e'):>9s} {f('entropy_max_abs_err', '%9.2e'):>9s} "
              f"{f('d_hidden_rel_err', '%8.1e'):>8s} {f('d_weight_rel_err', '%8.1e'):>8s}"
              + (f"  {r['error']}" if "error" in r else ""))


if __name__ == "__main__":
    main()
