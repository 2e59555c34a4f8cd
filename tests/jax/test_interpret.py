"""JAX's ``backend="interpret"``: the Triton binding with its launches run by Triton's CPU
interpreter (``ratiokl.jax._interpret``).

What the backend itself promises: an error saying what to install when torch or
triton is missing (``"auto"`` then, and always, stays off it); memory a kernel does
not write shows as garbage (NaN / -1), zeroed and aliased outputs start as on the GPU;
NumPy scalars are refused as compile-time constants, as jax-triton does; the
recording seam sees the launches that run; and the public ops with many options at
once equal the native backend under ``jit`` and ``grad``. The fixtures' outputs and
gradients: the ``jax-interpret`` conformance target.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import _requirements, harness, spec  # noqa: E402
from ratiokl.jax import _route, loss  # noqa: E402
from rollout_test_cases import B, T, V, make_inputs  # noqa: E402

REASON = harness.target_status("jax-interpret")
needs_interpreter = pytest.mark.skipif(REASON is not None, reason=str(REASON))


@pytest.fixture
def missing(monkeypatch):
    """Report ``distribution`` as not installed (the route's cached reason recomputed)."""

    def hide(distribution: str) -> None:
        real = _requirements.installed_version
        monkeypatch.setattr(_requirements, "installed_version",
                            lambda name: None if name == distribution else real(name))
        _route._interpret_error.cache_clear()

    yield hide
    _route._interpret_error.cache_clear()


@pytest.mark.parametrize("distribution", ["torch", "triton"])
def test_without_torch_or_triton_it_says_what_to_install(missing, distribution):
    missing(distribution)
    x = jnp.zeros((2, 5), jnp.float32)
    ids, mask = jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool)
    with pytest.raises(RuntimeError, match=rf"backend='interpret' cannot run here: "
                                           rf"`{distribution}` is not installed") as info:
        loss.selected_logprobs(x, ids, mask, backend="interpret")
    assert "pip install 'ratiokl[torch-triton]'" in str(info.value)
    assert "backend='native'" in str(info.value)
    assert _route.backend_name("auto") == "native"
    assert harness.target_status("jax-interpret") == _route._interpret_error()
    np.testing.assert_array_equal(np.asarray(loss.selected_logprobs(x, ids, mask)),
                                  np.full((2,), -np.log(5.0), np.float32))


@needs_interpreter
def test_auto_never_picks_the_interpreter():
    from ratiokl.jax import _interpret

    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 7)), jnp.float32)
    with _interpret.recording() as launches:
        jax.block_until_ready(loss.selected_logprobs(x, jnp.arange(3), None, backend="auto"))
        jax.block_until_ready(loss.selected_logprobs(x, jnp.arange(3), None,
                                                     backend="interpret"))
    assert _route.backend_name("auto") != "interpret"
    assert [launch.kernel for launch in launches] == ["logp_forward_kernel"]  # "interpret" only


def _partial_writer():
    """A kernel that writes the first ``N`` of ``2 N`` entries of each output."""
    import triton
    import triton.language as tl

    @triton.jit
    def write_first(x_ptr, y_ptr,  # inputs: float32 [2N] each
                    out_ptr, index_ptr, zeroed_ptr, aliased_ptr,  # outputs: [2N] each
                    N: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        first = offs < N
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=first), mask=first)
        tl.store(index_ptr + offs, offs, mask=first)
        tl.store(aliased_ptr + offs, tl.load(aliased_ptr + offs, mask=first) + 1.0, mask=first)

    return write_first


