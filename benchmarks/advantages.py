"""The advantage estimators beside verl's own: GAE and GRPO, user timing, one run.

Usage (from the repository root, ratiokl importable)::

    PYTHONPATH=src python benchmarks/advantages.py --preset gpu --out benchmarks/results/h200_advantages.json
    PYTHONPATH=src python benchmarks/advantages.py --preset cpu --out /tmp/advantages.json

Cases: ``gae`` (float32 ``rewards``, ``values`` and a ``mask`` ``[B, T]`` with ragged
response lengths, ``gamma=0.99, lam=0.95``; gpu: B = 512, T = 8,192) and ``grpo`` (one
score per sequence, groups of 8 under shuffled integer ids; gpu: B = 4,096). Providers:
``ratiokl-torch-<backend>`` (``ratiokl.torch.advantages``), ``ratiokl-jax-native`` (under
``jax.jit``), ``verl`` (``core_algos.compute_gae_advantage_return`` /
``compute_grpo_outcome_advantage`` on the same inputs as token-level tensors and uid
strings; ``skipped`` with the reason where verl is not importable), and for GAE
``copy-floor``: reading ``rewards``, ``values`` and ``mask`` and writing two ``[B, T]``
float32 outputs once (one fused elementwise op: the target is GAE <= 2x it).

Timing: ``triton.testing.do_bench`` on CUDA (user timing, ``_harness.user_ms``), the
median wall-clock of synchronised calls on a CPU (``_harness.cpu_ms``). Output: JSON with
``meta`` (``_harness.metadata``: the machine and versions) and long-format ``records``
(``case, provider, B, T, ms, status, reason``), and a CSV of the records beside it.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import cpu_ms, metadata, user_ms  # noqa: E402

PRESETS = {"gpu": dict(gae=(512, 8192), grpo=4096), "cpu": dict(gae=(64, 1024), grpo=4096)}
GROUP = 8
FIELDS = ("case", "provider", "B", "T", "ms", "status", "reason")


def _time(call: Callable[[], Any]) -> float:
    if torch.cuda.is_available():
        return user_ms(call)
    return cpu_ms(call, lambda _: None, reps=5, warmup_ms=1.0)


def gae_inputs(rows: int, steps: int, device: str) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(steps // 4, steps + 1, (rows, 1), generator=gen)
    return dict(rewards=torch.randn(rows, steps, generator=gen).to(device),
                values=torch.randn(rows, steps, generator=gen).to(device),
                mask=(torch.arange(steps)[None] < lengths).to(device))


def grpo_inputs(rows: int, device: str) -> Dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(rows, generator=gen) // GROUP
    return dict(scores=torch.randint(0, 2, (rows,), generator=gen).float().to(device),
                ids=ids.to(device), uids=np.array([f"uid-{i}" for i in ids.tolist()],
                                                   dtype=object))


def _verl():
    try:
        from verl.trainer.ppo import core_algos
    except Exception as err:  # any import failure: the record says which
        return None, f"verl is not importable ({type(err).__name__}: {err})"
    return core_algos, ""


def gae_providers(x: Dict[str, torch.Tensor]) -> Dict[str, Callable[[], Any]]:
    from ratiokl.torch import advantages

    r, v, m = x["rewards"], x["values"], x["mask"]
    calls: Dict[str, Callable[[], Any]] = {
        f"ratiokl-torch-{b}": (lambda b=b: advantages.gae(r, v, m, 0.99, 0.95, backend=b))
        for b in (("triton", "native") if r.is_cuda else ("native",))}
    calls["copy-floor"] = lambda: (torch.where(m, r - v, 0.0), torch.where(m, r + v, 0.0))
    jax_call = _jax_gae(r, v, m)
    if jax_call is not None:
        calls["ratiokl-jax-native"] = jax_call
    core, why = _verl()
    mf = m.float()
    calls["verl"] = (lambda: core.compute_gae_advantage_return(r, v, mf, 0.99, 0.95)) \
        if core else why
    return calls


def grpo_providers(x: Dict[str, Any]) -> Dict[str, Callable[[], Any]]:
    from ratiokl.torch import advantages

    scores, ids = x["scores"], x["ids"]
    calls: Dict[str, Callable[[], Any]] = {
        "ratiokl-torch": lambda: advantages.grpo(scores, ids)}
    core, why = _verl()
    token = scores[:, None]
    mask = torch.ones_like(token)
    calls["verl"] = (lambda: core.compute_grpo_outcome_advantage(token, mask, x["uids"])) \
        if core else why
    return calls


def _jax_gae(r, v, m):
    try:
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import advantages
    except ImportError:
        return None
    args = [jnp.asarray(t.cpu().numpy()) for t in (r, v, m)]
    run = jax.jit(lambda a, b, c: advantages.gae(a, b, c, 0.99, 0.95))
    return lambda: jax.block_until_ready(run(*args))


def measure(case: str, rows: int, steps: int, calls: Dict[str, Any]) -> List[Dict[str, Any]]:
    records = []
    for provider, call in calls.items():
        record = dict(case=case, provider=provider, B=rows, T=steps, ms=None, status="ok",
                      reason="")
        if isinstance(call, str):
            record.update(status="skipped", reason=call)
        else:
            record["ms"] = _time(call)
        records.append(record)
        print(f"{case:5s} {provider:22s} B={rows} T={steps}: "
              f"{record['ms'] if record['ms'] is not None else record['reason']}")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    sizes = PRESETS[args.preset]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, steps = sizes["gae"]
    records = measure("gae", rows, steps, gae_providers(gae_inputs(rows, steps, device)))
    records += measure("grpo", sizes["grpo"], 1,
                       grpo_providers(grpo_inputs(sizes["grpo"], device)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=metadata(), preset=args.preset,
                                        records=records), indent=1))
    with args.out.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(records)
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
