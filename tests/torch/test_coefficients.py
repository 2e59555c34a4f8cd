"""Coefficients as 0-d tensors and per-row inputs with any strides, what only PyTorch has.

* ``torch.compile`` traces 0-d ``kl_coef`` and ``entropy_coef``: new values, no recompile;
* per-row inputs that flatten to a stride-0 view (per-sequence advantages of
  one sequence, expanded masks / ids / old log-probs) reach the kernels as
  contiguous rows.

(0-d coefficients' bits, ``0 * inf`` and errors on both frameworks:
tests/test_coefficients.py; ``check_ids=True`` under ``torch.compile``:
tests/torch/test_compile.py.)
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
