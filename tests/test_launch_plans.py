"""Every launch plan the GPU can pick runs under Triton's interpreter in CI.

``launch_plans`` (tests/helpers) names the plans of each kernel and scans the
heuristics for the shapes at their boundaries (the GPU sweep's shapes). Here
the cheapest sweep shape of every plan the sweep reaches is run through the
``"interpret"`` backend -- which takes the GPU's plan, the span meeting
included -- and compared with the native path; a plan the sweep reaches that
no chosen shape takes fails the test. A shape of hundreds of rows (plans the GPU takes
only with that many) runs a 64th of them, with the heuristics' row thresholds divided by
64 too: the same plans (checked), a 64th of the interpreter's programs. The JAX launch of
the fused kernel is run on its meeting plan through JAX's ``backend="interpret"`` (its
grid checked). The fused kernel runs with and without an entropy bonus
(``entropy_coef``: another compile of pass 2), on rows whose last one masks half its
vocabulary with ``-inf``.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl._kernels import heuristics  # noqa: E402
from ratiokl._kernels.heuristics import launch_plan  # noqa: E402
from launch_plans import plans, sweep_rows, sweep_vocabularies  # noqa: E402

DTYPE = {4: torch.float32, 2: torch.bfloat16}
#: A shape of more rows than this runs ``1 / _ROW_SCALE`` of them, with the heuristics' row
#: thresholds (the forward's split below ``_SPLIT_BELOW_ROWS`` rows, the backward's
#: ``_BACKWARD_PROGRAMS``) divided by ``_ROW_SCALE`` as well (:func:`_scaled_rows`): a 1024-row
#: plan at 16 rows. A row's program runs the same code at any row count; the plans taken
#: are checked to be the shape's own. The interpreter's time goes with the programs, active
#: or not: the seven shapes of 528 and 1024 rows (16 of them active) took 70 s of CI here.
_SCALE_ABOVE = 256
_ROW_SCALE = 64


@functools.lru_cache(maxsize=None)
def _sweep_plans():
    """plan -> the cheapest (N * V) sweep shape ``(itemsize, V, N)`` that takes it."""
    cheapest = {}
    for itemsize in DTYPE:
        for vocab in sweep_vocabularies(itemsize):
            for n in sweep_rows(itemsize):
                for plan in plans(n, vocab, itemsize):
                    best = cheapest.get(plan)
                    if best is None or n * vocab < best[1] * best[2]:
                        cheapest[plan] = (itemsize, vocab, n)
    return cheapest


def _chosen():
    """Shape -> the kernels (plan heads) it is run for."""
    shapes = {}
    for plan, shape in _sweep_plans().items():
        shapes.setdefault(shape, set()).add(plan[:2] if plan[0] == "fused" else plan[:1])
    return sorted(shapes.items(), key=lambda kv: kv[0][1] * kv[0][2])


def test_every_sweep_plan_has_an_interpreted_shape():
    covered = set()
    for (itemsize, vocab, n), _ in _chosen():
        covered |= plans(n, vocab, itemsize)
    missing = set(_sweep_plans()) - covered
    assert not missing, f"plans the GPU sweep reaches but no interpreter test runs: {missing}"
    # The plans of the NaN-gradient bug (a row of one tile) and the span meeting are among them.
    kinds = {p[:3] for p in covered if p[0] == "fused"}
    assert ("fused", "grad", "row") in kinds and ("fused", "grad", "meeting") in kinds
    assert ("fused", "no-grad", "meeting") in kinds and ("fused", "no-grad", "row") in kinds


def _inputs(n: int, vocab: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    policy = (torch.randn(n, vocab, generator=g) * 2).to(dtype)
    ids = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.rand(n, generator=g) < 0.8
    mask[0] = True
    if n >= 3:  # an inactive row of garbage
        mask[1], ids[1] = False, -3
        policy[1] = float("nan")
    if vocab > 2:  # vocabulary masking on the last (active) row: -inf at even columns
        mask[-1], ids[-1] = True, 1
        policy[-1, ::2] = -float("inf")
    old = torch.randn(n, generator=g) * 0.3 - np.log(vocab) - 1.0
    return policy, ids, mask, old, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _run(backend, kernels, policy, ids, mask, old, adv, g):
    from ratiokl.torch import loss

    outs = {}
    if ("forward",) in kernels or ("backward",) in kernels:
        # The backward only where its plan is run here (the forward's does not depend on it).
        backward = ("backward",) in kernels
        leaf = policy.clone().requires_grad_(backward)
        logp = loss.selected_logprobs(leaf, ids, mask, backend=backend, check_ids=False)
        outs.update(logp=logp.detach())
        if backward:
            (logp * g).sum().backward()
            outs.update(logp_grad=leaf.grad)
    if ("fused", "grad") in kernels:
        for name, coef in (("loss", 0.0), ("entropy_loss", 0.05)):
            leaf = policy.clone().requires_grad_(True)
            value, metrics = loss.policy_loss(leaf, None, ids, mask, old, adv, backend=backend,
                                              check_ids=False, entropy_coef=coef)
            (value * -1.5).backward()
            outs.update({name: value.detach(), f"{name}_ratio_mean": metrics["ratio_mean"],
                         f"{name}_entropy_mean": metrics["entropy_mean"],
                         f"{name}_grad": leaf.grad})
    if ("fused", "no-grad") in kernels:
        with torch.no_grad():
            value, metrics = loss.policy_loss(policy, None, ids, mask, old, adv, backend=backend,
                                              check_ids=False)
        outs.update(primal=value, primal_ratio_mean=metrics["ratio_mean"],
                    primal_entropy_mean=metrics["entropy_mean"])
    return {k: v.float().numpy().astype(np.float64) for k, v in outs.items()}


def _head(plan):
    return plan[:2] if plan[0] == "fused" else plan[:1]


def _clear_row_caches():
    heuristics.backward_splits.cache_clear()
    heuristics.launch_plan.cache_clear()


@contextlib.contextmanager
def _scaled_rows(n: int):
    """Rows to run for a shape of ``n`` rows, with the heuristics' row thresholds divided
    by :data:`_ROW_SCALE` while the block runs when ``n`` is above :data:`_SCALE_ABOVE`
    (the row-dependent choices cached by the heuristics are dropped on the way in and out)."""
    if n <= _SCALE_ABOVE:
        yield n
        return
    mp = pytest.MonkeyPatch()
    try:
        for name in ("_SPLIT_BELOW_ROWS", "_BACKWARD_PROGRAMS"):
            mp.setattr(heuristics, name, getattr(heuristics, name) // _ROW_SCALE)
        _clear_row_caches()
        rows = n // _ROW_SCALE
        assert rows >= 3, f"{n} rows: too few left to carry the inactive and masked rows"
        yield rows
    finally:
        mp.undo()
        _clear_row_caches()


@pytest.mark.slow
@pytest.mark.parametrize("shape, kernels", _chosen(),
                         ids=[f"{'fp32' if s[0] == 4 else 'bf16'}-V{s[1]}-N{s[2]}"
                              for s, _ in _chosen()])
def test_plan_runs_on_the_interpreter(shape, kernels):
    itemsize, vocab, n = shape
    wanted = {p for p in plans(n, vocab, itemsize) if _head(p) in kernels}
    with _scaled_rows(n) as rows:
        taken = {p for p in plans.__wrapped__(rows, vocab, itemsize) if _head(p) in kernels}
        assert taken == wanted, f"{rows} rows stand in for {n}: plans {taken} != {wanted}"
        x = _inputs(rows, vocab, DTYPE[itemsize], seed=vocab + n)
        with np.errstate(all="ignore"):
            fast = _run("interpret", kernels, *x)
    slow = _run("native", kernels, *x)
    active = x[0][x[2]].float()
    scale = float(active[torch.isfinite(active)].abs().max())
    fwd = spec.forward_tolerance(scale)
    dtype = "float32" if itemsize == 4 else "bfloat16"
    for name, expected in slow.items():
        got = fast[name]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected), err_msg=name)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected), err_msg=name)
        if name.endswith("grad"):
            tol = spec.grad_tolerance(dtype, scale, np.abs(expected).max())
            assert np.all(got[~x[2].numpy()] == 0.0), f"{name}: inactive rows"
        else:
            tol = spec.Tolerance(rtol=fwd.rtol * 4, atol=fwd.atol)
        assert_close(got, expected, tol, name)


def test_jax_fused_meeting_plan_on_the_interpreter():
    """The JAX launch of the span meeting (a program per span) matches the PyTorch one, with
    an entropy bonus (its partials ride in the meeting's scratch)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import _interpret
    from ratiokl.jax import loss as jax_loss
    from ratiokl.torch import loss

    n, vocab = 3, 4 * 2048 + 5  # fp32: five spans of a 2048-column tile, the last ragged
    plan = launch_plan(vocab, 4, n, True)
    assert plan.row_programs == 5
    policy, ids, mask, old, adv, _ = _inputs(n, vocab, torch.float32, seed=7)
    leaf = policy.clone().requires_grad_(True)
    with np.errstate(all="ignore"):
        t_value, _ = loss.policy_loss(leaf, None, ids, mask, old, adv, backend="interpret",
                                      check_ids=False, entropy_coef=0.05)
        t_value.backward()
        t_value = t_value.detach()
        j = [jnp.asarray(t.numpy()) for t in (policy, ids, mask, old, adv)]
        objective = lambda p: jax_loss.policy_loss(  # noqa: E731
            p, None, *j[1:], backend="interpret", check_ids=False, entropy_coef=0.05)[0]
        with _interpret.recording() as launches:
            j_value, j_grad = jax.block_until_ready(jax.value_and_grad(objective)(j[0]))
    assert [launch.grid for launch in launches if launch.kernel == "policy_loss_kernel"] == [
        (plan.programs(n),)]  # a program per span
    # The same kernel and plan on both sides: each within the spec's bound.
    assert_close(j_value, t_value, spec.paths_tolerance(n), "loss")
    scale = float(policy[mask].abs().max())
    g_tol = spec.grad_tolerance("float32", scale, float(leaf.grad.abs().max()))
    assert_close(j_grad, leaf.grad, g_tol, "grad")
