"""The only writer of ratiokl's conformance fixtures.

    PYTHONPATH=src python conformance/generate.py            # rewrite conformance/
    PYTHONPATH=src python conformance/generate.py --out DIR  # write elsewhere

Inputs come from NumPy generators seeded per case group (so a group's fp32,
fp16 and bf16 cases share their inputs, rounded per dtype); expectations
come from the float64 spec ``ratiokl.spec``. See ``conformance/README.md``.
"""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import numpy as np

from ratiokl import spec
from ratiokl.conformance import LOGIT_DTYPES, OPS, Case, build_case, round_to_dtype, write_fixtures

import entropy_cases  # noqa: E402 - conformance/ is the script's directory (entropy cases)
import loss_cases  # noqa: E402 - conformance/ is the script's directory (policy_loss cases)
import rollout_cases  # noqa: E402 - conformance/ is the script's directory (rollout correction)

SEED = 20261130
DTYPE_SUFFIX = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
BAD_IDS = (-1, -100, 2**31 - 1)  # plus V and V + 7, which depend on the case

Inputs = Dict[str, Any]


def _rng(group: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(group.encode())])


def _mask(rng: np.random.Generator, lead: Tuple[int, ...], active: float = 0.7) -> np.ndarray:
    return rng.random(lead) < active


def _old_logps(rng, logits, ids, mask, dtype, temperature=1.0) -> np.ndarray:
    """Behaviour log-probs near the policy's (ratio ~ exp(N(0, 0.3))) on active rows."""
    logp = spec.selected_logprobs(round_to_dtype(logits, dtype), ids, mask, temperature=temperature)
    noise = rng.normal(0.0, 0.3, mask.shape)
    return np.where(np.isfinite(logp) & mask, logp + noise, rng.normal(-2.0, 1.0, mask.shape))


def _ratio_kl(rng, dtype, lead, vocab, *, scale=2.0, active=0.7, ref_noise=0.5, temperature=1.0) -> Inputs:
    """Random ``ratio_kl`` inputs with ``ref_logits`` near the policy's."""
    policy = rng.normal(0.0, scale, (*lead, vocab))
    ids = rng.integers(0, vocab, lead)
    mask = _mask(rng, lead, active)
    return {
        "policy_logits": policy,
        "ref_logits": policy + rng.normal(0.0, ref_noise, policy.shape),
        "action_ids": ids,
        "mask": mask,
        "old_logps": _old_logps(rng, policy, ids, mask, dtype, temperature),
    }


def _selected(rng, lead, vocab, *, scale=2.0, active=0.7) -> Inputs:
    return {
        "logits": rng.normal(0.0, scale, (*lead, vocab)),
        "action_ids": rng.integers(0, vocab, lead),
        "mask": _mask(rng, lead, active),
    }


def _poison_inactive(rng, x: Inputs, logit_keys: Tuple[str, ...], fills: Tuple[float, ...]) -> Inputs:
    """Fill inactive rows with adversarial values: cycling ``fills`` logits, bad ids, NaN old."""
    inactive = np.argwhere(~x["mask"])
    vocab = x[logit_keys[0]].shape[-1]
    bad_ids = BAD_IDS + (vocab, vocab + 7)
    for n, row in enumerate(map(tuple, inactive)):
        for key in logit_keys:
            x[key][row] = fills[n % len(fills)]
        x["action_ids"][row] = bad_ids[n % len(bad_ids)]
        for key in ("old_logps", "ref_logps"):
            if key in x:
                x[key][row] = np.nan
    return x


def _mixed_fill(vocab: int, rng) -> np.ndarray:
    return rng.choice([np.nan, np.inf, -np.inf, 1e30], size=vocab)


# ---- case groups: name -> (op, dtypes, builder(rng, dtype) -> (inputs, options), description)

Builder = Callable[[np.random.Generator, str], Tuple[Inputs, Dict[str, Any]]]
ALL = LOGIT_DTYPES


