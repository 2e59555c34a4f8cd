"""The advantage estimators of both frameworks against the float64 spec: one test body,
run for every (framework, backend) pair through ``from_numpy -> op -> to_numpy``.

Cases pin down the edge cases trainers disagree on: unsorted and negative group ids,
singleton groups, equal rewards, invalid samples holding NaN / inf (which must reach no
other sample), and a NaN in a valid sample (its own group NaN, nothing else)."""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl import spec

# float32 math against the float64 spec: a few ulps of values of order 1-10 (means,
# standard deviations and one division); whitening sums B terms.
RTOL, ATOL = 2e-5, 2e-5

FRAMEWORKS = ("torch", "jax")


class Runner:
    """One framework's ``advantages`` module, called on NumPy inputs, NumPy out."""

    def __init__(self, framework: str):
        self.framework = framework
        if framework == "torch":
            torch = pytest.importorskip("torch")
            from ratiokl.torch import advantages

            self.array = lambda x: None if x is None else torch.from_numpy(np.asarray(x))
        else:
            jnp = pytest.importorskip("jax.numpy")
            from ratiokl.jax import advantages

            self.array = lambda x: None if x is None else jnp.asarray(x)
        self.module = advantages

    def __call__(self, name: str, *args, **kwargs):
        args = [self.array(a) if isinstance(a, np.ndarray) else a for a in args]
        kwargs = {k: self.array(v) if isinstance(v, np.ndarray) else v
                  for k, v in kwargs.items()}
        out = getattr(self.module, name)(*args, **kwargs)
        if isinstance(out, tuple):
            return tuple(np.asarray(o) for o in out)
        return np.asarray(out)


@pytest.fixture(params=FRAMEWORKS)
def run(request) -> Runner:
    return Runner(request.param)


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL, equal_nan=True)


def batch(seed: int = 0):
    """Scores with unsorted, negative and large group ids, a singleton group, a group of
    equal scores, and two invalid samples holding NaN and inf."""
    rng = np.random.default_rng(seed)
    ids = np.array([7, -3, 7, 1000, -3, 7, 5, 5, 5, 42, -3, 1000], np.int64)
    x = rng.normal(size=ids.size).astype(np.float32)
    x[6:9] = 0.5  # group 5: equal scores
    valid = np.ones(ids.size, bool)
    valid[[3, 10]] = False
    x[3], x[10] = np.nan, np.inf  # invalid: whatever they hold stays out
    return x, ids, valid


GROUP_CASES = [
    ("grpo", dict(std="unbiased", scale="group", eps=1e-6, singleton="score")),
    ("grpo", dict(std="population", scale="group", eps=1e-4, singleton="zero")),
    ("grpo", dict(std="unbiased", scale="batch", eps=1e-4, singleton="zero")),
    ("grpo", dict(std="unbiased", scale="none", eps=1e-6, singleton="score")),
    ("rloo", dict(singleton="score")),
    ("rloo", dict(singleton="zero")),
    ("reinforce_pp_baseline", dict(whiten="unbiased", singleton="score")),
    ("reinforce_pp_baseline", dict(whiten="population", singleton="zero")),
    ("grpo_passk", dict(std="unbiased", scale="group", eps=1e-6)),
    ("grpo_passk", dict(std="population", scale="none", eps=1e-6)),
    ("gpg", dict(f_norm=2.0)),
]


@pytest.mark.parametrize("name,options", GROUP_CASES,
                         ids=[f"{n}-{'-'.join(map(str, o.values()))}" for n, o in GROUP_CASES])
def test_group_estimators_match_spec(run, name, options):
    x, ids, valid = batch()
    reference = getattr(spec, f"reference_{name}")
    expected = reference(x, ids, valid=valid, **options)
    actual = run(name, x, ids, valid=valid, **options)
    assert actual.dtype == np.float32 and actual.shape == x.shape
    close(actual, expected)
    assert np.isfinite(actual).all()
    assert (actual[~valid] == 0).all()


