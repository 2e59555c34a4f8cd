"""``selected_logprobs(..., return_entropy=True)`` conformance cases: the entropy families.

Called by ``conformance/generate.py`` (the only writer of fixtures). Each case
has a cotangent on both outputs (``logp`` and ``entropy``), so the gradient
checks both terms; inactive rows are poisoned (NaN / inf logits, bad ids) unless
the name says otherwise.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, Iterator, Tuple

import numpy as np

from ratiokl.conformance import LOGIT_DTYPES, Case, build_case

SEED = 20261201
SUFFIX = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
OP = "selected_logprobs_entropy"

Inputs = Dict[str, Any]


def _rows(rng, lead, vocab, *, scale=2.0, active=0.7) -> Inputs:
    mask = rng.random(lead) < active
    return {
        "logits": rng.normal(0.0, scale, (*lead, vocab)),
        "action_ids": rng.integers(0, vocab, lead),
        "mask": mask,
    }


def _poison(rng, x: Inputs) -> Inputs:
    """Inactive rows: cycling NaN / +inf / -inf logits and ids outside ``[0, V)``."""
    vocab = x["logits"].shape[-1]
    fills, bad_ids = (np.nan, np.inf, -np.inf), (-1, vocab, -100, vocab + 7)
    for n, row in enumerate(map(tuple, np.argwhere(~x["mask"]))):
        x["logits"][row] = fills[n % 3]
        x["action_ids"][row] = bad_ids[n % 4]
    return x


def _flat(rng, dt):
    """Equal and nearly equal logits: the entropy is ``log V`` (the largest it can be)."""
    x = _rows(rng, (6,), 256, active=1.0)
    x["logits"][:3] = 7.0
    x["logits"][3:] = 7.0 + rng.normal(0.0, 1e-3, (3, 256))
    return x


def _peaked(rng, dt):
    """One logit 30 above the rest: the entropy is ~1e-11, the action sampled or not."""
    x = _rows(rng, (8,), 64, scale=1.0, active=1.0)
    peak = rng.integers(0, 64, 8)
    peak[:4] = x["action_ids"][:4]
    np.put_along_axis(x["logits"], peak[:, None], 30.0, axis=-1)
    return x


def _masked_vocab(rng, dt):
    """``-inf`` at half the tokens of active rows; one row allows only the action (H = 0)."""
    x = _rows(rng, (3, 4), 64, active=0.75)
    drop = rng.random(x["logits"].shape) < 0.5
    np.put_along_axis(drop, x["action_ids"][..., None], False, axis=-1)
    drop[0, 0] = True
    drop[0, 0, x["action_ids"][0, 0]] = False
    x["mask"][0, 0] = True
    x["logits"][drop] = -np.inf
    return _poison(rng, x)


def _temperature_rows(rng, dt):
    x = _poison(rng, _rows(rng, (3, 4), 48))
    temp = rng.uniform(0.3, 2.0, (3, 4)).astype(np.float32)
    x["temperature"] = np.where(x["mask"], temp, 0.0)  # padding may carry temperature 0
    return x


def _inactive(rng, dt):
    return _poison(rng, _rows(rng, (5, 4), 40, active=0.5))


def _vocab_20011(rng, dt):
    """Several kernel tiles, spans and a ragged tail; one inactive row."""
    x = _rows(rng, (3,), 20011, active=1.0)
    x["mask"][1] = False
    return _poison(rng, x)


#: group -> (dtypes, builder(rng, dtype) -> inputs, description).
GROUPS: Dict[str, Tuple[Tuple[str, ...], Callable[..., Inputs], str]] = {
    "entropy_flat": (LOGIT_DTYPES, _flat, "(nearly) equal logits: entropy log V"),
    "entropy_peaked": (LOGIT_DTYPES, _peaked, "one logit 30 above the rest: entropy ~ 0"),
    "entropy_masked_vocab": (LOGIT_DTYPES, _masked_vocab,
                             "-inf logits contribute 0, finite gradient; a one-token row"),
    "entropy_temperature_per_row": (LOGIT_DTYPES, _temperature_rows, "per-row temperature"),
    "entropy_inactive_rows": (LOGIT_DTYPES, _inactive,
                              "inactive rows: NaN/inf logits, bad ids: entropy 0, zero grad"),
    "entropy_vocab_20011": (("float32",), _vocab_20011, "several tiles, ragged tail"),
}


def build_cases() -> Iterator[Case]:
    """Every entropy case, in a fixed order."""
    for group, (dtypes, builder, description) in GROUPS.items():
        for dtype in dtypes:
            rng = np.random.default_rng([SEED, zlib.crc32(group.encode())])
            inputs = builder(rng, dtype)
            lead = inputs["mask"].shape
            cot = {"logp": rng.normal(0.0, 1.0, lead), "entropy": rng.normal(0.0, 1.0, lead)}
            yield build_case(f"{group}_{SUFFIX[dtype]}", group, OP, dtype, inputs, options={},
                             cotangents=cot, description=description)
