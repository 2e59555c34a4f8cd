"""One ``policy_loss`` call per framework and its float64 spec expectation, for the tests
that run one body on both frameworks (``tests/test_policy_loss_spec.py``) and the
framework-specific ones (``tests/torch/test_policy_loss.py``, ``tests/jax/test_policy_loss.py``).

Each runner returns ``((loss, metrics, grad), (spec loss, spec metrics, spec grad))``: the
framework's arrays as they come, and the spec of the same inputs, the logits first rounded to
``dtype`` as the framework saw them. ``loss_agg="none"`` takes a per-token upstream gradient
(``per_token_upstream``) instead of 1.
"""

from __future__ import annotations

import numpy as np

from assertions import assert_close
from policy_test_cases import LOSS_TOL, per_token_upstream
from ratiokl import spec

POSITIONAL = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")


def _expected(x, rounded, options, keys, upstream):
    args = dict(x, **rounded)
    kw = {**{k: x[k] for k in keys}, **options}
    exp_loss, exp_metrics = spec.policy_loss(*[args[k] for k in POSITIONAL], **kw)
    exp_grad = spec.policy_loss_grad(*[args[k] for k in POSITIONAL], loss_cotangent=upstream,
                                     **kw)
    return exp_loss, exp_metrics, exp_grad


def torch_inputs(x, dtype="float32"):
    """PyTorch tensors of ``x``; the logits in ``dtype``, the policy's requiring a gradient."""
    import torch

    out = {k: torch.from_numpy(v) for k, v in x.items()}
    out["policy_logits"] = out["policy_logits"].to(getattr(torch, dtype)).requires_grad_()
    out["ref_logits"] = out["ref_logits"].to(getattr(torch, dtype))
    return out


def run_torch(x, options, *, backend="native", dtype="float32", keys=()):
    """``policy_loss`` of ``ratiokl.torch`` (autograd gradient) and the spec's expectation."""
    import torch

    from ratiokl.torch import loss

    t = torch_inputs(x, dtype)
    value, metrics = loss.policy_loss(*[t[k] for k in POSITIONAL], backend=backend,
                                      **{k: t[k] for k in keys}, **options)
    upstream = None if value.dim() == 0 else per_token_upstream(x["mask"])
    (grad,) = torch.autograd.grad(value, t["policy_logits"],
                                  None if upstream is None else torch.from_numpy(upstream))
    for m in metrics.values():
        assert not m.requires_grad
    rounded = {k: t[k].detach().float().numpy() for k in ("policy_logits", "ref_logits")}
    return (value, metrics, grad), _expected(x, rounded, options, keys, upstream)


def jax_inputs(x, dtype="float32"):
    """JAX arrays of ``x``; the logits in ``dtype``."""
    import jax.numpy as jnp

    out = {k: jnp.asarray(v) for k, v in x.items()}
    out["policy_logits"] = out["policy_logits"].astype(dtype)
    out["ref_logits"] = out["ref_logits"].astype(dtype)
    return out


def jax_loss_fn(keys, options, backend="native"):
    """``(logits, other arrays) -> (loss, metrics)`` with the options closed over."""
    from ratiokl.jax import loss

    def fn(logits, arrays):
        extra = {k: arrays[k] for k in keys}
        return loss.policy_loss(logits, *[arrays[k] for k in POSITIONAL[1:]], backend=backend,
                                **extra, **options)

    return fn


def run_jax(x, options, *, backend="native", dtype="float32", keys=(), transform=lambda f: f):
    """``policy_loss`` of ``ratiokl.jax`` (``jax.vjp``, under ``transform``) and the spec's."""
    import jax
    import jax.numpy as jnp

    j = jax_inputs(x, dtype)
    upstream = per_token_upstream(x["mask"]) if options.get("loss_agg") == "none" else None

    def value_and_grad(logits, arrays):
        (value, metrics), vjp = jax.vjp(
            lambda z: jax_loss_fn(keys, options, backend)(z, arrays), logits)
        g = jnp.ones(()) if upstream is None else jnp.asarray(upstream)
        return (value, metrics), vjp((g, jax.tree_util.tree_map(jnp.zeros_like, metrics)))[0]

    (value, metrics), grad = transform(value_and_grad)(j["policy_logits"], j)
    rounded = {k: np.asarray(j[k].astype(jnp.float32)) for k in ("policy_logits", "ref_logits")}
    return (value, metrics, grad), _expected(x, rounded, options, keys, upstream)


def assert_matches_spec(actual, expected, dtype="float32"):
    """The loss (float32, the spec's shape), each metric (0-d float32) and the gradient
    (in ``dtype``, finite) within the spec's tolerances."""
    (value, metrics, grad), (exp_loss, exp_metrics, exp_grad) = actual, expected
    assert str(value.dtype).endswith("float32") and tuple(value.shape) == np.shape(exp_loss)
    assert_close(value, exp_loss, LOSS_TOL, "loss")
    assert set(metrics) == set(exp_metrics)
    for name, m in metrics.items():
        assert str(m.dtype).endswith("float32") and tuple(m.shape) == (), name
        assert_close(m, exp_metrics[name], LOSS_TOL, name)
    assert str(grad.dtype).endswith(dtype)
    assert np.all(np.isfinite(exp_grad))
    tol = spec.grad_tolerance(dtype, 8.0, float(np.abs(exp_grad).max()))
    assert_close(grad, exp_grad, tol, "grad")
