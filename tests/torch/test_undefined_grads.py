"""Every ``torch.autograd.Function`` behind ``ratiokl.torch.loss`` handles undefined output
gradients, as ``torch.autograd.gradcheck`` requires (``check_undefined_grad=True``, its
default), and backpropagates through any one of several outputs alone.

gradcheck needs float64, which only the native logits ops take (``tests/torch/
test_float64.py`` runs it there); for every backend and the linear ops (float32) its
undefined-gradient check is run directly (:func:`_undefined_grads`, the same two steps:
every output's gradient undefined, then each output's in turn), and the gradient through one
output alone is compared with a float64 autograd reference. ``policy_objective`` (plain
autograd ops, no Function of its own) runs the whole gradcheck here.

Reached through the public functions, on ``native`` and ``interpret``: ``_native``'s two
Functions, the Triton binding's generated ones (``_launch``: log-probs, entropy, the fused
loss), ``_InplaceLoss``, ``_BackwardOnce``, the linear ops' (``_LinearLogprobs``,
``_LinearLoss``, ``_HeadLogits``) and the vocabulary-parallel ones (``_AttachGrad``, the
linear ops' ``d hidden`` all-reduce) on a one-rank gloo group.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist

from ratiokl.spec import Tolerance
from ratiokl.torch import loss
from tests.helpers.assertions import assert_close

B, T, H, V = 2, 3, 4, 5

BACKENDS = ["native", pytest.param("interpret", marks=pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"))]

#: float32 results against float64 autograd on O(1) values of 5-token rows.
TOL = Tolerance(rtol=1e-5, atol=2e-6)

_GEN = torch.Generator().manual_seed(0)
IDS = torch.randint(0, V, (B, T), generator=_GEN)
MASK = torch.tensor([[True, True, False], [True, True, True]])
OLD = torch.randn(B, T, generator=_GEN) - 1.0
ADV = torch.randn(B, T, generator=_GEN)
LOGITS = torch.randn(B, T, V, generator=_GEN)
REF = torch.randn(B, T, V, generator=_GEN)
HIDDEN = torch.randn(B, T, H, generator=_GEN)
WEIGHT = torch.randn(V, H, generator=_GEN)
BIAS = torch.randn(V, generator=_GEN)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group: the vocabulary-parallel Functions with every row owned here."""
    if not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _logp_entropy64(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(logp, entropy)`` by plain autograd ops; 0 on inactive rows."""
    z = logits.double()
    lse = z.logsumexp(-1)
    logp = z.gather(-1, IDS[..., None])[..., 0] - lse
    ent = lse - (z.softmax(-1) * z).sum(-1)
    return torch.where(MASK, logp, 0.0), torch.where(MASK, ent, 0.0)


def _ratio_kl64(logits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    logp = _logp_entropy64(logits)[0]
    d = _logp_entropy64(REF)[0] - logp
    return (torch.where(MASK, (logp - OLD.double()).exp(), 1.0),
            torch.where(MASK, d.exp() - d - 1.0, 0.0))


def _linear64(hidden, weight, bias=None) -> Tuple[torch.Tensor, torch.Tensor]:
    logits = hidden.double() @ weight.double().t()
    return _logp_entropy64(logits if bias is None else logits + bias.double())


#: name -> (inputs, the op's differentiable outputs from (backend, group, *inputs), its
#: float64 reference from the inputs, or None for a loss: one output, checked elsewhere).
OPS: Dict[str, Tuple[Tuple[torch.Tensor, ...], Callable, Optional[Callable]]] = {
    "selected_logprobs": ((LOGITS,), lambda b, g, x: (loss.selected_logprobs(
        x, IDS, MASK, backend=b, vocab_group=g),), lambda x: _logp_entropy64(x)[:1]),
    "selected_logprobs_entropy": ((LOGITS,), lambda b, g, x: loss.selected_logprobs(
        x, IDS, MASK, backend=b, vocab_group=g, return_entropy=True), _logp_entropy64),
    "ratio_kl": ((LOGITS,), lambda b, g, x: loss.ratio_kl(
        x, REF, IDS, MASK, OLD, backend=b, vocab_group=g), _ratio_kl64),
    "policy_loss": ((LOGITS,), lambda b, g, x: loss.policy_loss(
        x, REF, IDS, MASK, OLD, ADV, kl_coef=0.1, backend=b, vocab_group=g)[:1], None),
    "policy_loss_entropy_gspo": ((LOGITS,), lambda b, g, x: loss.policy_loss(
        x, None, IDS, MASK, OLD, ADV, entropy_coef=0.1, ratio_level="sequence", backend=b,
        vocab_group=g)[:1], None),
    "linear_selected_logprobs": ((HIDDEN, WEIGHT), lambda b, g, h, w: (
        loss.linear_selected_logprobs(h, w, IDS, MASK, backend=b, vocab_group=g),),
        lambda h, w: _linear64(h, w)[:1]),
    "linear_selected_logprobs_entropy_bias": ((HIDDEN, WEIGHT, BIAS), lambda b, g, h, w, c: (
        loss.linear_selected_logprobs(h, w, IDS, MASK, bias=c, backend=b, vocab_group=g,
                                      return_entropy=True)), _linear64),
    "linear_policy_loss": ((HIDDEN, WEIGHT), lambda b, g, h, w: loss.linear_policy_loss(
        h, w, IDS, MASK, OLD, ADV, backend=b, vocab_group=g)[:1], None),
}


def _leaves(inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    return tuple(t.clone().requires_grad_() for t in inputs)


def _undefined_grads(fn: Callable, inputs: Tuple[torch.Tensor, ...]) -> None:
    """gradcheck's undefined-gradient check: the backward runs with every output's gradient
    undefined, then (several outputs) with each one's in turn, each time on a fresh
    forward; with every gradient undefined or zero, every input's gradient is None or 0."""
    undefined = torch._C._functions.UndefinedGrad()
    count = len(fn(*inputs))
    for which in [None, *(range(count) if count > 1 else [])]:
        outputs = [undefined(o) if which in (None, i) else o
                   for i, o in enumerate(fn(*inputs))]
        grads = torch.autograd.grad(outputs, inputs, [torch.zeros_like(o) for o in outputs],
                                    allow_unused=True)
        for name, grad in zip(("first", "second", "third"), grads):
            assert grad is None or bool(grad.eq(0).all()), \
                f"undefined output gradients (which={which}) gave a nonzero {name} gradient"


def _call(name: str, backend: str, vocab_group) -> Tuple[Tuple[torch.Tensor, ...], Callable]:
    inputs, op, _ = OPS[name]
    if backend != "native":
        pytest.importorskip("triton")
    return _leaves(inputs), lambda *args: tuple(op(backend, vocab_group, *args))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_undefined_output_gradients(name, backend):
    inputs, fn = _call(name, backend, None)
    _undefined_grads(fn, inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OPS)
def test_undefined_output_gradients_vocab_parallel(name, backend, group):
    inputs, fn = _call(name, backend, group)
    _undefined_grads(fn, inputs)


def test_inplace_grad_loss_handles_undefined_gradients():
    pytest.importorskip("triton")
    _undefined_grads(lambda x: loss.policy_loss(x * 1.0, REF, IDS, MASK, OLD, ADV,
                                                backend="interpret", inplace_grad=True)[:1],
                     _leaves((LOGITS,)))


ONE_OUTPUT = [(name, k) for name, (_, _, ref) in OPS.items() if ref is not None
              for k in range(len(ref(*OPS[name][0])))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,output", ONE_OUTPUT)
def test_backward_through_one_output_alone(name, output, backend):
    """The other outputs unused (their gradients None): the gradient of a weighted sum of
    this one matches float64 autograd's."""
    inputs, fn = _call(name, backend, None)
    reference = OPS[name][2]
    weights = torch.linspace(-1.0, 2.0, B * T).reshape(B, T)
    got = torch.autograd.grad((fn(*inputs)[output] * weights).sum(), inputs)
    leaves64 = tuple(t.detach().double().requires_grad_() for t in inputs)
    want = torch.autograd.grad((reference(*leaves64)[output] * weights.double()).sum(),
                               leaves64)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, TOL, f"{name} output {output}: d/d input {i}")


def test_policy_objective_passes_gradcheck():
    """float64 log-probs: the whole gradcheck at its default tolerances, undefined-gradient
    check included (float64 log-probs are computed in float64)."""
    logps = (OLD.double() + 0.1 * ADV.double()).requires_grad_()
    entropy = torch.rand(B, T, generator=_GEN, dtype=torch.float64).requires_grad_()

    def objective(lp, ent):
        return loss.policy_objective(lp, OLD.double(), ADV.double(), MASK, entropy=ent,
                                     entropy_coef=0.1)[0]

    assert torch.autograd.gradcheck(objective, (logps, entropy), check_undefined_grad=True)
