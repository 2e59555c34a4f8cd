"""float64 on JAX's native backend (under ``jax.enable_x64``): the logits ops and
``policy_objective`` compute in float64 and match the float64 spec (``ratiokl.spec``) to
float64 rounding, values and gradients, with inactive rows (NaN, +inf, bad ids) isolated;
the Triton backends refuse float64 logits naming the argument (issue 47, item 14).

Every test runs inside ``jax.enable_x64(True)`` (a fixture), which restores the flag after
it: the rest of the suite runs with x64 off.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

B, T, V = 2, 3, 5
#: float64 against float64: rounding only (float32 math misses by about 1e-7).
RTOL, ATOL = 1e-10, 1e-12

_RNG = np.random.default_rng(47)
MASK = np.array([[True, True, False], [True, False, True]])
IDS = np.where(MASK, _RNG.integers(0, V, (B, T)), V + 3)
OLD = np.where(MASK, _RNG.normal(size=(B, T)) - 1.5, np.nan)
ADV = _RNG.normal(size=(B, T))
TEMP = np.array([[0.7, 1.3, 2.0], [1.1, 0.9, 0.5]])


def _padded(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[0, 2] = np.nan
    x[1, 1, 0], x[1, 1, 1] = np.inf, -np.inf
    return x


LOGITS = _padded(_RNG.normal(size=(B, T, V)))
REF = _padded(_RNG.normal(size=(B, T, V)))


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _close(got, want, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL, err_msg=what)


def _vjp(fn, x, cotangent):
    out, pull = jax.vjp(fn, x)
    return out, pull(cotangent)[0]


def test_selected_logprobs_and_entropy_match_the_float64_spec():
    g_logp, g_ent = _RNG.normal(size=(B, T)), _RNG.normal(size=(B, T))
    fn = jax.jit(lambda x: loss.selected_logprobs(x, jnp.asarray(IDS), jnp.asarray(MASK),
                                                  temperature=jnp.asarray(TEMP),
                                                  return_entropy=True, backend="native"))
    (logp, ent), grad = _vjp(fn, jnp.asarray(LOGITS), (jnp.asarray(g_logp), jnp.asarray(g_ent)))
    assert logp.dtype == ent.dtype == grad.dtype == jnp.float64
    _close(logp, spec.selected_logprobs(LOGITS, IDS, MASK, temperature=TEMP), "logp")
    _close(ent, spec.entropy(LOGITS, MASK, temperature=TEMP), "entropy")
    want = (spec.selected_logprobs_grad(LOGITS, IDS, MASK, g_logp, temperature=TEMP)
            + spec.entropy_grad(LOGITS, MASK, g_ent, temperature=TEMP))
    _close(grad, want, "d logits")
    assert not np.asarray(grad)[~MASK].any(), "an inactive row reached the gradient"


def test_selected_logprobs_check_grads():
    """JAX's own finite-difference check (reverse mode: the ops are ``custom_vjp``)."""
    check_grads(lambda x: loss.selected_logprobs(x, jnp.asarray(IDS), jnp.asarray(MASK),
                                                 backend="native"),
                (jnp.asarray(LOGITS),), order=1, modes=["rev"])


@pytest.mark.parametrize("kl_estimator", ["k3", "k2"])
def test_ratio_kl_matches_the_float64_spec(kl_estimator):
    g_ratio, g_kl = _RNG.normal(size=(B, T)), _RNG.normal(size=(B, T))
    fn = lambda x: loss.ratio_kl(x, REF, IDS, MASK, OLD, kl_estimator=kl_estimator,  # noqa: E731
                                 temperature=0.8, backend="native")
    (ratio, kl), grad = _vjp(fn, jnp.asarray(LOGITS), (jnp.asarray(g_ratio), jnp.asarray(g_kl)))
    assert ratio.dtype == kl.dtype == grad.dtype == jnp.float64
    want_ratio, want_kl = spec.ratio_kl(LOGITS, REF, IDS, MASK, OLD, kl_estimator=kl_estimator,
                                        temperature=0.8)
    _close(ratio, want_ratio, "ratio")
    _close(kl, want_kl, "kl")
    _close(grad, spec.ratio_kl_grad(LOGITS, REF, IDS, MASK, OLD, g_ratio, g_kl,
                                    kl_estimator=kl_estimator, temperature=0.8), "d logits")