@needs_interpreter
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_memory_a_kernel_does_not_write_shows(jit):
    from ratiokl.jax import _interpret

    n = 4
    x = jnp.arange(2 * n, dtype=jnp.float32)
    y = -jnp.arange(2 * n, dtype=jnp.float32)
    f32 = jax.ShapeDtypeStruct((2 * n,), jnp.float32)
    i32 = jax.ShapeDtypeStruct((2 * n,), jnp.int32)

    def launch(x, y):
        return _interpret.triton_call(
            x, y, kernel=_partial_writer(), out_shape=[f32, i32, i32, f32], grid=(1,),
            num_warps=1, input_output_aliases={1: 3}, zeroed_outputs=(2,), N=n, BLOCK=8)

    out, index, zeroed, aliased = map(np.asarray, (jax.jit(launch) if jit else launch)(x, y))
    np.testing.assert_array_equal(out[:n], np.asarray(x)[:n])
    assert np.all(np.isnan(out[n:]))  # never written: garbage
    np.testing.assert_array_equal(index, [0, 1, 2, 3, -1, -1, -1, -1])
    np.testing.assert_array_equal(zeroed, np.zeros(2 * n))  # zeroed_outputs, never written
    np.testing.assert_array_equal(aliased, np.concatenate([np.asarray(y)[:n] + 1,
                                                           np.asarray(y)[n:]]))


@needs_interpreter
def test_a_numpy_scalar_constant_is_refused_as_jax_triton_does():
    from ratiokl.jax import _interpret

    x = jnp.zeros((8,), jnp.float32)
    shape = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(TypeError, match=r"N=np\.int64\(4\).*pass a Python number"):
        _interpret.triton_call(x, x, kernel=_partial_writer(), out_shape=[shape] * 4,
                               grid=(1,), N=np.int64(4), BLOCK=8)


@needs_interpreter
def test_recording_sees_each_run_and_nothing_outside_the_block():
    from ratiokl.jax import _interpret

    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 7)), jnp.float32)
    step = jax.jit(lambda z: loss.selected_logprobs(z, jnp.arange(3), backend="interpret"))
    jax.block_until_ready(step(x))
    with _interpret.recording() as launches:
        jax.block_until_ready(step(x))  # compiled before the block: it runs again
        jax.block_until_ready(step(x))
    jax.block_until_ready(step(x))
    assert [launch.kernel for launch in launches] == ["logp_forward_kernel"] * 2
    assert launches[0].grid == (3,) and launches[0].constants["V"] == 7


#: Many options of the one-kernel policy loss at once (the rest: the conformance fixtures).
OPTIONS = dict(clip_eps=0.15, clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.1,
               kl_estimator="k3", loss_agg="seq-mean-token-sum-norm", entropy_coef=0.05,
               log_ratio_bound=2.0, rollout_correction="token-truncate",
               rollout_bounds=(0.0, 1.5))


@needs_interpreter
def test_policy_loss_with_many_options_equals_native_under_jit_and_grad():
    x = {k: jnp.asarray(v) for k, v in make_inputs(seed=3).items()}
    temperature = jnp.full(x["mask"].shape, 0.8, jnp.float32)

    def step(backend, logits):
        value, metrics = loss.policy_loss(
            logits, x["ref_logits"], x["action_ids"], x["mask"], x["old_logps"],
            x["advantages"], importance_weights=x["importance_weights"],
            segment_ids=x["segment_ids"], rollout_logps=x["rollout_logps"],
            temperature=temperature, backend=backend, check_ids=False,
            inplace_grad=backend == "interpret", **OPTIONS)
        return -1.5 * value, metrics

    results = {backend: jax.jit(jax.value_and_grad(lambda z, b=backend: step(b, z),
                                                   has_aux=True))(x["policy_logits"])
               for backend in ("native", "interpret")}
    (value, metrics), grad = results["interpret"]
    (want, want_metrics), want_grad = results["native"]
    loss_tol = spec.paths_tolerance(B * T)
    assert_close(value, want, loss_tol, "loss")
    assert set(metrics) == set(want_metrics)
    for name in want_metrics:
        assert_close(metrics[name], want_metrics[name], loss_tol, name)
    grad_tol = spec.paths_tolerance(V, float(jnp.max(jnp.abs(want_grad))))
    assert_close(grad, want_grad, grad_tol, "grad")
    assert np.all(np.asarray(grad)[~np.asarray(x["mask"])] == 0.0)
