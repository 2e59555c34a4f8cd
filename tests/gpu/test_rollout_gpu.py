"""The rollout correction on a CUDA GPU: torch ``"triton"`` (the one-launch weights, eager
and through ``torch.compile``'s ``triton_op``) and JAX ``"triton"`` (the same launch
through jax-triton; per-sequence advantages read once per sequence), against the spec.

Run on the H200 with ``pytest -m gpu tests/gpu``; skipped without CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from assertions import assert_close, two_paths  # noqa: E402

from ratiokl import spec  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T, V = 8, 96, 4096
MODES = [("token-truncate", (0.0, 1.5)), ("token-mask", (0.5, 5.0)),
         ("sequence-truncate", (0.0, 1.2)), ("sequence-mask", (0.5, 2.0)), (None, (0.0, 2.0))]


def _inputs(seed: int):
    """NumPy inputs (bf16-exact logits), NaN on inactive rows' logits and log-probs."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < 0.8
    logits = torch.tensor(rng.normal(0.0, 2.0, (B, T, V))).bfloat16().double().numpy()
    ids = rng.integers(0, V, (B, T))
    old = spec.selected_logprobs(logits, ids, mask) + rng.normal(0.0, 0.3, (B, T))
    rollout = old + rng.normal(0.0, 0.05, (B, T))
    nan = lambda x: np.where(mask, x, np.nan)  # noqa: E731
    logits[~mask] = np.nan
    return dict(policy_logits=logits, action_ids=np.where(mask, ids, -1), mask=mask,
                old_logps=nan(old), advantages=rng.normal(size=B), rollout_logps=nan(rollout),
                segment_ids=np.sort(rng.integers(0, 3, (B, T)), axis=-1))


def _cuda(x):
    dtype = torch.float32 if x.dtype.kind == "f" else None
    return torch.tensor(x, dtype=dtype, device="cuda")


def _spec(x, options):
    args = [x["policy_logits"], None, x["action_ids"], x["mask"], x["old_logps"],
            x["advantages"]]
    value, metrics = spec.policy_loss(*args, **options)
    return value, metrics, spec.policy_loss_grad(*args, **options)


def _grad_tolerance(x, want_grad):
    """The bfloat16 logits' gradient against the spec's, at the logits' magnitude."""
    scale = float(np.nanmax(np.abs(x["policy_logits"])))
    return spec.grad_tolerance("bfloat16", scale, float(np.nanmax(np.abs(want_grad))))


def _check(value, metrics, grad, want, x) -> None:
    """Loss and rollout metrics: float32 sums over the ``B * T`` tokens; the gradient: the
    spec's bfloat16 gradient tolerance."""
    want_value, want_metrics, want_grad = want
    tol = spec.reduction_tolerance(B * T)
    assert_close(float(value), want_value, tol, "loss")
    for key in spec.ROLLOUT_METRIC_NAMES:
        assert_close(float(metrics[key]), want_metrics[key], tol, key)
    assert_close(grad, want_grad, _grad_tolerance(x, want_grad), "grad")


@pytest.mark.parametrize("correction, bounds", MODES)
@pytest.mark.parametrize("packed", [False, True])
def test_torch_triton_matches_spec(correction, bounds, packed) -> None:
    from ratiokl.torch import loss

    x = _inputs(seed=len(str(correction)))
    options = dict(rollout_correction=correction, rollout_bounds=bounds,
                   loss_agg="seq-mean-token-mean")
    if packed:
        options["segment_ids"] = x["segment_ids"]
    logits = _cuda(x["policy_logits"]).bfloat16().requires_grad_(True)
    rest = [_cuda(x[k]) for k in ("action_ids", "mask", "old_logps", "advantages")]
    kw = {k: _cuda(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}
    value, metrics = loss.policy_loss(logits, None, *rest, backend="triton",
                                      rollout_logps=_cuda(x["rollout_logps"]), **kw)
    value.backward()
    _check(value.item(), metrics, logits.grad.float().cpu().numpy(),
           _spec(x, dict(options, rollout_logps=x["rollout_logps"])), x)


@pytest.mark.parametrize("wants_grad", [True, False])
def test_torch_compile_fullgraph_matches_eager(wants_grad) -> None:
    """With a gradient the two-pass route, without one the fused kernel; the weights from
    the ``triton_op`` binding of the one-launch kernel either way."""
    from ratiokl.torch import loss

    x = _inputs(seed=7)
    args = [_cuda(x[k]) for k in ("policy_logits", "action_ids", "mask", "old_logps",
                                  "advantages", "rollout_logps", "segment_ids")]
    args[0] = args[0].bfloat16().requires_grad_(wants_grad)

    def step(logits, ids, mask, old, adv, rollout, segs):
        value, metrics = loss.policy_loss(
            logits, None, ids, mask, old, adv, segment_ids=segs, rollout_logps=rollout,
            rollout_correction="sequence-mask", rollout_bounds=(0.5, 2.0), backend="triton",
            check_ids=False)
        return value, metrics["rollout_weight_mean"], metrics["rollout_k3"]

    with torch.set_grad_enabled(wants_grad):
        got = torch.compile(step, fullgraph=True)(*args)
        want = step(*args)
    for a, b, name in zip(got, want, ("loss", "rollout_weight_mean", "rollout_k3")):
        assert_close(a, b, spec.paths_tolerance(B * T), name)
    if wants_grad:
        (g_got,) = torch.autograd.grad(got[0], args[0])
        (g_want,) = torch.autograd.grad(want[0], args[0])
        assert_close(g_got, g_want, two_paths(_grad_tolerance(x, g_want.float().cpu().numpy())),
                     "grad")


@pytest.mark.parametrize("correction, bounds", MODES[:4])
def test_jax_triton_matches_spec(correction, bounds) -> None:
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss

    try:
        from ratiokl.jax._jax_triton import import_jax_triton

        import_jax_triton()
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")
    x = _inputs(seed=11)
    options = dict(rollout_correction=correction, rollout_bounds=bounds)
    f32 = lambda v: jnp.asarray(v.astype(np.float32) if v.dtype.kind == "f" else v)  # noqa: E731
    rest = [f32(x[k]) for k in ("action_ids", "mask", "old_logps", "advantages")]

    def fn(z, rollout):
        return loss.policy_loss(z, None, *rest, backend="triton", check_ids=False,
                                rollout_logps=rollout, **options)

    logits = f32(x["policy_logits"]).astype(jnp.bfloat16)
    (value, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(
        logits, f32(x["rollout_logps"]))
    _check(float(value), metrics, np.asarray(grad.astype(jnp.float32)),
           _spec(x, dict(options, rollout_logps=x["rollout_logps"])), x)