POLICY_CASES = {
    "kl": dict(kl_coef=0.1),
    "dual_clip_entropy_seq_mean": dict(clip_eps=0.05, dual_clip=3.0, entropy_coef=0.1,
                                       loss_agg="seq-mean-token-mean"),
    "gspo_clip_higher": dict(ratio_level="sequence", clip_eps_high=0.3, kl_coef=0.05),
}


@pytest.mark.parametrize("name", POLICY_CASES)
def test_policy_loss_matches_the_float64_spec(name):
    options = POLICY_CASES[name]
    fn = jax.jit(lambda x: loss.policy_loss(x, REF, IDS, MASK, OLD, ADV, backend="native",
                                            **options))
    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(LOGITS))
    assert value.dtype == grad.dtype == jnp.float64
    assert {m.dtype for m in metrics.values()} == {jnp.dtype("float64")}, metrics
    want, want_metrics = spec.policy_loss(LOGITS, REF, IDS, MASK, OLD, ADV, **options)
    _close(value, want, "loss")
    _close(metrics["ratio_mean"], want_metrics["ratio_mean"], "ratio_mean")
    _close(grad, spec.policy_loss_grad(LOGITS, REF, IDS, MASK, OLD, ADV, **options), "d logits")
    assert np.isfinite(np.asarray(grad)).all()


def test_policy_objective_matches_the_float64_spec():
    logps = np.where(MASK, OLD + 0.1 * ADV, np.nan)
    entropy = _RNG.random((B, T))
    options = dict(kl_coef=0.1, entropy_coef=0.1, clip_eps=0.05)
    ref = OLD + 0.2

    def fn(lp, ent):
        return loss.policy_objective(lp, OLD, ADV, MASK, ref_logps=ref, entropy=ent,
                                     **options)[0]

    value, (d_logps, d_ent) = jax.value_and_grad(fn, argnums=(0, 1))(jnp.asarray(logps),
                                                                       jnp.asarray(entropy))
    assert value.dtype == d_logps.dtype == jnp.float64
    want, _ = spec.policy_objective(logps, OLD, ADV, MASK, ref_logps=ref, entropy=entropy,
                                    **options)
    want_logps, want_ent = spec.policy_objective_grad(logps, OLD, ADV, MASK, ref_logps=ref,
                                                      entropy=entropy, **options)
    _close(value, want, "loss")
    _close(d_logps, want_logps, "d logps")
    _close(d_ent, want_ent, "d entropy")


@pytest.mark.parametrize("arg", ["logits", "policy_logits", "ref_logits"])
def test_interpret_refuses_float64(arg):
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    calls = {
        "logits": lambda: loss.selected_logprobs(LOGITS, IDS, MASK, backend="interpret"),
        "policy_logits": lambda: loss.policy_loss(LOGITS, None, IDS, MASK, OLD, ADV,
                                                  backend="interpret"),
        "ref_logits": lambda: loss.ratio_kl(LOGITS.astype(np.float32), REF, IDS, MASK, OLD,
                                            backend="interpret"),
    }
    with pytest.raises(TypeError, match=rf"`{arg}` is float64.*backend='interpret'"
                                        r".*backend='native'"):
        calls[arg]()


def test_vocab_axis_refuses_float64():
    """The vocabulary-parallel path computes in float32 (refused before any collective)."""
    with pytest.raises(TypeError, match=r"`logits` is float64, which `vocab_axis`"):
        loss.selected_logprobs(LOGITS, IDS, MASK, backend="native", vocab_axis="vocab")
