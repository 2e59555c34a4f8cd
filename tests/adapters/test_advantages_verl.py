"""verl's own advantage estimators against ``ratiokl.torch.advantages``, on the same batch.

verl (0.9.1, tested) is the oracle: ``verl.trainer.ppo.core_algos``' registered
estimators on token-level rewards (the outcome reward on each response's last token), a
response mask of unequal lengths and ``index`` as verl's trainer builds it (a ``uid``
string per sample, unsorted), with singleton groups and a group of equal rewards. Failed
samples: verl has no notion of them, so ratiokl's result with ``valid`` false on some
samples (holding NaN) must equal verl's on the batch without them. The registered
``ratiokl_*`` estimators are checked against verl's of the same name. Runs in its own venv
(``.ci/run`` block (d)); skipped where verl is not importable.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is not installed (see .ci/run block (d))")

from omegaconf import OmegaConf  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402

import ratiokl.adapters.verl  # noqa: E402,F401 (registers the ratiokl_* estimators)
from ratiokl.torch import advantages  # noqa: E402

# float32 in both: verl's loops and ratiokl's segment sums round differently (a few ulps
# of order-1 values); whitening divides by a std of order 1.
RTOL, ATOL = 1e-5, 1e-5
T = 7


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True)


def batch(seed: int = 0):
    """``(token_level_rewards [B, T], response_mask [B, T], index [B] of uid strings,
    scores [B], group ids [B])``."""
    rng = np.random.default_rng(seed)
    groups = np.array([3, 0, 3, 1, 0, 3, 2, 2, 2, 4, 0, 1, 3, 5, 5])  # 4: a singleton
    index = np.array([f"uid-{g:02d}" for g in groups], dtype=object)
    scores = rng.integers(0, 4, size=groups.size).astype(np.float32) * 0.5
    scores[[6, 7, 8]] = 1.0  # group 2: equal rewards
    lengths = rng.integers(1, T + 1, size=groups.size)
    mask = np.arange(T)[None, :] < lengths[:, None]
    rewards = np.zeros((groups.size, T), np.float32)
    rewards[np.arange(groups.size), lengths - 1] = scores
    return (torch.from_numpy(rewards), torch.from_numpy(mask.astype(np.float32)), index,
            torch.from_numpy(scores), torch.from_numpy(groups))


def config(**fields):
    return OmegaConf.create({"norm_adv_by_std_in_grpo": True, "gamma": 1.0, **fields})


def verl(name: str, rewards, mask, index, **kwargs):
    return core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=rewards.clone(), response_mask=mask, index=index, **kwargs)[0]


OUTCOME = [
    # (verl name, verl kwargs, ratiokl function, ratiokl options); lengths: token counts
    ("grpo", dict(norm_adv_by_std_in_grpo=True), "grpo", {}),
    ("grpo", dict(norm_adv_by_std_in_grpo=False), "grpo", dict(scale="none")),
    ("grpo_vectorized", dict(norm_adv_by_std_in_grpo=True), "grpo", {}),
    ("rloo", {}, "rloo", {}),
    ("rloo_vectorized", {}, "rloo", dict(singleton="zero")),
    ("opo", {}, "opo", dict(lengths=True)),
    ("gpg", {}, "gpg", {}),
    ("reinforce_plus_plus_baseline", {}, "reinforce_pp_baseline", dict(lengths=True)),
    ("gdpo", {}, "gdpo", dict(lengths=True, columns=True)),
]


def ours(name: str, scores, ids, mask, options, valid=None):
    options = dict(options)
    if options.pop("lengths", False):
        options["lengths"] = mask.sum(-1)
    if options.pop("columns", False):
        scores = scores[:, None]
    adv = getattr(advantages, name)(scores, ids, valid=valid, **options)
    return advantages.spread(adv, mask)


@pytest.mark.parametrize("case", OUTCOME, ids=[f"{c[0]}-{c[3]}" for c in OUTCOME])
def test_outcome_estimators_equal_verl(case):
    verl_name, verl_kwargs, name, options = case
    rewards, mask, index, scores, ids = batch()
    expected = verl(verl_name, rewards, mask, index, **verl_kwargs)
    close(ours(name, scores, ids, mask, options), expected)


@pytest.mark.parametrize("case", OUTCOME, ids=[f"{c[0]}-{c[3]}" for c in OUTCOME])
def test_failed_samples_equal_verl_without_them(case):
    verl_name, verl_kwargs, name, options = case
    rewards, mask, index, scores, ids = batch(1)
    valid = torch.ones(scores.shape, dtype=torch.bool)
    valid[[2, 9]] = False  # one from a group of five, and the singleton: its group empties
    kept = valid.numpy()
    expected = verl(verl_name, rewards[valid], mask[valid], index[kept], **verl_kwargs)
    scores = scores.clone()
    scores[~valid] = float("nan")
    actual = ours(name, scores, ids, mask, options, valid=valid)
    close(actual[valid], expected)
    assert (actual[~valid] == 0).all()


def test_passk_equals_verl():
    rewards, mask, index, scores, ids = batch(2)
    keep = torch.from_numpy(np.isin(ids.numpy(), [4], invert=True))  # verl: groups of 2+
    for norm, scale in ((True, "group"), (False, "none")):
        expected = verl("grpo_passk", rewards[keep], mask[keep], index[keep.numpy()],
                        config=config(norm_adv_by_std_in_grpo=norm))
        actual = advantages.grpo_passk(scores[keep], ids[keep], scale=scale)
        close(advantages.spread(actual, mask[keep]), expected)


@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_gae_equals_verl(backend):
    rng = np.random.default_rng(3)
    rewards = torch.from_numpy(rng.normal(size=(6, 40)).astype(np.float32))
    values = torch.from_numpy(rng.normal(size=(6, 40)).astype(np.float32))
    mask = torch.from_numpy((rng.random((6, 40)) > 0.25).astype(np.float32))  # gaps
    expected_adv, expected_ret = core_algos.compute_gae_advantage_return(
        rewards, values, mask, gamma=0.99, lam=0.95)
    adv, ret = advantages.gae(rewards, values, mask, 0.99, 0.95, backend=backend)
    on = mask.bool()
    close(adv[on], expected_adv[on])
    close(ret[on], expected_ret[on])


def test_reinforce_pp_equals_verl():
    rng = np.random.default_rng(4)
    rewards = torch.from_numpy(rng.normal(size=(5, 30)).astype(np.float32))
    mask = torch.from_numpy((rng.random((5, 30)) > 0.25).astype(np.float32))
    expected = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask, config=config(gamma=0.9))
    actual = advantages.reinforce_pp(rewards, mask, 0.9)
    close(actual[0], expected[0])
    on = mask.bool()
    close(actual[1][on], expected[1][on])


def test_remax_is_reinforce_pp_returns_minus_the_baseline():
    rng = np.random.default_rng(5)
    rewards = torch.from_numpy(rng.normal(size=(4, 9)).astype(np.float32))
    mask = torch.from_numpy((np.arange(9)[None] < np.array([[9], [3], [5], [1]])
                             ).astype(np.float32))
    baselines = torch.from_numpy(rng.normal(size=4).astype(np.float32))
    expected = core_algos.compute_remax_outcome_advantage(rewards, baselines, mask)[0]
    returns = advantages.reinforce_pp(rewards, mask, 1.0, whiten="none")[1]
    close(torch.where(mask.bool(), returns - baselines[:, None], 0.0), expected)


@pytest.mark.parametrize("name", ["grpo", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
                                  "reinforce_plus_plus_baseline", "gdpo",
                                  "reinforce_plus_plus"])
def test_registered_estimators_equal_verl(name):
    rewards, mask, index, scores, ids = batch(6)
    keep = torch.from_numpy(np.isin(ids.numpy(), [4], invert=True))  # pass@k: groups of 2+
    rewards, mask, index = rewards[keep], mask[keep], index[keep.numpy()]
    expected = verl(name, rewards, mask, index, config=config(gamma=0.95))
    actual = verl(f"ratiokl_{name}", rewards, mask, index, config=config(gamma=0.95))
    close(actual, expected)


def token_batch(seed: int, gaps: bool):
    """verl's inputs for the optimal token baseline: ``batch``'s groups (a singleton, a
    unique longest response, an empty one), old log-probs, ``sum_pi_squared`` and rollout
    IS weights ``[B, 12]``; with ``gaps``, multi-turn masks (tool output between turns)."""
    rng = np.random.default_rng(seed)
    _, _, index, _, ids = batch(seed)
    width = 12
    lengths = rng.integers(1, width, size=ids.numel())
    lengths[[0, 5, 7]] = [width, 4, 0]
    mask = np.arange(width)[None, :] < lengths[:, None]
    if gaps:
        mask &= rng.random(mask.shape) > 0.3
    mask = mask.astype(np.float32)
    rewards = rng.normal(size=mask.shape).astype(np.float32) * mask
    logps = -rng.random(mask.shape).astype(np.float32) * 3.0
    spi = rng.random(mask.shape).astype(np.float32)
    rho = (rng.random(mask.shape) + 0.5).astype(np.float32)
    return (*(torch.from_numpy(a) for a in (rewards, mask, logps, spi, rho)), index, ids)


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("name,align,gaps", [
    ("optimal_token_baseline", "position", False),
    ("optimal_token_baseline", "position", True),
    ("tir_optimal_token_baseline", "active", True),
    ("tir_optimal_token_baseline", "active", False)])
def test_optimal_token_baseline_equals_verl(name, align, gaps, weights, zero_tail):
    rewards, mask, logps, spi, rho, index, ids = token_batch(7, gaps)
    rho = rho if weights else None
    expected_adv, expected_ret = core_algos.get_adv_estimator_fn(name)(
        token_level_rewards=rewards.clone(), response_mask=mask, index=index,
        old_log_probs=logps, sum_pi_squared=spi, rollout_is_weights=rho,
        handle_zero_tail=zero_tail)
    adv, ret = advantages.optimal_token_baseline(
        rewards, mask, logps, spi, ids, is_weights=rho, align=align, zero_tail=zero_tail)
    close(adv, expected_adv)
    on = mask.bool()
    close(ret[on], expected_ret[on])


def test_optimal_token_baseline_failed_samples_equal_verl_without_them():
    rewards, mask, logps, spi, rho, index, ids = token_batch(8, gaps=False)
    valid = torch.ones(ids.shape, dtype=torch.bool)
    valid[[2, 9]] = False
    expected, _ = core_algos.get_adv_estimator_fn("optimal_token_baseline")(
        token_level_rewards=rewards[valid], response_mask=mask[valid],
        index=index[valid.numpy()], old_log_probs=logps[valid], sum_pi_squared=spi[valid])
    rewards = rewards.clone()
    rewards[~valid] = float("nan")
    adv, _ = advantages.optimal_token_baseline(rewards, mask, logps, spi, ids, valid=valid)
    close(adv[valid], expected)
    assert (adv[~valid] == 0).all()
