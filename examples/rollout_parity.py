"""How the lm_head's precision moves the trainer/sampler parity fractions (CPU, seconds).

A tiny random head (bf16 hidden states and weight, logits of std about 4) stands in for a
policy's last layer. A sampler draws one token per row from its own head and reports its
log-probs (``rollout_logps``); the trainer then calls ``linear_policy_loss`` on the same
hidden states with ``rollout_logps`` and reads ``rollout_logp_off_1pct_fraction`` and
``rollout_logp_off_5pct_fraction``: the fraction of tokens whose ``exp(logp -
rollout_logp)`` lies outside ``[0.99, 1.01]`` / ``[0.95, 1.05]``. Three pairings:

* trainer bf16 head (``logits_dtype="input"``) against a sampler with an fp32 head;
* trainer fp32 head (``logits_dtype="float32"``, the default) against the fp32 sampler;
* trainer fp32 head against a sampler with a bf16 head.

The sampler's logits are the exact products of the bf16 values summed in float64, then
rounded to its head's dtype (float32 or bfloat16); its log-softmax runs in float64.

    python examples/rollout_parity.py            # prints the table docs/policy_loss.md shows
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np
import torch

from ratiokl.torch import loss

#: Tokens, hidden size and vocabulary of the tiny head; the seed of every draw.
ROWS, HIDDEN, VOCAB, SEED = 1024, 64, 2048, 0
#: The pairings: (label, the trainer's ``logits_dtype``, the sampler head's dtype).
PAIRINGS: Tuple[Tuple[str, str, torch.dtype], ...] = (
    ("trainer bf16 head vs sampler fp32 head", "input", torch.float32),
    ("trainer fp32 head vs sampler fp32 head", "float32", torch.float32),
    ("trainer fp32 head vs sampler bf16 head", "float32", torch.bfloat16),
)
NAMES = ("rollout_logp_off_1pct_fraction", "rollout_logp_off_5pct_fraction")


def _head() -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 hidden states ``[ROWS, HIDDEN]`` and weight ``[VOCAB, HIDDEN]``, logits std ~4."""
    gen = torch.Generator().manual_seed(SEED)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * (4.0 / HIDDEN ** 0.5)).to(
        torch.bfloat16)
    return hidden, weight


def _sampler(hidden: torch.Tensor, weight: torch.Tensor, head: torch.dtype,
             gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(ids, rollout_logps)``: one token per row drawn from the sampler's head, and its
    log-prob there (float32)."""
    logits = (hidden.double() @ weight.double().T).to(head).double()
    logp = torch.log_softmax(logits, dim=-1)
    ids = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0]
    return ids, logp.gather(-1, ids[:, None])[:, 0].float()


def fractions() -> List[Tuple[str, Dict[str, float]]]:
    """Each pairing's label and its two parity fractions, on-policy (``old_logps`` = the
    trainer's own log-probs, as on the first step after a rollout)."""
    hidden, weight = _head()
    mask = torch.ones(ROWS, dtype=torch.bool)
    advantages = torch.zeros(ROWS)
    rows = []
    for label, logits_dtype, head in PAIRINGS:
        ids, rollout = _sampler(hidden, weight, head, torch.Generator().manual_seed(SEED + 1))
        old = loss.linear_selected_logprobs(hidden, weight, ids, mask, backend="native",
                                            logits_dtype=logits_dtype)
        _, metrics = loss.linear_policy_loss(hidden, weight, ids, mask, old, advantages,
                                             rollout_logps=rollout, backend="native",
                                             logits_dtype=logits_dtype)
        rows.append((label, {name: float(metrics[name]) for name in NAMES}))
    return rows


def markdown(rows: List[Tuple[str, Dict[str, float]]]) -> str:
    """The table docs/policy_loss.md shows."""
    lines = ["| pairing | tokens off by > 1 % | tokens off by > 5 % |", "|---|---|---|"]
    for label, values in rows:
        lines.append(f"| {label} | {100 * values[NAMES[0]]:.1f} % | "
                     f"{100 * values[NAMES[1]]:.1f} % |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(fractions()))
