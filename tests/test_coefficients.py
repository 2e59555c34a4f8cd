"""Coefficients given as 0-d tensors / arrays, one body per behaviour on every CPU target.

``kl_coef``, ``clip_eps``, ``clip_eps_high`` and ``entropy_coef`` given as 0-d float
tensors (PyTorch) or arrays (JAX) give the bits of the same Python numbers on every
backend (the fused kernel reads them as run-time data); a 0-d ``kl_coef = 0`` keeps an
infinite KL out (``0 * inf``); a 0-d ``entropy_coef = 0`` gives the fused kernel's bits of
the number 0; anything else is refused naming the argument. What only one framework has:
``tests/torch/test_coefficients.py`` (``torch.compile``, stride-0 rows) and
``tests/jax/test_coefficients.py`` (traced coefficients under ``jit``).
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import assert_close, assert_identical

from ratiokl import harness, spec

B, T, V = 2, 5, 23
#: Two paths of one float32 loss (or metric): sums of up to B*T per-token terms.
LOSS_TOL = spec.paths_tolerance(B * T)

#: Inactive rows hold data the kernels never use; the interpreter's numpy warns on it.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _inputs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return dict(logits=(rng.normal(size=(B, T, V)) * 2).astype(np.float32),
                ref=rng.normal(size=(B, T, V)).astype(np.float32),
                ids=rng.integers(0, V, (B, T)), mask=rng.random((B, T)) < 0.8,
                old=(rng.normal(size=(B, T)) * 0.3 - 3.0).astype(np.float32),
                adv=rng.normal(size=(B, T)).astype(np.float32))


def _zero_d(framework: str, value):
    """``value`` as the framework's 0-d array (its dtype kept: float32 or an integer)."""
    if framework == "torch":
        import torch

        return torch.tensor(np.asarray(value, np.float32 if isinstance(value, float) else None))
    import jax.numpy as jnp

    return jnp.asarray(value, jnp.float32 if isinstance(value, float) else None)


def _call(framework: str, x: dict, backend: str, **options):
    """``policy_loss`` of ``framework``: ``(loss, metrics, policy-logit gradient)`` in NumPy."""
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
        logits = t["logits"].requires_grad_()
        value, metrics = loss.policy_loss(logits, t["ref"], t["ids"], t["mask"], t["old"],
                                          t["adv"], backend=backend, **options)
        value.backward()
        return (value.detach().numpy(), {k: v.item() for k, v in metrics.items()},
                logits.grad.numpy())
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    j = {k: jnp.asarray(v) for k, v in x.items()}

    def fn(z):
        return loss.policy_loss(z, j["ref"], j["ids"].astype(jnp.int32), j["mask"], j["old"],
                                j["adv"], backend=backend, **options)

    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(j["logits"])
    return np.asarray(value), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


def _split(target: str):
    t = harness.TARGETS[target]
    return t.framework, t.backend


def test_zero_d_coefficients_give_the_bits_of_numbers(cpu_target: str) -> None:
    framework, backend = _split(cpu_target)
    x = _inputs(0)
    numbers = dict(kl_coef=0.05, clip_eps=0.1, clip_eps_high=0.15, dual_clip=3.0,
                   entropy_coef=0.02)
    arrays = {k: (_zero_d(framework, v) if k != "dual_clip" else v) for k, v in numbers.items()}
    want, want_metrics, want_grad = _call(framework, x, backend, **numbers)
    got, got_metrics, got_grad = _call(framework, x, backend, **arrays)
    assert_identical(got, want, "loss")
    assert_identical(got_grad, want_grad, "grad")
    assert got_metrics == want_metrics
    assert want_metrics["clip_fraction"] > 0  # the clip bounds took part


def test_a_zero_d_zero_kl_coef_keeps_an_infinite_kl_out(cpu_target: str) -> None:
    framework, backend = _split(cpu_target)
    x = _inputs(1)
    active = x["mask"]
    x["ref"][active, 0] = -np.inf
    x["ids"][active] = 0  # the reference gives the action probability 0: the KL is inf
    unbounded = dict(log_ratio_bound=None)  # else |d| is bounded before k3's exp
    value, metrics, grad = _call(framework, x, backend, kl_coef=_zero_d(framework, 0.0),
                                 **unbounded)
    want, _, want_grad = _call(framework, x, backend, kl_coef=0.0, **unbounded)
    assert metrics["kl_mean"] == float("inf")
    assert np.isfinite(value) and np.isfinite(grad).all()
    assert_identical(value, want, "loss")
    assert_identical(grad, want_grad, "grad")


def test_a_zero_d_zero_entropy_coef_gives_the_fused_bits_of_the_number_zero(
        interpret_target: str) -> None:
    """The kernel compiled for an array coefficient (it may be non-zero) adds exactly
    nothing at 0: the loss, the metrics and the gradient of ``entropy_coef=0.0``."""
    framework, backend = _split(interpret_target)
    x = _inputs(6)
    x["logits"][0, 0, ::2] = -np.inf  # masked vocabulary: p = 0 columns
    x["mask"][0, 0] = True
    x["ids"][0, 0] = 1
    want, want_metrics, want_grad = _call(framework, x, backend, entropy_coef=0.0)
    got, got_metrics, got_grad = _call(framework, x, backend,
                                       entropy_coef=_zero_d(framework, 0.0))
    assert_identical(got, want, "loss")
    assert_identical(got_grad, want_grad, "grad")
    assert got_metrics == want_metrics and want_metrics["entropy_mean"] > 0
    bonus, _, bonus_grad = _call(framework, x, backend, entropy_coef=_zero_d(framework, 0.5))
    assert not np.array_equal(bonus_grad, want_grad) and np.isfinite(bonus_grad).all()
    # token-mean: agg(H) = entropy_mean
    assert_close(bonus, float(want) - 0.5 * want_metrics["entropy_mean"], LOSS_TOL, "loss")


@pytest.mark.parametrize("options, error, message", [
    (dict(kl_coef=[0.1, 0.2]), TypeError, "`kl_coef` must be a Python number or a 0-d"),
    (dict(kl_coef=[0.1]), TypeError, "`kl_coef` must be .* 0-d floating tensor/array; got list"),
    (dict(entropy_coef=[0.1, 0.2]), TypeError, "`entropy_coef` must be a Python number or a 0-d"),
    (dict(clip_eps=1), TypeError, "`clip_eps` must be a Python number or a 0-d"),
    (dict(entropy_coef=1), TypeError, "`entropy_coef` must be a Python number or a 0-d"),
    (dict(clip_eps_high=0.2, ratio_cap=3.0), ValueError,
     "`ratio_cap` needs Python-number clip bounds"),
], ids=["kl_coef_1d", "kl_coef_list", "entropy_coef_1d", "clip_eps_int", "entropy_coef_int", "ratio_cap"])
def test_a_coefficient_must_be_a_number_or_a_0d_float_array(native_target: str, options, error,
                                                             message) -> None:
    """Each value above is given as the framework's array (``[0.1, 0.2]``: a 1-d one), but
    ``[0.1]``, given as the Python list, and ``ratio_cap``, a number."""
    framework, backend = _split(native_target)
    arrays = {k: v if k == "ratio_cap" or v == [0.1] else _zero_d(framework, v)
              for k, v in options.items()}
    with pytest.raises(error, match=message):
        _call(framework, _inputs(2), backend, **arrays)