def test_group_size_equals_consecutive_ids(run):
    x = np.random.default_rng(1).normal(size=12).astype(np.float32)
    by_size = run("grpo", x, group_size=4)
    by_ids = run("grpo", x, np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(by_size, by_ids)
    close(by_size, spec.reference_grpo(x, group_size=4))


def test_opo_and_lengths_whitening(run):
    x, ids, valid = batch(2)
    lengths = np.arange(1, x.size + 1).astype(np.float32)
    close(run("opo", x, ids, valid=valid, lengths=lengths),
          spec.reference_opo(x, ids, valid=valid, lengths=lengths))
    close(run("reinforce_pp_baseline", x, ids, valid=valid, lengths=lengths),
          spec.reference_reinforce_pp_baseline(x, ids, valid=valid, lengths=lengths))


def test_gdpo_matches_spec(run):
    x, ids, valid = batch(3)
    scores = np.stack([x, np.random.default_rng(4).normal(size=x.size)], -1).astype(np.float32)
    scores[~valid] = np.nan
    lengths = np.arange(1, x.size + 1).astype(np.float32)
    options = dict(valid=valid, weights=(1.0, 0.5), lengths=lengths)
    close(run("gdpo", scores, ids, **options), spec.reference_gdpo(scores, ids, **options))


def test_equal_scores_give_exactly_zero(run):
    x = np.full(8, 0.1, np.float32)  # 0.1 is not exact: a plain mean leaves a rounding
    for name in ("grpo", "rloo", "grpo_passk"):
        np.testing.assert_array_equal(run(name, x, group_size=4), np.zeros(8, np.float32))


def test_nan_in_a_valid_sample_poisons_its_group_only(run):
    x, ids, valid = batch(5)
    x[0] = np.nan  # group 7, valid
    for name, options in GROUP_CASES:
        out = run(name, x, ids, valid=valid, **options)
        in_group = (ids == 7) & valid
        assert np.isnan(out[in_group]).all(), name
        assert np.isfinite(out[~in_group]).all(), name


def test_all_invalid_and_empty(run):
    x = np.array([np.nan, 1.0, np.inf, 2.0], np.float32)
    out = run("grpo", x, group_size=2, valid=np.zeros(4, bool), scale="batch")
    np.testing.assert_array_equal(out, np.zeros(4, np.float32))
    empty = run("grpo", np.zeros(0, np.float32), np.zeros(0, np.int64))
    assert empty.shape == (0,)


def gae_inputs(seed: int = 0, rows: int = 5, steps: int = 37):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(rows, steps)).astype(np.float32)
    values = rng.normal(size=(rows, steps)).astype(np.float32)
    mask = rng.random((rows, steps)) > 0.3  # gaps: observation tokens inside a response
    mask[1] = False  # a row with no response token
    mask[2, :] = True
    rewards[~mask] = np.nan  # masked positions hold garbage that must never enter
    values[~mask] = np.inf
    return rewards, values, mask


def backends(framework: str):
    return ("native", "interpret") if framework == "torch" else ("native",)


@pytest.mark.parametrize("whiten", ["unbiased", "population", "none"])
def test_gae_matches_spec(run, whiten):
    rewards, values, mask = gae_inputs()
    expected = spec.reference_gae(rewards, values, mask, 0.97, 0.9, whiten=whiten)
    for backend in backends(run.framework):
        adv, ret = run("gae", rewards, values, mask, 0.97, 0.9, whiten=whiten, backend=backend)
        close(adv, expected[0])
        close(ret, expected[1])
        assert np.isfinite(adv).all() and np.isfinite(ret).all()


def test_reinforce_pp_matches_spec(run):
    rewards, _, mask = gae_inputs(1)
    expected = spec.reference_reinforce_pp(rewards, mask, 0.99)
    for backend in backends(run.framework):
        adv, ret = run("reinforce_pp", rewards, mask, 0.99, backend=backend)
        close(adv, expected[0])
        close(ret, expected[1])


def test_gae_nan_in_an_unmasked_token_stays_in_its_row():
    torch = pytest.importorskip("torch")
    from ratiokl.torch import advantages

    rewards, values, mask = (torch.from_numpy(a) for a in gae_inputs(2))
    rewards[0, torch.nonzero(mask[0])[-1]] = float("nan")
    for backend in ("native", "interpret"):
        _, ret = advantages.gae(rewards, values, mask, 1.0, 1.0, backend=backend)
        assert torch.isnan(ret[0][mask[0]]).all()
        assert torch.isfinite(ret[1:]).all()


