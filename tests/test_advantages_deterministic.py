"""The advantage estimators' group statistics are deterministic on every device.

A scatter-add (``index_add_``, ``scatter_add_``, ``scatter_reduce_``; JAX's
``segment_sum`` / ``segment_max``, the ``scatter-add`` / ``scatter-max`` primitives) adds in
the order CUDA's atomics land: the same inputs could give different bits run to run. The
estimators must call none of them (recorded on the CPU: the op is the same on a GPU), and
their results are bitwise the same for every order of the batch that keeps each group's
own order, and, for the estimators whose value depends on the group alone, whatever the
other groups hold. Each still matches the float64 spec.
"""

from __future__ import annotations

import numpy as np
import pytest

from ratiokl import spec

FRAMEWORKS = ("torch", "jax")
#: (estimator, options): those whose value depends on the sample's group alone ...
GROUP_LOCAL = [("grpo", {}), ("grpo", {"scale": "none"}), ("rloo", {}),
               ("rloo", {"singleton": "zero"}), ("opo", {"lengths": True}),
               ("grpo_passk", {})]
#: ... and those with a batch statistic too.
ESTIMATORS = GROUP_LOCAL + [("grpo", {"scale": "batch"}), ("gpg", {}),
                            ("reinforce_pp_baseline", {"lengths": True}),
                            ("gdpo", {"lengths": True, "columns": True})]


def _module(framework: str):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        from ratiokl.torch import advantages

        return advantages, torch.from_numpy
    jnp = pytest.importorskip("jax.numpy")
    from ratiokl.jax import advantages

    return advantages, jnp.asarray


def _batch(seed: int, groups: int = 9, size: int = 40):
    """Unsorted ids of groups of unequal sizes (singletons too), ties, invalid samples."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, groups, size=size).astype(np.int64) * 7 - 20
    scores = (rng.integers(0, 6, size=size) * 0.3 + rng.normal(size=size) * 0.1).astype(np.float32)
    scores[rng.random(size) < 0.2] = 0.6  # ties
    valid = rng.random(size) > 0.15
    scores[~valid] = np.nan
    lengths = rng.integers(1, 50, size=size).astype(np.float32)
    return ids, scores, valid, lengths


def _call(framework: str, name: str, options, ids, scores, valid, lengths) -> np.ndarray:
    module, to_array = _module(framework)
    options = dict(options)
    if options.pop("lengths", False):
        options["lengths"] = to_array(lengths)
    if options.pop("columns", False):
        scores = np.stack([scores, np.round(scores * 3.0) / 7.0], axis=1)  # per sample
    out = getattr(module, name)(to_array(scores), to_array(ids), valid=to_array(valid), **options)
    return np.asarray(out)


def _keeping_group_order(ids: np.ndarray, rng) -> np.ndarray:
    """A random order of the batch in which each group's samples keep their order."""
    slots = rng.permutation(ids.size)
    order = np.empty_like(slots)
    for group in np.unique(ids):
        members = np.flatnonzero(ids == group)
        order[np.sort(slots[members])] = members
    return order


def _label(case):
    return f"{case[0]}-{'-'.join(f'{k}={v}' for k, v in case[1].items())}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", ESTIMATORS, ids=_label)
def test_orders_keeping_each_groups_order_give_the_same_bits(framework, case):
    ids, scores, valid, lengths = _batch(0)
    expected = _call(framework, *case, ids, scores, valid, lengths)
    rng = np.random.default_rng(1)
    for _ in range(3):
        order = _keeping_group_order(ids, rng)
        got = _call(framework, *case, ids[order], scores[order], valid[order], lengths[order])
        np.testing.assert_array_equal(got, expected[order])


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("case", GROUP_LOCAL, ids=_label)
def test_a_groups_bits_do_not_depend_on_the_other_groups(framework, case):
    ids, scores, valid, lengths = _batch(2)
    whole = _call(framework, *case, ids, scores, valid, lengths)
    for group in np.unique(ids)[:4]:
        alone = ids == group
        got = _call(framework, *case, ids[alone], scores[alone], valid[alone], lengths[alone])
        np.testing.assert_array_equal(got, whole[alone])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_large_batch_matches_the_spec(framework):
    """B = 4096 in groups of 1 to 16 (every doubling step of the reduction), unsorted."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 17, size=600)
    ids = np.repeat(np.arange(sizes.size), sizes)[:4096]
    ids = rng.permutation(ids).astype(np.int64)
    scores = rng.normal(size=ids.size).astype(np.float32)
    valid = rng.random(ids.size) > 0.1
    got = _call(framework, "grpo", {}, ids, scores, valid, None)
    expected = spec.advantages.reference_grpo(scores, ids, valid=valid)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_torch_calls_no_scatter_add():
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            accumulate = "index_put" in func.__name__ and (
                kwargs.get("accumulate") or (len(args) > 3 and args[3]))
            self.ops.add(func.__name__ + (" (accumulate)" if accumulate else ""))
            return func(*args, **kwargs)

    ids, scores, valid, lengths = _batch(4)
    record = Record()
    with record:
        for case in ESTIMATORS:
            _call("torch", *case, ids, scores, valid, lengths)
    atomic = sorted(op for op in record.ops if "index_add" in op or "scatter_add" in op
                    or "scatter_reduce" in op or "accumulate" in op)
    assert atomic == [], f"ops that add through CUDA atomics: {atomic}"


def test_jax_lowers_to_no_scatter_add():
    jax = pytest.importorskip("jax")
    from ratiokl.jax import advantages

    def primitives(jaxpr):
        for equation in jaxpr.eqns:
            yield equation.primitive.name
            for param in equation.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from primitives(inner)

    ids, scores, valid, lengths = _batch(4)
    found = set()
    for name, options in ESTIMATORS:
        options = dict(options)
        length_arg = lengths if options.pop("lengths", False) else None
        x = np.stack([scores, scores], 1) if options.pop("columns", False) else scores
        kwargs = {} if length_arg is None else {"lengths": length_arg}

        def estimate(x, ids, valid, kwargs=kwargs, name=name, options=options):
            return getattr(advantages, name)(x, ids, valid=valid, **kwargs, **options)
        found |= set(primitives(jax.make_jaxpr(estimate)(x, ids, valid).jaxpr))
    atomic = sorted(p for p in found if p.startswith("scatter") and p != "scatter")
    assert atomic == [], f"primitives that add through GPU atomics: {atomic}"


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("align", ["position", "active"])
def test_optimal_token_baseline_same_bits_in_any_group_keeping_order(framework, align):
    """The per-step group sums of ``[B, T]`` too."""
    module, to_array = _module(framework)
    ids, _, valid, _ = _batch(5, size=24)
    rng = np.random.default_rng(6)
    shape = (ids.size, 11)
    mask = rng.random(shape) > 0.3
    arrays = [rng.normal(size=shape).astype(np.float32),
              -rng.random(shape).astype(np.float32), rng.random(shape).astype(np.float32)]

    def run(order):
        rewards, logps, spi = (a[order] for a in arrays)
        adv, _ = module.optimal_token_baseline(
            to_array(rewards), to_array(mask[order]), to_array(logps), to_array(spi),
            to_array(ids[order]), valid=to_array(valid[order]), align=align)
        return np.asarray(adv)

    expected = run(np.arange(ids.size))
    order = _keeping_group_order(ids, np.random.default_rng(7))
    np.testing.assert_array_equal(run(order), expected[order])