def _lead(lead):
    return lambda rng, dt: (_ratio_kl(rng, dt, lead, 48), {})


def _inactive(fills):
    def build(rng, dt):
        x = _ratio_kl(rng, dt, (4, 4), 64, active=0.5)
        return _poison_inactive(rng, x, ("policy_logits", "ref_logits"), fills), {}
    return build


def _inactive_bad_ids(rng, dt):
    x = _ratio_kl(rng, dt, (3, 5), 32, active=0.5)
    return _poison_inactive(rng, x, ("policy_logits",), (0.5,)), {}


def _selected_inactive(rng, dt):
    x = _selected(rng, (5, 4), 40, active=0.5)
    rows = np.argwhere(~x["mask"])
    x = _poison_inactive(rng, x, ("logits",), (np.nan, np.inf, -np.inf))
    x["logits"][tuple(rows[-1])] = _mixed_fill(40, rng)
    return x, {}


def _masked_vocab(rng, dt):
    x = _ratio_kl(rng, dt, (3, 4), 64, active=0.8)
    drop = (rng.random(x["policy_logits"].shape) < 0.5)
    np.put_along_axis(drop, x["action_ids"][..., None], False, axis=-1)
    drop[0, 0] = True
    drop[0, 0, x["action_ids"][0, 0]] = False  # a row where only the action is allowed
    x["mask"][0, 0] = True
    for key in ("policy_logits", "ref_logits"):
        x[key][drop] = -np.inf
    x["old_logps"] = _old_logps(rng, x["policy_logits"], x["action_ids"], x["mask"], dt)
    return x, {}


def _active_nan(rng, dt):
    x = _ratio_kl(rng, dt, (3, 4), 48, active=0.7)
    x["mask"][1, 2] = True
    x["policy_logits"][1, 2, (x["action_ids"][1, 2] + 5) % 48] = np.nan
    return x, {}


def _bad_active_id(op):
    def build(rng, dt):
        x = _ratio_kl(rng, dt, (2, 3), 32) if op == "ratio_kl" else _selected(rng, (2, 3), 32)
        x["mask"][1, 1] = True
        x["action_ids"][1, 1] = 32
        return x, {}
    return build


def _empty(rng, dt):
    return _ratio_kl(rng, dt, (0,), 16), {}


def _selected_empty(rng, dt):
    return _selected(rng, (2, 0), 16), {}


def _all_inactive(rng, dt):
    x = _ratio_kl(rng, dt, (3, 4), 24, active=0.0)
    return _poison_inactive(rng, x, ("policy_logits", "ref_logits"), (np.nan, np.inf, -np.inf, 3.0)), {}


def _vocab(vocab, lead, op="ratio_kl"):
    def build(rng, dt):
        if op == "selected_logprobs":
            return _selected(rng, lead, vocab, active=1.0), {}
        x = _ratio_kl(rng, dt, lead, vocab)
        x["mask"][0], x["mask"][-1] = True, lead[0] == 1  # the first row active, the last not
        x["old_logps"] = _old_logps(rng, x["policy_logits"], x["action_ids"], x["mask"], dt)
        return _poison_inactive(rng, x, ("policy_logits", "ref_logits"), (np.nan,)), {}
    return build


def _extreme_magnitude(rng, dt):
    x = _ratio_kl(rng, dt, (6,), 64, active=1.0)
    offset = np.array([1e4, -1e4, 9e3, -9e3, 0.0, 0.0])[:, None]
    spread = np.where(offset != 0.0, 30.0, 1e4)  # offset rows, and rows uniform in +-1e4
    logits = offset + spread * rng.uniform(-1.0, 1.0, (6, 64))
    x["policy_logits"] = logits
    logp = spec.selected_logprobs(round_to_dtype(logits, dt), x["action_ids"], x["mask"])
    x["ref_logps"] = logp + rng.normal(0.0, 0.5, logp.shape)
    x["old_logps"] = logp + rng.normal(0.0, 0.3, logp.shape)
    del x["ref_logits"]
    return x, {}


