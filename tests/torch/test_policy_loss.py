"""``ratiokl.torch.loss.policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``).

All-inactive and empty batches, inactive garbage, ``ref_logps``, argument errors, the
interpreter and ``torch.compile`` (each option, packed rows, per-token advantages and
16-bit logits against the spec, for both frameworks: ``tests/test_policy_loss_spec.py``).
Mirrors ``tests/jax/test_policy_loss.py``.
"""

from __future__ import annotations

import numpy as np
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


def test_ref_logps_instead_of_ref_logits():
    x = make_inputs(seed=4)
    t = torch_inputs(x)
    ref_logps = loss.selected_logprobs(t["ref_logits"], t["action_ids"], t["mask"], check_ids=False)
    with_logits = loss.policy_loss(
        t["policy_logits"], t["ref_logits"], t["action_ids"], t["mask"], t["old_logps"],
        t["advantages"], kl_coef=0.2,
    )[0]
    with_logps = loss.policy_loss(
        t["policy_logits"], None, t["action_ids"], t["mask"], t["old_logps"], t["advantages"],
        ref_logps=ref_logps, kl_coef=0.2,
    )[0]
    assert with_logits.item() == with_logps.item()


@pytest.mark.parametrize("agg", sorted(set(spec.LOSS_AGGS) - {"none"}))  # none: its own file
@pytest.mark.parametrize("level", sorted(spec.RATIO_LEVELS))
def test_all_inactive_gives_zero_loss_and_zero_grad(agg, level):
    x = make_inputs(seed=7, active=0.0)
    (value, metrics, grad), _ = _run(x, {"loss_agg": agg, "ratio_level": level, "kl_coef": 0.5},
                                     keys=("segment_ids", "importance_weights"))
    assert torch.count_nonzero(value) == 0
    assert all(m.item() == 0.0 for m in metrics.values())
    assert torch.equal(grad, torch.zeros_like(grad))


def test_empty_batch():
    x = make_inputs(seed=8, lead=(0, T))
    (value, metrics, grad), _ = _run(x, {"loss_agg": "seq-mean-token-mean"})
    assert value.item() == 0.0 and grad.shape == (0, T, V)


def test_inactive_rows_get_exactly_zero_grad_and_do_not_change_the_loss():
    x = make_inputs(seed=9, per_token_adv=True)
    opts = {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "kl_coef": 0.3}
    (value, _, grad), _ = _run(x, opts, keys=("segment_ids", "importance_weights"))
    assert torch.equal(grad[torch.from_numpy(~x["mask"])], torch.zeros(int((~x["mask"]).sum()), V))
    clean = dict(x)
    for key in ("policy_logits", "old_logps", "advantages", "importance_weights"):
        clean[key] = np.where(x["mask"].reshape(x["mask"].shape + (1,) * (x[key].ndim - 2)),
                              x[key], 0.25).astype(np.float32)
    clean["action_ids"] = np.where(x["mask"], x["action_ids"], 0)
    (value2, _, grad2), _ = _run(clean, opts, keys=("segment_ids", "importance_weights"))
    assert value.item() == value2.item() and torch.equal(grad, grad2)


def test_loss_normalizer_tensor_equals_float():
    x = make_inputs(seed=10)
    t = torch_inputs(x)
    args = (t["policy_logits"], t["ref_logits"], t["action_ids"], t["mask"], t["old_logps"],
            t["advantages"])
    a = loss.policy_loss(*args, loss_normalizer=12.0)[0]
    b = loss.policy_loss(*args, loss_normalizer=torch.tensor(12.0))[0]
    assert a.item() == b.item()


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"kl_coef": 0.1, "no_ref": True}, ValueError, "ref_logits"),
        ({"loss_agg": "mean"}, ValueError, "loss_agg"),
        ({"kl_estimator": "k4"}, ValueError, "kl_estimator"),
        ({"ratio_level": "seq"}, ValueError, "ratio_level"),
        ({"dual_clip": 0.9}, ValueError, "dual_clip"),
        ({"clip_eps": 1.5}, ValueError, "clip_eps"),
        ({"entropy_coef": float("nan")}, ValueError, "`entropy_coef` must be finite"),
        ({"entropy_coef": "0.01"}, TypeError, "`entropy_coef` must be a Python number"),
        ({"loss_normalizer": 0.0}, ValueError, "loss_normalizer"),
        ({"advantages": np.zeros(T, np.float32)}, ValueError, "advantages"),
        ({"segment_ids": np.zeros((B, T), np.float32)}, TypeError, "segment_ids"),
    ],
)
def test_bad_arguments_name_the_argument(options, error, match):
    t = torch_inputs(make_inputs(seed=11))
    options = dict(options)
    ref = None if options.pop("no_ref", False) else t["ref_logits"]
    adv = torch.from_numpy(options.pop("advantages", t["advantages"].numpy()))
    if "segment_ids" in options:
        options["segment_ids"] = torch.from_numpy(options["segment_ids"])
    with pytest.raises(error, match=match):
        loss.policy_loss(t["policy_logits"], ref, t["action_ids"], t["mask"], t["old_logps"],
                         adv, **options)


def test_interpret_backend_matches_native():
    pytest.importorskip("triton")
    x = make_inputs(seed=12)
    native, _ = _run(x, {"kl_coef": 0.2})
    interpret, _ = _run(x, {"kl_coef": 0.2}, backend="interpret")
    assert_close(interpret[0], native[0], spec.paths_tolerance(B * T), "loss")
    g_max = float(native[2].abs().max())
    assert_close(interpret[2], native[2], spec.paths_tolerance(V, g_max), "grad")


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
