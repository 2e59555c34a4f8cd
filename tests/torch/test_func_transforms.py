"""``torch.func`` transforms (``grad``, ``vjp``, ``vmap`` and per-example gradients
``vmap(grad)``) over the logits ops and ``policy_objective``, against plain autograd.

``selected_logprobs`` (with and without the entropy), ``ratio_kl`` and ``policy_loss`` (the
one-kernel loss on ``interpret``, the two-pass route for GSPO) on ``native`` and
``interpret``, with the host id check on (under ``vmap`` it checks every example's ids
together; off: the bad row is NaN). What stays refused says so: the ops from hidden
states, ``vocab_group`` and ``inplace_grad=True`` inside a transform.
"""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
import torch.distributed as dist

from ratiokl.spec import Tolerance
from ratiokl.torch import loss
from tests.helpers.assertions import assert_close

B, T, H, V = 2, 3, 4, 5

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.filterwarnings(
    "ignore::RuntimeWarning", "ignore::UserWarning"))]

#: A transform runs the same kernels on the same rows as the plain call: equal up to the
#: summation order of a batch folded into rows.
TOL = Tolerance(rtol=1e-6, atol=1e-7)

_GEN = torch.Generator().manual_seed(0)
LOGITS = torch.randn(B, T, V, generator=_GEN)
IDS = torch.randint(0, V, (B, T), generator=_GEN)
MASK = torch.tensor([[True, True, False], [True, True, True]])
OLD = torch.randn(B, T, generator=_GEN) - 1.0
ADV = torch.randn(B, T, generator=_GEN)

#: name -> per-token (or 0-d) output from (backend, check_ids, logits, ids, mask, old, adv);
#: the reference logits are the policy's, halved and detached (batched with them by vmap).
OPS: Dict[str, Callable] = {
    "selected_logprobs": lambda b, c, x, i, m, o, a: loss.selected_logprobs(
        x, i, m, backend=b, check_ids=c) * a,
    "selected_logprobs_entropy": lambda b, c, x, i, m, o, a: loss.selected_logprobs(
        x, i, m, backend=b, check_ids=c, return_entropy=True)[1] * a,
    "ratio_kl": lambda b, c, x, i, m, o, a: sum(loss.ratio_kl(
        x, 0.5 * x.detach(), i, m, o, kl_estimator="k2", backend=b, check_ids=c)) * a,
    "policy_loss": lambda b, c, x, i, m, o, a: loss.policy_loss(
        x, 0.5 * x.detach(), i, m, o, a, kl_coef=0.1, entropy_coef=0.01, backend=b,
        check_ids=c)[0],
    "policy_loss_gspo": lambda b, c, x, i, m, o, a: loss.policy_loss(
        x, None, i, m, o, a, ratio_level="sequence", backend=b, check_ids=c)[0],
}


def _op(name: str, backend: str, check_ids: bool) -> Callable:
    if backend != "native":
        pytest.importorskip("triton")
    op = OPS[name]
    return lambda *args: op(backend, check_ids, *args)


def _plain_grad(f: Callable, x: torch.Tensor, *rest) -> torch.Tensor:
    leaf = x.clone().requires_grad_()
    return torch.autograd.grad(f(leaf, *rest).sum(), leaf)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_grad_and_vjp_match_autograd(name, backend):
    f = _op(name, backend, True)
    args = (IDS, MASK, OLD, ADV)
    want = _plain_grad(f, LOGITS, *args)
    assert_close(torch.func.grad(lambda x: f(x, *args).sum())(LOGITS), want, TOL, "grad")
    out, vjp = torch.func.vjp(lambda x: f(x, *args), LOGITS)
    assert_close(out, f(LOGITS, *args), TOL, "vjp's value")
    assert_close(vjp(torch.ones_like(out))[0], want, TOL, "vjp")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_vmap_and_per_example_grad_match_a_loop(name, backend):
    """Each sequence as its own example ``[1, T, ...]``: ``vmap`` and ``vmap(grad)`` equal
    the op called on each in turn."""
    f = _op(name, backend, True)

    def one(x, i, m, o, a):
        return f(x[None], i[None], m[None], o[None], a[None])

    args = (LOGITS, IDS, MASK, OLD, ADV)
    examples = [tuple(t[k] for t in args) for k in range(B)]
    assert_close(torch.func.vmap(one)(*args), torch.stack([one(*e) for e in examples]), TOL,
                 "vmap")
    per_example = torch.func.vmap(torch.func.grad(lambda *e: one(*e).sum()))(*args)
    want = torch.stack([_plain_grad(lambda x, *r: one(x, *r), *e) for e in examples])
    assert_close(per_example, want, TOL, "vmap(grad)")