def _extreme_peaked(rng, dt):
    x = _ratio_kl(rng, dt, (8,), 64, scale=1.0, ref_noise=0.2, active=1.0)
    peak = rng.integers(0, 64, 8)
    peak[:4] = x["action_ids"][:4]  # half the rows sample the peak, half do not
    for key in ("policy_logits", "ref_logits"):
        np.put_along_axis(x[key], peak[:, None], 50.0, axis=-1)
    x["old_logps"] = _old_logps(rng, x["policy_logits"], x["action_ids"], x["mask"], dt)
    return x, {}


def _extreme_flat(rng, dt):
    x = _ratio_kl(rng, dt, (6,), 256, active=1.0)
    x["policy_logits"][:3] = 7.0
    x["policy_logits"][3:] = 7.0 + rng.normal(0.0, 1e-3, (3, 256))
    x["ref_logits"] = x["policy_logits"] + rng.normal(0.0, 0.01, (6, 256))
    x["old_logps"] = _old_logps(rng, x["policy_logits"], x["action_ids"], x["mask"], dt)
    return x, {}


def _temperature_scalar(rng, dt):
    return _ratio_kl(rng, dt, (3, 4), 48, temperature=0.7), {"temperature": 0.7}


def _temperature_rows(op):
    def build(rng, dt):
        temp = rng.uniform(0.3, 2.0, (3, 4)).astype(np.float32)
        if op == "ratio_kl":
            x = _ratio_kl(rng, dt, (3, 4), 48, temperature=temp)
        else:
            x = _selected(rng, (3, 4), 48)
        x["temperature"] = np.where(x["mask"], temp, 0.0)  # padding may carry temperature 0
        return x, {}
    return build


def _bad_active_temperature(rng, dt):
    x = _ratio_kl(rng, dt, (3, 4), 48)
    x["mask"][1, 2] = True
    x["temperature"] = np.where(x["mask"], 1.0, -1.0).astype(np.float32)  # bad padding is fine
    x["temperature"][1, 2] = 0.0
    return x, {}


def _ref_logps(rng, dt):
    x = _ratio_kl(rng, dt, (4, 3), 48, active=0.6)
    ref = spec.selected_logprobs(round_to_dtype(x.pop("ref_logits"), dt), x["action_ids"], x["mask"])
    x["ref_logps"] = np.where(x["mask"], ref, np.nan)
    return x, {}


def _kl(estimator):
    return lambda rng, dt: (_ratio_kl(rng, dt, (4, 6), 64, ref_noise=1.0), {"kl_estimator": estimator})


def _no_mask(rng, dt):
    x = _selected(rng, (3, 5), 40)
    del x["mask"]
    return x, {}


