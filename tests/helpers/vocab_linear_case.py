"""Inputs and float64 expectations of the linear ops on a vocabulary-sharded lm_head.

Used by the PyTorch (gloo ranks) and JAX (host devices) vocabulary-parallel workers, which
run the sharded op, the unsharded op and compare both with what :func:`expected` gives
(the float64 spec, ``ratiokl.spec.linear_*``) within the spec's linear tolerances.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from ratiokl import spec
from ratiokl.harness import round_to_dtype

#: The head's options every case passes (TRL's order: scale, softcap, temperature).
OPTIONS = dict(logit_scale=0.8, logit_softcap=6.0, chunk_rows=4)


def shard_bounds(vocab: int, world: int) -> List[Tuple[int, int]]:
    """Contiguous ``[start, stop)`` per rank; the first ``vocab % world`` blocks one wider."""
    sizes = [vocab // world + (r < vocab % world) for r in range(world)]
    starts = np.cumsum([0] + sizes)
    return [(int(starts[r]), int(starts[r + 1])) for r in range(world)]


def make_case(seed: int, lead: Tuple[int, ...], width: int, vocab: int, world: int,
              dtype: str) -> Dict[str, np.ndarray]:
    """Global inputs, exact in ``dtype``: the hidden states NaN / inf on inactive rows (and
    their ids out of range), a ``-inf`` bias entry masking one token, active ids on every
    block's first and last row, a per-row temperature (0 on inactive rows, as padding may
    carry), upstream values for ``logp`` and the entropy, and the policy loss's inputs."""
    rng = np.random.default_rng(seed)
    mask = rng.random(lead) < 0.75
    mask.reshape(-1)[:2] = True
    hidden = round_to_dtype(rng.normal(0.0, 1.0, lead + (width,)), dtype).astype(np.float64)
    hidden[~mask] = np.nan
    hidden[~mask, 0] = np.inf
    weight = round_to_dtype(rng.normal(0.0, 0.6, (vocab, width)), dtype).astype(np.float64)
    bias = round_to_dtype(rng.normal(0.0, 0.5, vocab), dtype).astype(np.float64)
    bias[vocab // 2] = -np.inf
    n = int(np.prod(lead))
    ids = rng.integers(0, vocab, n)
    edges = sorted({e for b in shard_bounds(vocab, world) for e in (b[0], b[1] - 1)})
    edges = [e for e in edges if e != vocab // 2]
    ids[: min(n, len(edges))] = edges[: min(n, len(edges))]
    ids = np.where(mask.reshape(-1), ids, vocab + 3).reshape(lead)
    ids = np.where(mask & (ids == vocab // 2), 0, ids)
    return {
        "hidden": hidden, "weight": weight, "bias": bias, "ids": ids, "mask": mask,
        "temperature": np.where(mask, rng.uniform(0.6, 1.6, lead), 0.0),
        "g_logp": rng.normal(size=lead), "g_ent": rng.normal(size=lead),
        "old": np.where(mask, rng.normal(-3.0, 1.0, lead), np.nan),
        "adv": rng.normal(size=lead), "ref_logps": rng.normal(-3.0, 1.0, lead),
    }


def expected(case: Dict[str, np.ndarray], dtype: str, entropy: bool):
    """float64 ``({logp[, entropy]}, (d hidden, d weight, d bias))`` of ``sum(g_logp logp +
    g_ent entropy)`` and their tolerances ``({name: Tolerance})``."""
    args = (case["hidden"], case["weight"], case["ids"], case["mask"])
    kw = dict(bias=case["bias"], temperature=case["temperature"],
              logit_scale=OPTIONS["logit_scale"], logit_softcap=OPTIONS["logit_softcap"])
    out = spec.linear_selected_logprobs(*args, return_entropy=entropy, **kw)
    outputs = {"logp": out[0], "entropy": out[1]} if entropy else {"logp": out}
    g_ent = case["g_ent"] if entropy else None
    grads = spec.linear_selected_logprobs_grad(*args, case["g_logp"], g_ent, **kw)
    logits = spec.linear_logits(np.where(case["mask"][..., None], case["hidden"], 0.0),
                                case["weight"], case["bias"], logit_scale=kw["logit_scale"],
                                logit_softcap=kw["logit_softcap"])
    temp = np.where(case["mask"], case["temperature"], 1.0)[..., None]
    z = np.abs(logits / temp)[case["mask"]]
    scale = float(z[np.isfinite(z)].max())
    vocab = case["weight"].shape[0]
    tols = {"logp": spec.linear_forward_tolerance(dtype, scale, vocab),
            "entropy": spec.linear_forward_tolerance(dtype, scale, vocab, entropy=True)}
    magnitudes = spec.linear_grad_magnitudes(*args, case["g_logp"], g_ent, **kw)
    for name, magnitude in zip(("hidden", "weight", "bias"), magnitudes):
        tols[name] = spec.linear_grad_tolerance(dtype, scale, magnitude)
    return outputs, grads, tols
