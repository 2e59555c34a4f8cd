"""float64 on the native backend: the logits ops and ``policy_objective`` compute in
float64 and pass ``torch.autograd.gradcheck`` at its default tolerances (issue 47, item 14).

The rule under test: float64 policy logits (``logps`` for ``policy_objective``) give float64
outputs, metrics and gradients, every other per-token input read in float64; the Triton
backends refuse float64 logits with an error naming the argument and ``backend='native'``;
the linear ops keep refusing float64 hidden states. Inactive rows hold NaN, +inf and a bad
id throughout: gradcheck perturbs them too, and nothing from them may reach a value or a
gradient.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from ratiokl.torch import loss

B, T, V = 2, 3, 5
_GEN = torch.Generator().manual_seed(47)
MASK = torch.tensor([[True, True, False], [True, False, True]])
IDS = torch.randint(0, V, (B, T), generator=_GEN).masked_fill(~MASK, V + 3)
OLD = (torch.randn(B, T, generator=_GEN, dtype=torch.float64) - 1.5).masked_fill(~MASK, math.nan)
ADV = torch.randn(B, T, generator=_GEN, dtype=torch.float64)
TEMP = torch.tensor([[0.7, 1.3, 2.0], [1.1, 0.9, 0.5]], dtype=torch.float64)


def _padded(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its inactive rows poisoned (NaN, +inf, -inf)."""
    x = x.clone()
    x[0, 2] = math.nan
    x[1, 1, 0], x[1, 1, 1] = math.inf, -math.inf
    return x


LOGITS = _padded(torch.randn(B, T, V, generator=_GEN, dtype=torch.float64))
REF = _padded(torch.randn(B, T, V, generator=_GEN, dtype=torch.float64))


def _leaf(x: torch.Tensor = LOGITS) -> torch.Tensor:
    return x.clone().requires_grad_()


#: name -> the op on float64 logits, returning a tuple of tensors (gradcheck's input).
OPS = {
    "selected_logprobs": lambda x: loss.selected_logprobs(x, IDS, MASK, backend="native"),
    "selected_logprobs_entropy_temperature": lambda x: loss.selected_logprobs(
        x, IDS, MASK, temperature=TEMP, return_entropy=True, backend="native"),
    "ratio_kl": lambda x: loss.ratio_kl(x, REF, IDS, MASK, OLD, backend="native"),
    "ratio_kl_k2_ref_logps": lambda x: loss.ratio_kl(
        x, None, IDS, MASK, OLD, ref_logps=OLD + 0.3, kl_estimator="k2", temperature=0.8,
        backend="native"),
    "policy_loss_kl": lambda x: loss.policy_loss(
        x, REF, IDS, MASK, OLD, ADV, kl_coef=0.1, backend="native")[0],
    "policy_loss_dual_clip_entropy_seq_mean": lambda x: loss.policy_loss(
        x, None, IDS, MASK, OLD, ADV[:, 0], clip_eps=0.05, dual_clip=3.0, entropy_coef=0.1,
        loss_agg="seq-mean-token-mean", temperature=TEMP, backend="native")[0],
    # GSPO's per-token loss holds sg(s_i) * pi_t / sg(pi_t): only an aggregate with one
    # advantage per sequence has the gradient that finite differences see.
    "policy_loss_gspo": lambda x: loss.policy_loss(
        x, REF, IDS, MASK, OLD, ADV[:, 0], ratio_level="sequence", kl_coef=0.05,
        backend="native")[0],
    "policy_loss_none_k2_clip_higher": lambda x: loss.policy_loss(
        x, REF, IDS, MASK, OLD, ADV, clip_eps_high=0.3, kl_coef=0.05, kl_estimator="k2",
        loss_agg="none", backend="native")[0],
}


@pytest.mark.parametrize("name", OPS)
def test_gradcheck_float64_native(name):
    """gradcheck at its default eps/atol/rtol, undefined output gradients included."""
    assert gradcheck(OPS[name], (_leaf(),), check_undefined_grad=True)


@pytest.mark.parametrize("name", OPS)
def test_float64_outputs_and_isolated_padding(name):
    x = _leaf()
    out = OPS[name](x)
    outs = out if isinstance(out, tuple) else (out,)
    assert all(o.dtype == torch.float64 for o in outs), [o.dtype for o in outs]
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    assert x.grad.dtype == torch.float64
    assert torch.isfinite(x.grad).all()
    assert bool((x.grad[~MASK] == 0).all()), "an inactive row reached the gradient"


