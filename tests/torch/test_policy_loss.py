"""``ratiokl.torch.loss.policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``).

What only PyTorch has: a tensor ``loss_normalizer`` and ``torch.compile`` (the behaviours both frameworks share: ``tests/test_policy_loss_spec.py``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.torch import loss  # noqa: E402
from policy_runners import run_torch, torch_inputs  # noqa: E402
from policy_test_cases import B, T, V, make_inputs  # noqa: E402


def _run(x, options, *, backend="native", dtype=torch.float32, keys=()):
    return run_torch(x, options, backend=backend, dtype=str(dtype).removeprefix("torch."),
                     keys=keys)


def test_loss_normalizer_tensor_equals_float():
    x = make_inputs(seed=10)
    t = torch_inputs(x)
    args = (t["policy_logits"], t["ref_logits"], t["action_ids"], t["mask"], t["old_logps"],
            t["advantages"])
    a = loss.policy_loss(*args, loss_normalizer=12.0)[0]
    b = loss.policy_loss(*args, loss_normalizer=torch.tensor(12.0))[0]
    assert a.item() == b.item()


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager():
    """GSPO on packed rows with a straight-through KL: every ``[R, T]`` op traces."""
    t = torch_inputs(make_inputs(seed=16, per_token_adv=True))

    def fn(logits, *rest):
        value, metrics = loss.policy_loss(
            logits, *rest[:5], segment_ids=rest[5], ratio_level="sequence",
            loss_agg="seq-mean-token-mean", kl_coef=0.2, kl_estimator="k3+", dual_clip=2.0,
            backend="native", check_ids=False,
        )
        return value, metrics["clip_fraction"]

    args = [t[k] for k in ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps",
                           "advantages", "segment_ids")]
    compiled_value, compiled_clip = torch.compile(fn, fullgraph=True)(*args)
    (compiled_grad,) = torch.autograd.grad(compiled_value, args[0])
    value, clip = fn(*args)
    (grad,) = torch.autograd.grad(value, args[0])
    assert_close(compiled_value, value, spec.paths_tolerance(B * T), "loss")
    assert compiled_clip.item() == clip.item()
    g_max = float(grad.abs().max())
    assert_close(compiled_grad, grad, spec.paths_tolerance(V, g_max), "grad")
