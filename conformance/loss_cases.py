"""``policy_loss`` conformance cases: one group per behaviour the loss promises.

Called by ``conformance/generate.py`` (the only writer of fixtures). Every
case has poisoned inactive rows (NaN logits, NaN old log-probs / advantages /
weights, out-of-range ids) unless its name says otherwise, float64
expectations from ``ratiokl.spec.policy_loss`` and a scalar upstream
cotangent on the loss. Behaviour log-probs are kept away from the clip
thresholds so that float32 rounding cannot flip a clip decision. The
``policy_entropy_*`` groups pin ``entropy_coef`` down on logits shaped for the
entropy: flat (``H = log V``, where its gradient cancels), peaked (``H ~ 0``),
masked with ``-inf`` (``p = 0`` columns; a row allowing only its action) and a
per-row temperature, with several aggregations, CISPO and GSPO.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from ratiokl import spec
from ratiokl.conformance import LOGIT_DTYPES, Case, build_case, round_to_dtype

SEED = 20261130
SUFFIX = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
B, T, V = 4, 8, 40
#: Minimum relative distance of an active token's ratio from a clip threshold.
MARGIN = 1e-3

Inputs = Dict[str, Any]


def _shaped(rng, logits, ids, mask, shape: str):
    """Logits for the entropy groups: ``"flat"`` (half the rows exactly equal, the rest
    within 1e-3), ``"peaked"`` (one logit 30 above the rest, the action's in half the
    rows), ``"masked"`` (``-inf`` at about half of an active row's other tokens; the
    first active row allows only its action). ``"normal"``: as drawn."""
    if shape == "flat":
        logits = 7.0 + rng.normal(0.0, 1e-3, logits.shape)
        logits[: logits.shape[0] // 2] = 7.0
    elif shape == "peaked":
        logits = rng.normal(0.0, 1.0, logits.shape)
        peak = np.where(rng.random(ids.shape) < 0.5, ids, rng.integers(0, logits.shape[-1],
                                                                      ids.shape))
        np.put_along_axis(logits, peak[..., None], 30.0, axis=-1)
    elif shape == "masked":
        drop = rng.random(logits.shape) < 0.5
        first = tuple(np.argwhere(mask)[0])
        drop[first] = True
        np.put_along_axis(drop, ids[..., None], False, axis=-1)
        logits = np.where(drop, -np.inf, logits)
    return logits


def _inputs(rng, dtype, *, lead=(B, T), vocab=V, active=0.75, per_token_adv=False,
            temperature=1.0, logits="normal", row_temperature=False):
    """Policy/reference logits, ids, mask, behaviour log-probs, advantages, weights, segments.

    ``logits``: their shape (:func:`_shaped`); ``row_temperature``: a per-row
    temperature in ``[0.4, 1.8]`` (``temperature`` in the result; 0 on inactive rows).
    """
    policy = rng.normal(0.0, 2.0, (*lead, vocab))
    mask = rng.random(lead) < active
    ids = rng.integers(0, vocab, lead)
    extra = {}
    if logits != "normal":  # (the other groups draw nothing more: their inputs stay)
        policy = _shaped(rng, policy, ids, mask, logits)
    if row_temperature:
        temperature = np.where(mask, rng.uniform(0.4, 1.8, lead), 0.0).astype(np.float32)
        extra["temperature"] = temperature
    logp = spec.selected_logprobs(round_to_dtype(policy, dtype), ids, mask, temperature=temperature)
    adv = rng.normal(0.0, 1.0, lead if per_token_adv else lead[:-1])
    return {
        **extra,
        "policy_logits": policy,
        "ref_logits": policy + rng.normal(0.0, 0.6, policy.shape),
        "action_ids": ids,
        "mask": mask,
        "old_logps": logp + rng.normal(0.0, 0.5, lead),
        "advantages": np.where(mask, adv, np.nan) if per_token_adv else adv,
        "importance_weights": rng.uniform(0.3, 1.5, lead),
        "segment_ids": np.sort(rng.integers(0, 3, lead), axis=-1),
    }


def _poison_inactive(x: Inputs) -> Inputs:
    inactive = ~x["mask"]
    vocab = x["policy_logits"].shape[-1]
    for key in ("policy_logits", "ref_logits"):
        if key in x:
            x[key][inactive] = np.nan
    x["action_ids"] = np.where(inactive, np.where(np.arange(inactive.size).reshape(
        inactive.shape) % 2 == 0, -1, vocab + 5), x["action_ids"])
    for key in ("old_logps", "importance_weights"):
        x[key] = np.where(inactive, np.nan, x[key])
    return x


def _thresholds(options) -> Tuple[float, ...]:
    """Ratios at which the loss switches branch: clip bounds, caps, ``exp(+-bound)``."""
    opts = spec.policy_loss_options(**{**spec.POLICY_LOSS_DEFAULTS, **{
        k: v for k, v in options.items() if k in spec.POLICY_LOSS_DEFAULTS}})
    bound = () if opts.log_ratio_bound is None else (
        np.exp(opts.log_ratio_bound), np.exp(-opts.log_ratio_bound))
    caps = (opts.ratio_low, opts.ratio_high, opts.neg_cap) + bound
    return tuple(t for t in caps if t is not None and t > 0)  # a floor of 0 never switches


def _keep_off_thresholds(x: Inputs, options, dtype, segments) -> Inputs:
    """Shift ``old_logps`` of tokens whose ratio sits within ``MARGIN`` of a threshold."""
    mask = x["mask"]
    temperature = x.get("temperature", options.get("temperature", 1.0))
    logp = spec.selected_logprobs(round_to_dtype(x["policy_logits"], dtype), x["action_ids"],
                                  mask, temperature=temperature)
    seq, n = spec.sequence_index(mask, segments)
    counts = np.maximum(np.bincount(seq[mask], minlength=n), 1)
    for _ in range(4):
        lr = np.where(mask, logp - x["old_logps"], 0.0)
        if options.get("ratio_level") == "sequence":
            means = np.bincount(seq[mask], lr[mask], n) / counts
            lr = np.where(mask, np.append(means, 0.0)[seq], 0.0)
        near = np.zeros(mask.shape, bool)
        for t in _thresholds(options):
            near |= mask & (np.abs(np.exp(lr) / t - 1.0) < MARGIN)
        if not near.any():
            return x
        x["old_logps"] = np.where(near, x["old_logps"] - 0.01, x["old_logps"])
    raise RuntimeError("could not keep the ratios away from the clip thresholds")


#: group -> (dtypes, scalar options, arrays passed besides the positional ones, build kwargs,
#: description). Every option the loss has is pinned by at least one group.
GROUPS: Dict[str, Tuple[Tuple[str, ...], Dict[str, Any], Tuple[str, ...], Dict[str, Any], str]] = {
    "policy_grpo_kl_k3": (LOGIT_DTYPES, {"kl_coef": 0.1}, (), {}, "PPO clip, k3 KL, token-mean"),
    "policy_agg_token_sum": (("float32",), {"loss_agg": "token-sum"}, (), {}, "token-sum"),
    "policy_agg_seq_mean_token_mean": (("float32",), {"loss_agg": "seq-mean-token-mean"}, (), {},
                                       "seq-mean-token-mean (GRPO)"),
    "policy_agg_seq_mean_token_sum": (("float32",), {"loss_agg": "seq-mean-token-sum"}, (), {},
                                      "seq-mean-token-sum"),
    "policy_agg_seq_mean_token_sum_norm": (("float32",), {"loss_agg": "seq-mean-token-sum-norm"},
                                           (), {}, "seq-mean-token-sum-norm (/ T)"),
    "policy_global_normalizer": (("float32",), {"loss_normalizer": 57.0}, (), {},
                                 "token-mean over a global token count"),
    "policy_clip_higher": (("float32",), {"clip_eps_high": 0.28}, (), {}, "DAPO clip-higher"),
    "policy_dual_clip": (("float32",), {"dual_clip": 1.4}, (), {"per_token_adv": True},
                         "dual-clip c = 1.4, per-token advantages (NaN on inactive rows)"),
    "policy_ratio_cap": (("float32",), {"ratio_cap": 1.3, "clip_eps": 0.1}, (), {},
                         "INTELLECT-2 delta = 1.3"),
    "policy_kl_k1": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k1"}, (), {}, "k1 KL"),
    "policy_kl_k2": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k2"}, (), {}, "k2 KL"),
    "policy_kl_k3": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k3"}, (), {}, "k3 KL"),
    "policy_kl_k1_plus": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k1+"}, (), {},
                          "k1 value, k2 gradient"),
    "policy_kl_k3_plus": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k3+"}, (), {},
                          "k3 value, k2 gradient"),
    "policy_kl_k3_ratio_weighted": (("float32",), {"kl_coef": 0.3, "kl_estimator": "k3-is"}, (),
                                    {}, "k3 times the importance ratio"),
    "policy_gspo": (("float32", "bfloat16"), {"ratio_level": "sequence",
                                              "loss_agg": "seq-mean-token-mean"}, (), {},
                    "GSPO sequence ratio"),
    "policy_gspo_packed": (("float32",), {"ratio_level": "sequence",
                                          "loss_agg": "seq-mean-token-mean"},
                           ("segment_ids",), {"active": 0.9}, "GSPO on packed rows"),
    "policy_packed_seq_mean_token_sum": (("float32",), {"loss_agg": "seq-mean-token-sum"},
                                         ("segment_ids",), {"active": 0.9},
                                         "sequences = segments of packed rows"),
    "policy_importance_weights": (("float32",), {"kl_coef": 0.1}, ("importance_weights",), {},
                                  "truncated-IS weights on the policy term"),
    "policy_log_ratio_bound": (("float32",), {"log_ratio_bound": 0.3, "kl_coef": 0.5,
                                              "dual_clip": 3.0}, (), {},
                               "|log ratio| and |d| bounded at 0.3: zero gradient beyond"),
    "policy_temperature": (("float32",), {"temperature": 0.7, "kl_coef": 0.2}, (), {},
                           "temperature 0.7 on policy and reference"),
    "policy_ref_logps": (("float32",), {"kl_coef": 0.2}, ("ref_logps",), {},
                         "ref_logps instead of ref_logits"),
    "policy_all_inactive": (("float32", "bfloat16"), {"kl_coef": 0.5,
                                                      "loss_agg": "seq-mean-token-mean"},
                            ("segment_ids", "importance_weights"), {"active": 0.0},
                            "no active token: loss 0, zero gradient"),
    "policy_empty_rows": (("float32",), {"loss_agg": "seq-mean-token-sum"}, (),
                          {"lead": (0, T)}, "no rows at all"),
    # CISPO (MiniMax-M1): clipped, detached weight times logp, with every aggregation.
    "policy_cispo_token_mean": (("float32", "bfloat16"), {"objective": "cispo",
                                                          "clip_eps_high": 0.28, "kl_coef": 0.1},
                                (), {}, "CISPO, token-mean, k3 KL"),
    "policy_cispo_token_sum": (("float32",), {"objective": "cispo", "loss_agg": "token-sum",
                                              "clip_eps": 1.0, "clip_eps_high": 0.5},
                               (), {"per_token_adv": True},
                               "CISPO without a floor (clip_eps = 1), token-sum, per-token "
                               "advantages"),
    "policy_cispo_seq_mean_token_mean": (("float32",), {"objective": "cispo",
                                                        "loss_agg": "seq-mean-token-mean"},
                                         (), {}, "CISPO, seq-mean-token-mean"),
    "policy_cispo_seq_mean_token_sum": (("float32",), {"objective": "cispo",
                                                       "loss_agg": "seq-mean-token-sum"},
                                        ("segment_ids",), {"active": 0.9},
                                        "CISPO, seq-mean-token-sum over packed segments"),
    "policy_cispo_seq_mean_token_sum_norm": (("float32",), {
        "objective": "cispo", "loss_agg": "seq-mean-token-sum-norm", "loss_normalizer": 12.0},
        (), {}, "CISPO, seq-mean-token-sum-norm with a normaliser"),
    "policy_cispo_ratio_cap_kl_is": (("float32",), {
        "objective": "cispo", "clip_eps": 0.5, "clip_eps_high": 1.0, "ratio_cap": 1.6,
        "kl_coef": 0.3, "kl_estimator": "k3-is", "log_ratio_bound": 0.9},
        ("importance_weights",), {},
        "CISPO, ceiling min(2, 1.6), ratio-weighted KL, bound 0.9, importance weights"),
    "policy_cispo_sequence_ratio": (("float32",), {"objective": "cispo",
                                                   "ratio_level": "sequence",
                                                   "loss_agg": "seq-mean-token-mean"},
                                    ("segment_ids",), {"active": 0.9},
                                    "CISPO weight from the sequence ratio, packed rows"),
    # One tile a row on a GPU (V <= the forward tile): the launch plan of the NaN-gradient bug.
    "policy_vocab_1000": (("float32", "bfloat16"), {"kl_coef": 0.1}, (),
                          {"lead": (2, 3), "vocab": 1000}, "V = 1000: one ragged tile a row"),
    "policy_vocab_4096": (("bfloat16",), {"kl_coef": 0.1, "loss_agg": "seq-mean-token-mean"},
                          ("ref_logps",), {"lead": (2, 3), "vocab": 4096},
                          "V = 4096: exactly one whole bf16 tile a row"),
    # entropy_coef: - entropy_coef * H in every token's loss, aggregated as the policy term.
    "policy_entropy_token_mean": (LOGIT_DTYPES, {"entropy_coef": 0.3, "kl_coef": 0.1}, (), {},
                                  "entropy bonus 0.3, k3 KL, token-mean"),
    "policy_entropy_flat": (LOGIT_DTYPES, {"entropy_coef": 0.3}, (), {"logits": "flat"},
                            "(nearly) equal logits: H = log V, its gradient cancels"),
    "policy_entropy_peaked": (LOGIT_DTYPES, {"entropy_coef": 0.3,
                                             "loss_agg": "seq-mean-token-mean"},
                              (), {"logits": "peaked"},
                              "one logit 30 above the rest: H ~ 0, seq-mean-token-mean"),
    "policy_entropy_masked_vocab": (LOGIT_DTYPES, {"entropy_coef": 0.3, "loss_agg": "token-sum"},
                                    (), {"logits": "masked"},
                                    "-inf logits add 0 to H and get a finite gradient; a row "
                                    "allowing only its action (H = 0), token-sum"),
    "policy_entropy_temperature_per_row": (("float32", "bfloat16"), {
        "entropy_coef": 0.3, "kl_coef": 0.2, "loss_agg": "seq-mean-token-sum"},
        ("temperature",), {"row_temperature": True},
        "per-row temperature (0 on inactive rows): H of softmax(z / T), gradient / T"),
    "policy_entropy_penalty_sum_norm": (("float32",), {
        "entropy_coef": -0.2, "loss_agg": "seq-mean-token-sum-norm", "loss_normalizer": 12.0},
        (), {}, "a negative coefficient (an entropy penalty), seq-mean-token-sum-norm"),
    "policy_entropy_packed_weights": (("float32",), {"entropy_coef": 0.3,
                                                     "loss_agg": "seq-mean-token-mean"},
                                      ("segment_ids", "importance_weights"), {"active": 0.9},
                                      "packed sequences, importance weights (on pg only)"),
    "policy_entropy_cispo": (("float32", "bfloat16"), {
        "objective": "cispo", "clip_eps_high": 0.28, "kl_coef": 0.1, "entropy_coef": 0.3},
        (), {}, "CISPO with the entropy bonus"),
    "policy_entropy_gspo": (("float32",), {"ratio_level": "sequence",
                                           "loss_agg": "seq-mean-token-mean",
                                           "entropy_coef": 0.3}, (), {},
                            "GSPO (the two-pass path) with the entropy bonus"),
    "policy_entropy_all_inactive": (("float32",), {"entropy_coef": 0.3}, (), {"active": 0.0},
                                    "no active token: loss 0, entropy_mean 0, zero gradient"),
    "policy_entropy_vocab_4096": (("bfloat16",), {"entropy_coef": 0.01, "kl_coef": 0.1},
                                  ("ref_logps",), {"lead": (2, 3), "vocab": 4096},
                                  "entropy_coef 0.01 on rows of one whole bf16 tile"),
}


def _build(group: str, dtype: str) -> Tuple[Inputs, Dict[str, Any]]:
    _, options, arrays, kwargs, _ = GROUPS[group]
    return build_inputs(group, dtype, options, arrays, kwargs), dict(options)


#: ``extend(rng, inputs, segments)``: more arrays for a case (``rollout_cases``).
Extend = Callable[[np.random.Generator, Inputs, Optional[np.ndarray]], Inputs]


def build_inputs(group: str, dtype: str, options: Dict[str, Any], arrays: Tuple[str, ...],
                 kwargs: Dict[str, Any], extend: Optional[Extend] = None) -> Inputs:
    """A group's inputs: the positional ones and the named ``arrays``, ratios kept off the
    clip thresholds, inactive tokens poisoned. ``extend`` adds arrays before the poisoning,
    drawing after every other draw (the base inputs are those of the group without it)."""
    rng = np.random.default_rng([SEED, zlib.crc32(group.encode())])
    x = _inputs(rng, dtype, temperature=options.get("temperature", 1.0), **kwargs)
    segments = x["segment_ids"] if "segment_ids" in arrays else None
    x = _keep_off_thresholds(x, options, dtype, segments)
    if "ref_logps" in arrays:
        x["ref_logps"] = spec.selected_logprobs(round_to_dtype(x.pop("ref_logits"), dtype),
                                                x["action_ids"], x["mask"])
        x["ref_logps"][~x["mask"]] = np.nan
    if extend is not None:
        x = extend(rng, x, segments)
    x = _poison_inactive(x)
    keep = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")
    return {k: v for k, v in x.items() if k in keep + arrays}


def build_cases() -> Iterator[Case]:
    """Every ``policy_loss`` case, in a fixed order."""
    for group, (dtypes, _, _, _, description) in GROUPS.items():
        for dtype in dtypes:
            inputs, options = _build(group, dtype)
            yield build_case(
                f"{group}_{SUFFIX[dtype]}", group, "policy_loss", dtype, inputs, options=options,
                cotangents={"loss": np.float32(0.75)}, description=description,
            )
