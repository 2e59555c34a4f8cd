"""The advantage estimators' fixture cases, called by ``generate.py`` (their only writer).

Each case: one function of ``ratiokl.<framework>.advantages``, its array arguments under
their API names, its options, and the float64 expectations of ``ratiokl.spec.advantages``
(``expected_advantages``; GAE and REINFORCE++ also ``expected_returns``). Written to
``conformance/advantages/`` (``manifest.json`` and ``cases/``); the README says how they
are judged.
"""

from __future__ import annotations

import zlib
from typing import Any, Dict, Iterator, Tuple

import numpy as np

from ratiokl import spec

SEED = 20261207

#: float32 arithmetic against float64: a few ulps of values of order 1-10 (group means
#: and standard deviations, one division); whitening and the scan sum up to a few hundred
#: terms. Judged as ``|actual - expected| <= atol + rtol * |expected|``.
TOLERANCE = {"rtol": 2e-5, "atol": 2e-5}

def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def _groups(rng: np.random.Generator, poison: bool = False) -> Dict[str, Any]:
    """Unsorted, negative and large ids; a singleton; a group of equal scores; two
    invalid samples holding NaN and inf (``poison``: also a NaN in a valid sample)."""
    ids = np.array([7, -3, 7, 1000, -3, 7, 5, 5, 5, 42, -3, 1000, 11, 11], np.int64)
    scores = rng.normal(size=ids.size).astype(np.float32)
    scores[6:9] = 0.1  # not exact in float32: a plain mean leaves a rounding
    valid = np.ones(ids.size, bool)
    valid[[3, 10]] = False
    scores[3], scores[10] = np.nan, np.inf
    if poison:
        scores[12] = np.nan  # group 11, valid: that group NaN, nothing else
    lengths = rng.integers(1, 30, size=ids.size).astype(np.float32)
    return dict(scores=scores, group_ids=ids, valid=valid, lengths=lengths)


def _tokens(rng: np.random.Generator) -> Dict[str, Any]:
    """Rewards and values ``[6, 45]`` with gaps in the mask (observation tokens), a row
    without response tokens, a full row, and NaN / inf on every masked position."""
    shape = (6, 45)
    rewards = rng.normal(size=shape).astype(np.float32)
    values = rng.normal(size=shape).astype(np.float32)
    mask = rng.random(shape) > 0.3
    mask[1], mask[2] = False, True
    rewards[~mask], values[~mask] = np.nan, -np.inf
    return dict(rewards=rewards, values=values, mask=mask)


_GROUP_ARGS = ("scores", "group_ids")


def _group_case(name, function, options, description, *, poison=False, keep=("valid",)):
    arrays = _groups(_rng(name), poison)
    kwargs = {k: arrays[k] for k in keep}
    reference = getattr(spec, f"reference_{function}")
    expected = reference(arrays["scores"], arrays["group_ids"], **kwargs, **options)
    inputs = {k: arrays[k] for k in (*_GROUP_ARGS, *keep)}
    return name, function, inputs, options, {"advantages": expected}, description


def _gdpo_case(name: str, description: str):
    arrays = _groups(_rng(name))
    second = _rng(name + "/2").normal(size=arrays["scores"].size).astype(np.float32)
    scores = np.stack([arrays["scores"], second], -1)
    options = {"weights": [1.0, 0.5]}
    expected = spec.reference_gdpo(scores, arrays["group_ids"], valid=arrays["valid"],
                                   lengths=arrays["lengths"], **options)
    inputs = dict(scores=scores, group_ids=arrays["group_ids"], valid=arrays["valid"],
                  lengths=arrays["lengths"])
    return name, "gdpo", inputs, options, {"advantages": expected}, description


def _token_case(name: str, function: str, options: Dict[str, Any], description: str):
    arrays = _tokens(_rng(name))
    if function == "gae":
        adv, ret = spec.reference_gae(arrays["rewards"], arrays["values"], arrays["mask"],
                                      **options)
        inputs = arrays
    else:
        adv, ret = spec.reference_reinforce_pp(arrays["rewards"], arrays["mask"], **options)
        inputs = {k: arrays[k] for k in ("rewards", "mask")}
    return name, function, inputs, options, {"advantages": adv, "returns": ret}, description


