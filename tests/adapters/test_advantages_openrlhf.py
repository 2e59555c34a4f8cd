"""OpenRLHF's own advantage code against ``ratiokl.torch.advantages``, on the same batch.

OpenRLHF (0.11.2, tested) is the oracle: ``RemoteExperienceMaker.compute_advantages_and_returns``
(reward shaping by ``--advantage_estimator``, the per-token returns or GAE, and the
whitening over the batch's action tokens), called on a list of experiences with the
trainer's settings on an instance built without ``__init__`` (no Ray actor: the method
reads only ``strategy.args``, the KL controller and the experiences). Groups are consecutive (``n_samples_per_prompt``), each
response one contiguous span of action tokens, the reward on its last token. Runs in its
own venv (``.ci/run`` block (d)); skipped where OpenRLHF is not importable.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (see .ci/run block (d))")

from openrlhf_stubs import STUBS  # noqa: E402

from ratiokl.harness.targets.openrlhf import stubbed_if_absent  # noqa: E402
from ratiokl.torch import advantages  # noqa: E402

with stubbed_if_absent(STUBS):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5
N, T = 4, 9  # samples per prompt, response positions


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


def batch(seed: int = 0, prompts: int = 4):
    rng = np.random.default_rng(seed)
    size = prompts * N
    scores = rng.integers(0, 5, size=size).astype(np.float32) * 0.5
    scores[:N] = 1.0  # the first group: equal rewards
    lengths = rng.integers(1, T + 1, size=size)
    mask = np.arange(T)[None, :] < lengths[:, None]
    values = rng.normal(size=(size, T)).astype(np.float32)
    return (torch.from_numpy(scores), torch.from_numpy(mask), torch.from_numpy(values))


def openrlhf(estimator: str, scores, mask, values, gamma=1.0, lambd=1.0):
    """OpenRLHF's ``(advantages, returns)`` ``[B, T]`` for ``--advantage_estimator``."""
    args = NS(algo=NS(advantage=NS(estimator=estimator, gamma=gamma, lambd=lambd,
                                   no_std_norm=False)),
              rollout=NS(n_samples_per_prompt=N),
              reward=NS(clip_range=None, overlong_buffer_len=None,
                        stop_properly_penalty_coef=None))
    maker = object.__new__(RemoteExperienceMaker)  # its methods, none of its Ray actors
    maker.strategy, maker.advantage_estimator, maker.kl_ctl = NS(args=args), estimator, NS(value=0.0)
    experience = NS(rewards=scores.clone(), index=list(range(scores.numel())),
                    action_mask=mask, kl=torch.zeros(mask.shape), values=values.clone(),
                    info={})
    maker.compute_advantages_and_returns([experience])
    return experience.advantages, experience.returns


def on_tokens(adv, mask):
    return torch.where(mask, adv, torch.zeros(()))


@pytest.mark.parametrize("estimator,call", [
    ("group_norm", lambda s, m: advantages.grpo(s, group_size=N, eps=1e-9)),
    ("dr_grpo", lambda s, m: advantages.grpo(s, group_size=N, scale="none")),
    ("rloo", lambda s, m: advantages.rloo(s, group_size=N)),
    ("reinforce_baseline", lambda s, m: advantages.reinforce_pp_baseline(
        s, group_size=N, lengths=m.sum(-1), whiten="population")),
])
def test_group_estimators_equal_openrlhf(estimator, call):
    scores, mask, values = batch()
    expected, _ = openrlhf(estimator, scores, mask, values)
    close(advantages.spread(call(scores, mask), mask), on_tokens(expected, mask))


def test_reinforce_equals_openrlhf():
    scores, mask, values = batch(1)
    expected, expected_returns = openrlhf("reinforce", scores, mask, values, gamma=0.9)
    rewards = torch.zeros(mask.shape).scatter_(1, (mask.sum(-1, keepdim=True) - 1), scores[:, None])
    adv, returns = advantages.reinforce_pp(rewards, mask, 0.9, whiten="population")
    close(adv, on_tokens(expected, mask))
    close(returns, on_tokens(expected_returns, mask))


@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_gae_equals_openrlhf(backend):
    scores, mask, values = batch(2)
    expected, expected_returns = openrlhf("gae", scores, mask, values, gamma=0.99, lambd=0.95)
    rewards = torch.zeros(mask.shape).scatter_(1, (mask.sum(-1, keepdim=True) - 1), scores[:, None])
    adv, returns = advantages.gae(rewards, values, mask, 0.99, 0.95, whiten="population",
                                  backend=backend)
    close(adv, on_tokens(expected, mask))
    close(returns, on_tokens(expected_returns, mask))