GROUPS: Dict[str, Tuple[str, Tuple[str, ...], Builder, str]] = {
    "lead_shape_n": ("ratio_kl", ALL, _lead((13,)), "leading shape [N], mixed rows"),
    "lead_shape_bt": ("ratio_kl", ALL, _lead((3, 5)), "leading shape [B, T], mixed rows"),
    "lead_shape_btk": ("ratio_kl", ALL, _lead((2, 3, 2)), "leading shape [B, T, K], mixed rows"),
    "inactive_rows_nan_logits": ("ratio_kl", ALL, _inactive((np.nan,)), "inactive rows: NaN logits, NaN old, bad ids"),
    "inactive_rows_inf_logits": ("ratio_kl", ALL, _inactive((np.inf, -np.inf)), "inactive rows: +inf / -inf logits, bad ids"),
    "inactive_rows_bad_ids": ("ratio_kl", ALL, _inactive_bad_ids, "inactive rows: ids < 0 and >= V, NaN old"),
    "selected_logprobs_inactive_rows": ("selected_logprobs", ALL, _selected_inactive, "inactive rows: NaN/inf/mixed logits, bad ids"),
    "active_rows_masked_vocab": ("ratio_kl", ALL, _masked_vocab, "-inf at other tokens of active rows stays finite"),
    "active_row_nan_logit": ("ratio_kl", ALL, _active_nan, "a NaN logit in one active row: NaN for that row only"),
    "active_id_out_of_range": ("ratio_kl", ALL, _bad_active_id("ratio_kl"), "active id == V raises ValueError"),
    "selected_logprobs_active_id_out_of_range": ("selected_logprobs", ALL, _bad_active_id("selected_logprobs"), "active id == V raises ValueError"),
    "empty_rows": ("ratio_kl", ALL, _empty, "no rows at all"),
    "selected_logprobs_empty_rows": ("selected_logprobs", ALL, _selected_empty, "leading shape [2, 0]"),
    "all_inactive": ("ratio_kl", ALL, _all_inactive, "every row inactive and poisoned"),
    "vocab_1": ("ratio_kl", ALL, _vocab(1, (8,)), "V = 1"),
    "vocab_2": ("ratio_kl", ALL, _vocab(2, (10,)), "V = 2"),
    "vocab_50257": ("selected_logprobs", ALL, _vocab(50257, (1,), "selected_logprobs"), "GPT-2 vocabulary, one row"),
    "vocab_20011": ("ratio_kl", ("float32",), _vocab(20011, (2,)), "several kernel blocks, ragged tail, one inactive row"),
    "extreme_magnitude": ("ratio_kl", ALL, _extreme_magnitude, "|logits| ~ 1e4, with ref_logps"),
    "extreme_peaked": ("ratio_kl", ALL, _extreme_peaked, "one logit 50 above the rest"),
    "extreme_flat": ("ratio_kl", ALL, _extreme_flat, "all logits (nearly) equal"),
    "temperature_scalar": ("ratio_kl", ALL, _temperature_scalar, "temperature 0.7"),
    "temperature_per_row": ("ratio_kl", ALL, _temperature_rows("ratio_kl"), "per-row temperature, 0 on inactive rows"),
    "selected_logprobs_temperature_per_row": ("selected_logprobs", ALL, _temperature_rows("selected_logprobs"), "per-row temperature"),
    "active_temperature_out_of_range": ("ratio_kl", ALL, _bad_active_temperature, "temperature 0 on an active row raises ValueError"),
    "ref_logps_given": ("ratio_kl", ALL, _ref_logps, "ref_logps instead of ref_logits, NaN on inactive rows"),
    "kl_k1": ("ratio_kl", ALL, _kl("k1"), "k1 estimator"),
    "kl_k2": ("ratio_kl", ALL, _kl("k2"), "k2 estimator"),
    "kl_k3": ("ratio_kl", ALL, _kl("k3"), "k3 estimator"),
    "selected_logprobs_no_mask": ("selected_logprobs", ALL, _no_mask, "mask=None: every row active"),
}


def _cotangents(rng, op: str, lead) -> Dict[str, np.ndarray]:
    return {o: rng.normal(0.0, 1.0, lead) for o in OPS[op].cotangents}


def build_cases() -> Iterator[Case]:
    """Every fixture case, in a fixed order."""
    for group, (op, dtypes, builder, description) in GROUPS.items():
        for dtype in dtypes:
            rng = _rng(group)
            inputs, options = builder(rng, dtype)
            error = "ValueError" if "out_of_range" in group else None
            lead = np.shape(inputs.get("policy_logits", inputs.get("logits")))[:-1]
            yield build_case(
                f"{group}_{DTYPE_SUFFIX[dtype]}", group, op, dtype, inputs, options=options,
                cotangents=None if error else _cotangents(rng, op, lead), expect_error=error,
                description=description,
            )
    yield from loss_cases.build_cases()
    yield from rollout_cases.build_cases()
    yield from entropy_cases.build_cases()


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="directory to write manifest.json and cases/ into")
    args = parser.parse_args(argv)
    write_fixtures(build_cases(), args.out, generator="conformance/generate.py")


if __name__ == "__main__":
    main()