def _baseline_case(name: str, options: Dict[str, Any], description: str, gaps: bool):
    """The optimal token baseline on ``[12, 20]``: unsorted ids, a singleton, a unique
    longest response, an empty one, an invalid sample, NaN on masked positions."""
    rng = _rng(name)
    shape = (12, 20)
    ids = np.array([3, 0, 3, 1, 0, 3, 2, 2, 2, 4, 0, 1], np.int64)
    lengths = rng.integers(1, shape[1], size=shape[0])
    lengths[[0, 5, 7]] = [shape[1], 6, 0]  # group 3's longest alone; an empty response
    mask = np.arange(shape[1])[None, :] < lengths[:, None]
    if gaps:
        mask &= rng.random(shape) > 0.3  # tool output between the turns
    rewards = rng.normal(size=shape).astype(np.float32)
    old_logps = -rng.random(shape).astype(np.float32) * 3.0
    sum_pi_squared = rng.random(shape).astype(np.float32)
    is_weights = (rng.random(shape) + 0.5).astype(np.float32)
    valid = np.ones(shape[0], bool)
    valid[10] = False
    rewards[~mask], old_logps[~mask] = np.nan, np.nan
    rewards[10] = np.inf  # the invalid sample's
    inputs = dict(rewards=rewards, mask=mask, old_logps=old_logps,
                  sum_pi_squared=sum_pi_squared, group_ids=ids, valid=valid,
                  is_weights=is_weights)
    adv, ret = spec.reference_optimal_token_baseline(
        rewards, mask, old_logps, sum_pi_squared, ids, valid=valid, is_weights=is_weights,
        **options)
    return (name, "optimal_token_baseline", inputs, options,
            {"advantages": adv, "returns": ret}, description)


def build_cases() -> Iterator[Tuple[str, str, Dict[str, Any], Dict[str, Any],
                                    Dict[str, np.ndarray], str]]:
    """``(name, function, inputs, options, expected, description)`` per case, in order."""
    yield _group_case("grpo_unsorted_ids_singleton_equal", "grpo", {},
                      "verl's GRPO: unbiased std, eps 1e-6, singleton x / (1 + eps), equal "
                      "scores exactly 0, invalid NaN / inf samples 0")
    yield _group_case("grpo_population_singleton_zero", "grpo",
                      {"std": "population", "eps": 1e-4, "singleton": "zero"},
                      "population std, TRL's eps and singleton 0")
    yield _group_case("grpo_scale_batch", "grpo", {"scale": "batch", "eps": 1e-4,
                                                   "singleton": "zero"},
                      "TRL's scale_rewards='batch': the std of every valid score")
    yield _group_case("grpo_scale_none", "grpo", {"scale": "none"}, "Dr. GRPO")
    yield _group_case("grpo_valid_nan_poisons_its_group", "grpo", {"scale": "batch"},
                      "a NaN score in a valid sample: its group NaN, nothing else",
                      poison=True)
    yield _group_case("rloo_singleton_score", "rloo", {}, "verl's rloo")
    yield _group_case("rloo_singleton_zero", "rloo", {"singleton": "zero"},
                      "verl's rloo_vectorized")
    yield _group_case("reinforce_pp_baseline_token_weights", "reinforce_pp_baseline", {},
                      "verl's whitening over tokens (lengths as weights)",
                      keep=("valid", "lengths"))
    yield _group_case("reinforce_pp_baseline_population", "reinforce_pp_baseline",
                      {"whiten": "population"}, "OpenRLHF's whitening",
                      keep=("valid", "lengths"))
    yield _group_case("opo_length_weighted", "opo", {}, "OPO's length-weighted baseline",
                      keep=("valid", "lengths"))
    yield _group_case("grpo_passk_ties_and_singletons", "grpo_passk", {},
                      "pass@k: best minus second best over the std; ties and singletons 0")
    yield _group_case("gpg_f_norm", "gpg", {"f_norm": 2.0}, "GPG with f_norm 2")
    yield _gdpo_case("gdpo_two_rewards", "GDPO: two rewards, weights (1, 0.5), whitened "
                                         "over tokens")
    yield _token_case("gae_gaps_garbage_masked", "gae", {"gamma": 0.99, "lam": 0.95},
                      "verl's GAE: gaps skipped, NaN / -inf on masked positions, a row "
                      "with no response token, whitened (unbiased)")
    yield _token_case("gae_population_whitening", "gae",
                      {"gamma": 1.0, "lam": 0.9, "whiten": "population"}, "OpenRLHF's")
    yield _token_case("gae_no_whitening", "gae",
                      {"gamma": 0.9, "lam": 1.0, "whiten": "none"}, "raw advantages")
    yield _token_case("reinforce_pp_discounted", "reinforce_pp", {"gamma": 0.97},
                      "verl's REINFORCE++: discounted returns over gaps, whitened")
    yield _baseline_case("optimal_token_baseline_zero_tail", {},
                         "verl's optimal_token_baseline: per position, rollout IS weights, "
                         "the longest's tail 0, a singleton, an empty and an invalid row",
                         gaps=False)
    yield _baseline_case("optimal_token_baseline_active_gaps", {"align": "active",
                                                                "zero_tail": False},
                         "verl's tir_optimal_token_baseline: per unmasked token over gaps",
                         gaps=True)
