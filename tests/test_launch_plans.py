"""Every launch plan the GPU can pick runs under Triton's interpreter in CI.

``ratiokl._kernels.plans`` names the plans of each kernel and scans the
heuristics for the shapes at their boundaries (the GPU sweep's shapes). Here
the cheapest sweep shape of every plan the sweep reaches is run through the
``"interpret"`` backend -- which takes the GPU's plan, the span meeting
included -- and compared with the native path; a plan the sweep reaches that
no chosen shape takes fails the test. The JAX launch of the fused kernel is run
on its meeting plan through JAX's ``backend="interpret"`` (its grid checked). The fused
kernel runs with and without an entropy bonus (``entropy_coef``: another
compile of pass 2), on rows whose last one masks half its vocabulary with
``-inf``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl import spec  # noqa: E402
from ratiokl._kernels.fused_loss import launch_plan  # noqa: E402
from ratiokl._kernels.plans import plans, sweep_rows, sweep_vocabularies  # noqa: E402

DTYPE = {4: torch.float32, 2: torch.bfloat16}
#: Above this many rows about 16 are active: the plans depend on the row count, not on how
#: many rows are active, and the interpreter's time on the active ones (an inactive row's
#: programs return at once). At N = 1024, 80 % active, four shapes took 90-110 s each.
_ALL_ACTIVE_UP_TO = 256


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
    if n > _ALL_ACTIVE_UP_TO:  # a plan depends on N alone: few active rows, a cheap run
        mask &= torch.arange(n) % (n // 16) == 0
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


@pytest.mark.slow
@pytest.mark.parametrize("shape, kernels", _chosen(),
                         ids=[f"{'fp32' if s[0] == 4 else 'bf16'}-V{s[1]}-N{s[2]}"
                              for s, _ in _chosen()])
def test_plan_runs_on_the_interpreter(shape, kernels):
    itemsize, vocab, n = shape
    x = _inputs(n, vocab, DTYPE[itemsize], seed=vocab + n)
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
        np.testing.assert_allclose(got, expected, rtol=tol.rtol, atol=tol.atol, err_msg=name)


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
    np.testing.assert_allclose(float(j_value), t_value.item(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(j_grad), leaf.grad.numpy(), rtol=1e-5, atol=1e-9)