def test_spread(run):
    mask = np.array([[1, 1, 0], [0, 1, 1]], bool)
    out = run("spread", np.array([2.0, -1.0], np.float32), mask)
    np.testing.assert_array_equal(out, np.array([[2, 2, 0], [0, -1, -1]], np.float32))


def test_errors_name_the_argument(run):
    x = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="exactly one of `group_ids`"):
        run("grpo", x)
    with pytest.raises(ValueError, match="`group_size` \\(4\\) must divide"):
        run("grpo", x, group_size=4)
    with pytest.raises(ValueError, match="`scale` must be one of"):
        run("grpo", x, group_size=2, scale="global")
    with pytest.raises(ValueError, match="`valid` must have shape \\[6\\]"):
        run("grpo", x, group_size=2, valid=np.ones(5, bool))
    with pytest.raises(TypeError, match="`group_ids` must be an integer"):
        run("grpo", x, np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="`lengths` is required"):
        run("opo", x, group_size=2)
    with pytest.raises(ValueError, match="`gamma` must be a Python number in \\[0, 1\\]"):
        run("gae", np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32),
            np.ones((2, 3), bool), 1.5, 0.9)
    with pytest.raises(ValueError, match="`backend` must be one of"):
        run("gae", np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32),
            np.ones((2, 3), bool), 0.9, 0.9, backend="cuda")


def test_jax_jit_traces_every_estimator():
    jax = pytest.importorskip("jax")
    from ratiokl.jax import advantages

    x, ids, valid = batch(6)
    lengths = np.arange(1, x.size + 1).astype(np.float32)
    jitted = jax.jit(lambda s, g, v, n: (advantages.grpo(s, g, valid=v, scale="batch"),
                                         advantages.rloo(s, g, valid=v),
                                         advantages.opo(s, g, valid=v, lengths=n)))
    grpo, rloo, opo = (np.asarray(a) for a in jitted(x, ids, valid, lengths))
    close(grpo, spec.reference_grpo(x, ids, valid=valid, scale="batch"))
    close(rloo, spec.reference_rloo(x, ids, valid=valid))
    close(opo, spec.reference_opo(x, ids, valid=valid, lengths=lengths))
    rewards, values, mask = gae_inputs(7)
    adv, ret = jax.jit(lambda r, v, m: advantages.gae(r, v, m, 0.99, 0.95))(rewards, values, mask)
    expected = spec.reference_gae(rewards, values, mask, 0.99, 0.95)
    close(np.asarray(adv), expected[0])
    close(np.asarray(ret), expected[1])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_docstrings_name_every_parameter_and_frameworks_agree(framework):
    import inspect

    module = Runner(framework).module
    other = Runner("jax" if framework == "torch" else "torch").module
    for name in module.__all__:
        function, twin = getattr(module, name), getattr(other, name)
        parameters = list(inspect.signature(function).parameters)
        assert parameters == list(inspect.signature(twin).parameters), name
        doc = inspect.getdoc(function)
        for parameter in parameters:
            assert f"\n  {parameter}:" in doc, (name, parameter)
        assert "Returns:" in doc and "``[...]``" in doc, name


@pytest.mark.parametrize("block_t", [8, None], ids=["tiles-8", "default"])
def test_gae_kernel_row_blocks_and_time_tiles(block_t, monkeypatch):
    """More rows than one program's block (``GAE_BLOCK_B``) with the last block part empty;
    time in several tiles with a ragged last one (the state carried across tiles) or in
    one; strided (non-contiguous) inputs."""
    torch = pytest.importorskip("torch")
    from ratiokl._kernels.gae import GAE_BLOCK_B
    from ratiokl.torch import advantages
    from ratiokl.torch._launch import gae as launch

    if block_t is not None:
        monkeypatch.setattr(launch, "GAE_BLOCK_T", block_t)
    rewards, values, mask = gae_inputs(8, rows=2 * GAE_BLOCK_B + 1, steps=37)
    wide = torch.zeros(rewards.shape[0], 2 * rewards.shape[1])
    wide[:, ::2] = torch.from_numpy(values)  # a view with column stride 2
    adv, ret = advantages.gae(torch.from_numpy(rewards), wide[:, ::2], torch.from_numpy(mask),
                              0.9, 0.8, backend="interpret")
    expected = spec.reference_gae(rewards, values, mask, 0.9, 0.8)
    close(adv.numpy(), expected[0])
    close(ret.numpy(), expected[1])
