"""``d weight``'s error with and without the float32 accumulator (``grad_weight_accum``),
against float64, with the GPU's rules run on the CPU.

The linear ops sum ``d weight [V, H]`` over row chunks. With a bf16 weight and
``grad_weight_accum="weight"`` each chunk's GEMM adds its share to a bf16 running sum (one
rounding per chunk: cuBLAS's ``addmm`` epilogue, and a bf16 ``addmm_`` on the CPU, round
once per call); ``"float32"`` sums in float32 and rounds once at the end. This script runs
the ops' own chunk steps (``ratiokl.torch._lm_head``: ``head_operands(..., gpu=True)``,
``chunk_logits``, ``chunk_grads``) on the CPU with the GPU's dtypes (float32 logits, the
logits' gradient in bf16 into bf16 GEMMs) at a scaled-down head, and reports per ``N`` and
mode the relative max and RMS error of ``d weight`` (rounded to bf16, as returned) against
the float64 gradient of the same bf16 values, beside the floor (the float64 gradient rounded
to bf16 once) and the accumulator's bytes here and at the full head::

    PYTHONPATH=src python benchmarks/grad_weight_accum.py \\
        --out benchmarks/results/cpu_grad_weight_accum.json

The inputs are ``lm_head_precision.py``'s, scaled down: bf16 hidden states ``N(0, 1)``, a
bf16 weight whose logits have std ``--logit-std``, half the targets each row's argmax, the
log-probs' upstream gradient ``N(0, 1)`` per row. ``--chunk-rows 1152`` (the default chunk at
V = 151,936) gives 57 chunks at N = 65,536. About a minute on one CPU core.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import metadata  # noqa: E402

from ratiokl import spec  # noqa: E402
from ratiokl.torch._lm_head import chunk_grads, chunk_logits, head_operands  # noqa: E402

MODES = ("float32", "weight")
#: The head the issue sizes the accumulator at (Qwen2.5-7B's lm_head).
FULL_V, FULL_H = 151_936, 4_096


def _inputs(n: int, h: int, v: int, std: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * (std / h ** 0.5)).bfloat16()
    argmax = torch.cat([(hidden[s:s + 4096].float() @ weight.float().T).argmax(-1)
                        for s in range(0, n, 4096)])
    ids = torch.where(torch.rand(n, generator=g) < 0.5, argmax,
                      torch.randint(0, v, (n,), generator=g))
    return hidden, weight, ids, torch.randn(n, generator=g)


def _logp_grad(x: torch.Tensor, ids: torch.Tensor, g_logp: torch.Tensor) -> torch.Tensor:
    """``d (g_logp . logp) / d x = g_logp (onehot(ids) - softmax(x))`` in ``x``'s dtype."""
    dx = -torch.softmax(x, dim=-1)
    dx[torch.arange(x.shape[0]), ids] += 1.0
    return dx * g_logp[:, None].to(x.dtype)


def _errors(got: torch.Tensor, exact: torch.Tensor) -> Dict[str, float]:
    diff = got.double() - exact
    return {"rel_max_error": float(diff.abs().max() / exact.abs().max()),
            "rel_rms_error": float(diff.norm() / exact.norm())}


def measure(n: int, h: int, v: int, chunk: int, std: float) -> List[Dict]:
    """One record per mode (and the floor) at ``N = n``."""
    hidden, weight, ids, g_logp = _inputs(n, h, v, std)
    heads = {m: head_operands(torch.bfloat16, weight,
                              spec.logit_transform(grad_weight_accum=m), gpu=True)
             for m in MODES}
    grads = {m: torch.empty(v, h, dtype=heads[m].accumulate) for m in MODES}
    exact = torch.zeros(v, h, dtype=torch.float64)
    buffer = torch.empty(chunk, v)
    plain = spec.logit_transform()  # no scale, no softcap
    chunks = 0
    for start in range(0, n, chunk):
        part = slice(start, min(start + chunk, n))
        rows = hidden[part]
        x = chunk_logits(rows, heads["float32"], None, plain, buffer[:rows.shape[0]])
        du = _logp_grad(x, ids[part], g_logp[part])  # to bf16 in chunk_grads (GPU rule)
        for m in MODES:
            chunk_grads(du, rows, heads[m], plain, None, grads[m], start == 0, None)
        h64 = rows.double()
        exact += _logp_grad(h64 @ weight.double().T, ids[part], g_logp[part]).T @ h64
        chunks += 1
    base = {"N": n, "H": h, "V": v, "chunk_rows": chunk, "chunks": chunks}
    out = [dict(base, mode="floor (float64 rounded once to bf16)",
                **_errors(exact.bfloat16(), exact), accumulator_bytes=None)]
    for m in MODES:
        out.append(dict(base, mode=m, accumulator=str(heads[m].accumulate),
                        **_errors(grads[m].bfloat16(), exact),
                        accumulator_bytes=v * h * heads[m].accumulate.itemsize))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", default="8192,65536", help="row counts, comma-separated")
    parser.add_argument("--h", type=int, default=256)
    parser.add_argument("--v", type=int, default=2048)
    parser.add_argument("--chunk-rows", type=int, default=1152)
    parser.add_argument("--logit-std", type=float, default=8.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = []
    for n in map(int, args.n.split(",")):
        records += measure(n, args.h, args.v, args.chunk_rows, args.logit_std)
        for r in records[-3:]:
            print(f"N={r['N']:>6} chunks={r['chunks']:>3} {r['mode']:<38} "
                  f"rel max {r['rel_max_error']:.2e}  rel rms {r['rel_rms_error']:.2e}")
    full = FULL_V * FULL_H
    result = {
        "meta": dict(metadata(), emulation="GPU rules (head_operands(gpu=True)) on the CPU; "
                     "no GPU was used"),
        "config": vars(args) | {"out": str(args.out)},
        "records": records,
        "memory_full_head": {
            "V": FULL_V, "H": FULL_H,
            "float32_accumulator_bytes": full * 4, "weight_accumulator_bytes": full * 2,
            # "float32": the float32 sum, then the bf16 copy beside it at the end
            "extra_peak_bytes_float32_over_weight": full * 4,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
