"""Coefficients as 0-d tensors and per-row inputs with any strides.

* ``kl_coef``, ``clip_eps``, ``clip_eps_high`` and ``entropy_coef`` given as 0-d
  tensors give the bits of the same Python numbers on every backend (the fused
  kernel reads them as run-time data), a tensor ``kl_coef = 0`` keeps an infinite
  KL out (``0 * inf``), a tensor ``entropy_coef = 0`` gives the fused kernel's bits
  of the number 0, and ``torch.compile`` traces them: new values, no recompile;
* per-row inputs that flatten to a stride-0 view (per-sequence advantages of
  one sequence, expanded masks / ids / old log-probs) reach the kernels as
  contiguous rows.

(``check_ids=True`` under ``torch.compile``: tests/torch/test_compile.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None
BACKENDS = ["native"] + (["interpret"] if HAS_TRITON else [])
B, T, V = 2, 5, 23
#: Two paths of one float32 loss (or metric): sums of up to B*T per-token terms.
LOSS_TOL = spec.paths_tolerance(B * T)


def _grad_tol(grad):
    """Two paths of one float32 policy-logit gradient (each row's sums run over V)."""
    return spec.paths_tolerance(V, float(grad.abs().max()))


#: Inactive rows hold data the kernels never use; the interpreter's numpy warns on it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _inputs(seed: int, batch: int = B):
    g = torch.Generator().manual_seed(seed)
    return dict(
        logits=torch.randn(batch, T, V, generator=g) * 2,
        ref=torch.randn(batch, T, V, generator=g),
        ids=torch.randint(0, V, (batch, T), generator=g),
        mask=torch.rand(batch, T, generator=g) < 0.8,
        old=torch.randn(batch, T, generator=g) * 0.3 - 3.0,
        adv=torch.randn(batch, T, generator=g),
    )


def _loss_and_grad(x, backend: str, **options):
    logits = x["logits"].clone().requires_grad_()
    value, metrics = loss.policy_loss(logits, x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                                      backend=backend, **options)
    value.backward()
    return value.detach(), {k: v.item() for k, v in metrics.items()}, logits.grad


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_coefficients_give_the_bits_of_numbers(backend: str) -> None:
    x = _inputs(0)
    numbers = dict(kl_coef=0.05, clip_eps=0.1, clip_eps_high=0.15, dual_clip=3.0,
                   entropy_coef=0.02)
    tensors = dict(numbers, kl_coef=torch.tensor(0.05), clip_eps=torch.tensor(0.1),
                   clip_eps_high=torch.tensor(0.15), entropy_coef=torch.tensor(0.02))
    want, want_metrics, want_grad = _loss_and_grad(x, backend, **numbers)
    got, got_metrics, got_grad = _loss_and_grad(x, backend, **tensors)
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert got_metrics == want_metrics
    assert want_metrics["clip_fraction"] > 0  # the clip bounds took part


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_tensor_kl_coef_keeps_an_infinite_kl_out(backend: str) -> None:
    x = _inputs(1)
    x["ref"][x["mask"]] = x["ref"][x["mask"]].index_fill(-1, torch.tensor([0]), -float("inf"))
    x["ids"][x["mask"]] = 0  # the reference gives the action probability 0: the KL is inf
    unbounded = dict(log_ratio_bound=None)  # else |d| is bounded before k3's exp
    value, metrics, grad = _loss_and_grad(x, backend, kl_coef=torch.tensor(0.0), **unbounded)
    want, _, want_grad = _loss_and_grad(x, backend, kl_coef=0.0, **unbounded)
    assert metrics["kl_mean"] == float("inf")
    assert torch.isfinite(value) and torch.equal(value, want)
    assert torch.isfinite(grad).all() and torch.equal(grad, want_grad)


def test_a_zero_tensor_entropy_coef_gives_the_fused_bits_of_the_number_zero() -> None:
    """The kernel compiled for a tensor coefficient (it may be non-zero) adds exactly
    nothing at 0: the loss, the metrics and the gradient of ``entropy_coef=0.0``."""
    pytest.importorskip("triton")
    x = _inputs(6)
    x["logits"][0, 0, ::2] = -float("inf")  # masked vocabulary: p = 0 columns
    x["mask"][0, 0] = True
    x["ids"][0, 0] = 1
    want, want_metrics, want_grad = _loss_and_grad(x, "interpret", entropy_coef=0.0)
    got, got_metrics, got_grad = _loss_and_grad(x, "interpret",
                                                entropy_coef=torch.tensor(0.0))
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert got_metrics == want_metrics and want_metrics["entropy_mean"] > 0
    bonus, _, bonus_grad = _loss_and_grad(x, "interpret", entropy_coef=torch.tensor(0.5))
    assert not torch.equal(bonus_grad, want_grad) and torch.isfinite(bonus_grad).all()
    # token-mean: agg(H) = entropy_mean
    assert_close(bonus, want.item() - 0.5 * want_metrics["entropy_mean"], LOSS_TOL, "loss")


def test_a_coefficient_must_be_a_number_or_a_0d_float_tensor() -> None:
    x = _inputs(2)
    with pytest.raises(TypeError, match="`kl_coef` must be a Python number or a 0-d"):
        loss.policy_loss(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                         kl_coef=torch.tensor([0.1, 0.2]), backend="native")
    with pytest.raises(TypeError, match="`kl_coef` must be .* 0-d floating tensor/array; got list"):
        loss.policy_loss(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                         kl_coef=[0.1], backend="native")
    with pytest.raises(TypeError, match="`clip_eps` must be a Python number or a 0-d"):
        loss.policy_loss(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                         clip_eps=torch.tensor(1), backend="native")
    with pytest.raises(TypeError, match="`entropy_coef` must be a Python number or a 0-d"):
        loss.policy_loss(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                         entropy_coef=torch.tensor(1), backend="native")
    with pytest.raises(ValueError, match="`ratio_cap` needs Python-number clip bounds"):
        loss.policy_loss(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                         clip_eps_high=torch.tensor(0.2), ratio_cap=3.0, backend="native")


def test_compiled_step_traces_kl_coef_without_recompiling() -> None:
    torch._dynamo.reset()
    frames = []

    def count(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def step(logits, ref, ids, mask, old, adv, kl_coef):
        value, _ = loss.policy_loss(logits, ref, ids, mask, old, adv, kl_coef=kl_coef,
                                    backend="native", check_ids=False)
        return value

    compiled = torch.compile(step, fullgraph=True, backend=count)
    x = _inputs(3)
    for coef in (0.0, 0.01, 0.1, 0.5):
        kl_coef = torch.tensor(coef)
        got = compiled(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"], kl_coef)
        want = step(x["logits"], x["ref"], x["ids"], x["mask"], x["old"], x["adv"], coef)
        assert_close(got, want, LOSS_TOL, "loss")
    assert len(frames) == 1, f"{len(frames)} compiles for 4 values of kl_coef"


@pytest.mark.parametrize("backend, grad", [("native", True)] + (
    [("interpret", False), ("interpret", True)] if HAS_TRITON else []),
    ids=lambda v: str(v))
def test_compiled_step_traces_entropy_coef_without_recompiling(backend: str, grad: bool) -> None:
    """A schedule of ``entropy_coef`` as a 0-d tensor: one graph for every value, on the
    two-pass route (a gradient) and the fused kernel (no gradient: the forward alone)."""
    torch._dynamo.reset()
    frames = []

    def count(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    def step(logits, ref, ids, mask, old, adv, entropy_coef):
        value, metrics = loss.policy_loss(logits, ref, ids, mask, old, adv, kl_coef=0.1,
                                          entropy_coef=entropy_coef, backend=backend,
                                          check_ids=False)
        return value, metrics["entropy_mean"]

    compiled = torch.compile(step, fullgraph=True, backend=count)
    x = _inputs(7)
    rows = (x["ref"], x["ids"], x["mask"], x["old"], x["adv"])
    for coef in (0.0, 0.001, 0.01, -0.05):
        logits = x["logits"].clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            got = compiled(logits, *rows, torch.tensor(coef))
            want = step(x["logits"].clone().requires_grad_(grad), *rows, coef)
        for what, a, b in zip(("loss", "entropy_mean"), got, want):
            assert_close(a, b, LOSS_TOL, what)
        if grad:
            (g_got,) = torch.autograd.grad(got[0], logits)
            leaf = x["logits"].clone().requires_grad_()
            (g_want,) = torch.autograd.grad(step(leaf, *rows, coef)[0], leaf)
            assert_close(g_got, g_want, _grad_tol(g_want), "grad")
    assert len(frames) == 1, f"{len(frames)} compiles for 4 values of entropy_coef"


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_inputs_with_stride_zero_reach_the_kernels_as_rows(backend: str) -> None:
    """One sequence: per-sequence advantages, and expanded mask / ids / old log-probs,
    flatten to stride-0 views; every backend must read them as the dense inputs."""
    x = _inputs(5, batch=1)
    dense = _loss_and_grad(x, "native", kl_coef=0.1)
    x_adv = dict(x, adv=torch.tensor([0.7]))
    dense_adv = _loss_and_grad(dict(x, adv=torch.full((1, T), 0.7)), "native", kl_coef=0.1)
    got_adv = _loss_and_grad(x_adv, backend, kl_coef=0.1)
    assert_close(got_adv[0], dense_adv[0], LOSS_TOL, "loss")
    assert_close(got_adv[2], dense_adv[2], _grad_tol(dense_adv[2]), "grad")
    expanded = dict(x, ids=x["ids"][:, :1].expand(1, T), mask=torch.ones(1, 1).bool().expand(1, T),
                    old=x["old"][:, :1].expand(1, T))
    want = _loss_and_grad({k: v.contiguous() for k, v in expanded.items()}, "native",
                          kl_coef=0.1)
    got = _loss_and_grad(expanded, backend, kl_coef=0.1)
    assert_close(got[0], want[0], LOSS_TOL, "loss")
    assert_close(got[2], want[2], _grad_tol(want[2]), "grad")
    logp = loss.selected_logprobs(x["logits"], expanded["ids"], expanded["mask"],
                                  backend=backend)
    want_logp = loss.selected_logprobs(x["logits"], expanded["ids"].contiguous(),
                                       expanded["mask"].contiguous(), backend="native")
    logit_tol = spec.paths_tolerance(V, float(x["logits"].abs().max()))
    assert_close(logp, want_logp, logit_tol, "logp")
    assert not np.isclose(dense[0].item(), got[0].item())  # the expansion changed the inputs