def test_policy_loss_metrics_are_float64():
    _, metrics = loss.policy_loss(LOGITS, REF, IDS, MASK, OLD, ADV, kl_coef=0.1,
                                  backend="native")
    assert {m.dtype for m in metrics.values()} == {torch.float64}, metrics


def test_float64_logp_is_exact_in_float64():
    """Not float32 arithmetic in a float64 dress: logits offset by 1e4 lose their 1e-9
    differences in float32, not in float64."""
    x = torch.tensor([[1e4, 1e4 + 1e-6, 1e4 - 2e-6]], dtype=torch.float64)
    got = loss.selected_logprobs(x, torch.tensor([1]), backend="native")
    want = torch.log_softmax(x, -1)[:, 1]
    assert abs(float(got - want)) < 1e-10, (got, want)  # float32: off by about 1e-6


def test_float32_logits_with_float64_inputs_stay_float32():
    """The compute dtype follows the logits: float64 side inputs do not widen a float32 op."""
    ratio, kl = loss.ratio_kl(LOGITS.float(), REF, IDS, MASK, OLD, backend="native")
    value, metrics = loss.policy_loss(LOGITS.float(), None, IDS, MASK, OLD, ADV,
                                      backend="native")
    assert {ratio.dtype, kl.dtype, value.dtype, metrics["ratio_mean"].dtype} == {torch.float32}


def test_policy_objective_gradcheck_float64():
    logps = (OLD.nan_to_num(0.0) + 0.1 * ADV).requires_grad_()
    entropy = torch.rand(B, T, generator=_GEN, dtype=torch.float64).requires_grad_()

    def objective(lp, ent):
        return loss.policy_objective(lp, OLD, ADV, MASK, ref_logps=OLD + 0.2, kl_coef=0.1,
                                     entropy=ent, entropy_coef=0.1, clip_eps=0.05)[0]

    assert gradcheck(objective, (logps, entropy), check_undefined_grad=True)


def test_policy_objective_float64_keeps_float64():
    """A float64 ``logps`` near 1e4 keeps its 1e-9 offsets: float32 would round them away."""
    old = torch.full((1, 2), -1e4, dtype=torch.float64)
    logps = old + torch.tensor([[1e-9, 3e-9]], dtype=torch.float64)
    value, metrics = loss.policy_objective(logps, old, torch.ones(1, 2, dtype=torch.float64),
                                           torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2)
    assert value.dtype == torch.float64 and metrics["approx_kl"].dtype == torch.float64
    assert abs(float(value) + math.exp(2e-9)) < 1e-12, float(value)  # float32: 2e-9


@pytest.mark.parametrize("op,arg", [
    (lambda x, b: loss.selected_logprobs(x, IDS, MASK, backend=b), "logits"),
    (lambda x, b: loss.ratio_kl(x, REF.float(), IDS, MASK, OLD, backend=b), "policy_logits"),
    (lambda x, b: loss.ratio_kl(x.float(), REF, IDS, MASK, OLD, backend=b), "ref_logits"),
    (lambda x, b: loss.policy_loss(x, None, IDS, MASK, OLD, ADV, backend=b), "policy_logits"),
])
def test_triton_backends_refuse_float64(op, arg):
    pytest.importorskip("triton")
    with pytest.raises(TypeError, match=rf"`{arg}` is float64.*backend='interpret'"
                                        r".*backend='native'"):
        op(LOGITS, "interpret")


def test_linear_ops_refuse_float64_hidden_clearly():
    hidden = torch.randn(B, T, 4, dtype=torch.float64)
    weight = torch.randn(V, 4, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`hidden` must be float32, float16 or bfloat16"
                                        r".*got torch.float64.*\.float\(\)"):
        loss.linear_selected_logprobs(hidden, weight, IDS, MASK, backend="native")


def test_vocab_group_refuses_float64(tmp_path):
    """The vocabulary-parallel path computes in float32: float64 logits are refused there,
    naming the argument and the keyword (a one-rank gloo group)."""
    import torch.distributed as dist

    if not dist.is_gloo_available():
        pytest.skip("torch built without gloo")
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
    try:
        with pytest.raises(TypeError, match=r"`logits` is float64, which `vocab_group`"):
            loss.selected_logprobs(LOGITS, IDS, MASK, backend="native",
                                   vocab_group=dist.group.WORLD)
    finally:
        if owned:
            dist.destroy_process_group()