@pytest.mark.parametrize("backend", BACKENDS)
def test_jacrev_matches_autograd(backend):
    f = _op("selected_logprobs_entropy", backend, True)
    args = (IDS, MASK, OLD, ADV)
    want = torch.autograd.functional.jacobian(lambda x: f(x, *args), LOGITS)
    assert_close(torch.func.jacrev(lambda x: f(x, *args))(LOGITS), want, TOL, "jacrev")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_id_check_under_vmap_names_the_example(backend):
    """``check_ids=True`` under ``vmap``: every example's ids checked at once, the position
    named with the vmapped axis first (example 1, then ``[0, 2]`` of its ``[1, T]``);
    under ``grad`` as outside. ``check_ids=False``: the bad row is NaN."""
    f = _op("selected_logprobs", backend, True)
    bad = IDS.clone()
    bad[1, 2] = V
    with pytest.raises(ValueError, match=r"action_ids\[1, 0, 2\] = 5 is outside"):
        torch.func.vmap(lambda x, i: f(x[None], i[None], MASK[1:], OLD[1:], ADV[1:]))(
            LOGITS, bad)
    with pytest.raises(ValueError, match=r"action_ids\[1, 2\] = 5 is outside"):
        torch.func.grad(lambda x: f(x, bad, MASK, OLD, ADV).sum())(LOGITS)
    out = torch.func.vmap(lambda x, i: _op("selected_logprobs", backend, False)(
        x[None], i[None], MASK[1:], OLD[1:], ADV[1:])[0])(LOGITS, bad)
    assert torch.isnan(out[1, 2]) and not torch.isnan(out[0]).any()


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_policy_objective_under_torch_func(transform):
    """``policy_objective`` is plain autograd ops: ``grad`` and ``vmap`` give autograd's."""
    logps = OLD + 0.1 * ADV

    def objective(lp, o, a, m):
        return loss.policy_objective(lp, o, a, m, kl_coef=0.0)[0]

    if transform == "grad":
        leaf = logps.clone().requires_grad_()
        want = torch.autograd.grad(objective(leaf, OLD, ADV, MASK), leaf)[0]
        assert_close(torch.func.grad(objective)(logps, OLD, ADV, MASK), want, TOL, "grad")
    else:
        rows = lambda *t: objective(*(u[None] for u in t))  # noqa: E731
        want = torch.stack([rows(logps[k], OLD[k], ADV[k], MASK[k]) for k in range(B)])
        assert_close(torch.func.vmap(rows)(logps, OLD, ADV, MASK), want, TOL, "vmap")


LINEAR = {
    "linear_selected_logprobs": lambda b, x, w: loss.linear_selected_logprobs(
        x, w, IDS, MASK, backend=b).sum(),
    "linear_policy_loss": lambda b, x, w: loss.linear_policy_loss(
        x, w, IDS, MASK, OLD, ADV, backend=b)[0],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", LINEAR)
def test_the_ops_from_hidden_states_refuse_a_transform(name, backend):
    if backend != "native":
        pytest.importorskip("triton")
    hidden, weight = torch.randn(B, T, H), torch.randn(V, H)
    with pytest.raises(RuntimeError, match=r"do not support torch\.func transforms.*"
                       r"loss\.backward\(\).*selected_logprobs, ratio_kl, policy_loss"):
        torch.func.grad(lambda x: LINEAR[name](backend, x, weight))(hidden)
    LINEAR[name](backend, hidden, weight)  # outside the transform the same call runs


def test_inplace_grad_inside_a_transform_is_refused():
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match=r"inplace_grad=True.*torch\.func.*inplace_grad=False"):
        torch.func.grad(lambda x: loss.policy_loss(x, None, IDS, MASK, OLD, ADV,
                                                   backend="interpret", inplace_grad=True)[0]
                        )(LOGITS)


def test_vocab_group_inside_a_transform_is_refused(tmp_path):
    if not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs gloo and no process group of this process's own")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"`vocab_group` is not supported inside "
                                               r"torch\.func"):
            torch.func.grad(lambda x: loss.selected_logprobs(
                x, IDS, MASK, vocab_group=dist.group.WORLD).sum())(LOGITS)
    finally:
        dist.destroy_process_group()
