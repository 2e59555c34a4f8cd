"""``policy_objective`` and ``loss_agg="none"``, one test body per behaviour for both
frameworks (``ratiokl.harness``'s targets; the fixtures ``objective_*`` and
``policy_none_*`` pin the float64 values down on every target).

* ``policy_objective`` on the ``logp`` / entropy of ``selected_logprobs`` (native, with
  autograd) equals ``policy_loss`` of the same logits: loss, metrics, and the logit
  gradient through the chain rule -- every aggregation, GSPO, CISPO, the rollout modes,
  on-policy and the entropy bonus;
* NaN / inf on inactive tokens of every input changes no bit of the loss, the metrics or
  the gradients (exact zeros there); an active NaN stays visible;
* the per-token loss and its gradient (token and sequence ratios) match the float64 spec,
  and weighted by each mode's weights (the spec's closed forms) give that mode's loss, on
  every backend (the fused kernel's per-row backward scale with a NaN upstream on inactive
  rows included), and ``linear_policy_loss``'s two-pass chunks (a per-token loss; terms
  aggregated apart with a KL clamp) equal ``policy_loss`` of the materialised logits;
* errors name ``entropy``, ``ref_logps`` and ``loss_normalizer``;
* JAX ``jit`` / ``grad`` / ``vmap`` and ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import numpy as np
import pytest

from assertions import assert_close
from policy_test_cases import per_token_upstream
from ratiokl import spec

B, T, V, H = 3, 6, 17, 8
#: Two float32 paths of one loss (sums of B*T per-token terms).
LOSS_TOL = spec.paths_tolerance(B * T)
GRAD_TOL = spec.grad_tolerance("float32", 8.0, 1.0)

#: name -> options; every aggregation, GSPO, CISPO, rollout modes, on-policy, entropy.
CASES = {
    "token_mean_kl_entropy": {"kl_coef": 0.1, "entropy_coef": 0.05},
    "token_sum_k3_is": {"loss_agg": "token-sum", "kl_coef": 0.2, "kl_estimator": "k3-is"},
    "seq_mean_token_mean_packed": {"loss_agg": "seq-mean-token-mean", "entropy_coef": 0.1,
                                   "segment_ids": True},
    "seq_mean_token_sum_dual_clip": {"loss_agg": "seq-mean-token-sum", "dual_clip": 1.5},
    "seq_mean_token_sum_norm": {"loss_agg": "seq-mean-token-sum-norm", "kl_coef": 0.1},
    "normalizer_weights": {"loss_normalizer": 11.0, "importance_weights": True},
    "none_kl_entropy": {"loss_agg": "none", "kl_coef": 0.1, "entropy_coef": 0.05},
    "gspo": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean", "entropy_coef": 0.1},
    "gspo_none_packed": {"ratio_level": "sequence", "loss_agg": "none", "segment_ids": True},
    "cispo": {"objective": "cispo", "clip_eps_high": 4.0, "entropy_coef": 0.02},
    "on_policy": {"old_logps": None, "kl_coef": 0.2, "entropy_coef": 0.05},
    "rollout_token_truncate": {"rollout_correction": "token-truncate", "kl_coef": 0.1},
    "rollout_sequence_mask": {"rollout_correction": "sequence-mask",
                              "rollout_bounds": (0.5, 2.0), "loss_agg": "none"},
}
AGGREGATIONS = [a for a in spec.LOSS_AGGS if a != "none"]


def _inputs(seed=0, active=0.7):
    """NumPy inputs whose inactive tokens hold NaN / inf in every array and bad ids."""
    rng = np.random.default_rng(seed)
    mask = rng.random((B, T)) < active
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    ids = rng.integers(0, V, (B, T))
    logp = spec.selected_logprobs(logits, ids, mask)
    old = logp + rng.normal(0.0, 0.4, (B, T))
    garbage = np.where(np.arange(B * T).reshape(B, T) % 2 == 0, np.nan, np.inf)
    fill = lambda x: np.where(mask, x, garbage).astype(np.float32)  # noqa: E731
    return {
        "policy_logits": np.where(mask[..., None], logits, np.nan).astype(np.float32),
        "action_ids": np.where(mask, ids, V + 3),
        "mask": mask,
        "old_logps": fill(old),
        "ref_logps": fill(logp + rng.normal(0.0, 0.5, (B, T))),
        "rollout_logps": fill(old + rng.normal(0.0, 0.3, (B, T))),
        "advantages": fill(rng.normal(0.0, 1.0, (B, T))),
        "importance_weights": fill(rng.uniform(0.5, 1.5, (B, T))),
        "segment_ids": np.sort(rng.integers(0, 3, (B, T)), axis=-1),
    }


def _split(options, x):
    """``(arrays, scalar options)`` of a case: the arrays it passes, by name."""
    options = dict(options)
    arrays = {"ref_logps": x["ref_logps"]}
    for key in ("segment_ids", "importance_weights"):
        if options.pop(key, False):
            arrays[key] = x[key]
    if "rollout_correction" in options:
        arrays["rollout_logps"] = x["rollout_logps"]
    old = x["old_logps"] if options.pop("old_logps", True) is not None else None
    return arrays, old, options


class _Torch:
    def __init__(self):
        import torch

        from ratiokl.torch import loss
        from ratiokl.torch._arrays import XP

        self.torch, self.loss, self.xp, self.where = torch, loss, XP, torch.where

    def tensor(self, x):
        return None if x is None else self.torch.from_numpy(np.asarray(x))

    def run(self, fn, leaves, upstream):
        """``(loss, metrics, grads of leaves)`` of ``fn(*leaves)`` under ``upstream``."""
        leaves = [self.tensor(v).requires_grad_() for v in leaves]
        value, metrics = fn(*leaves)
        g = None if upstream is None else self.tensor(upstream)
        grads = self.torch.autograd.grad(value, leaves, g, allow_unused=True)
        grads = [self.torch.zeros_like(v) if d is None else d for v, d in zip(leaves, grads)]
        return (value.detach().numpy(), {k: m.numpy() for k, m in metrics.items()},
                [d.numpy() for d in grads])


class _Jax:
    def __init__(self):
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import loss
        from ratiokl.jax._arrays import XP

        self.jax, self.jnp, self.loss, self.xp, self.where = jax, jnp, loss, XP, jnp.where

    def tensor(self, x):
        return None if x is None else self.jnp.asarray(x)

    def run(self, fn, leaves, upstream):
        (value, metrics), vjp = self.jax.vjp(fn, *[self.tensor(v) for v in leaves])
        g = self.jnp.ones(()) if upstream is None else self.jnp.asarray(upstream)
        grads = vjp((g, self.jax.tree_util.tree_map(self.jnp.zeros_like, metrics)))
        return (np.asarray(value), {k: np.asarray(m) for k, m in metrics.items()},
                [np.asarray(d) for d in grads])


def _framework(target: str):
    pytest.importorskip(target.split("-")[0])
    return _Torch() if target.startswith("torch") else _Jax()


def _call_both(fw, x, options, backend):
    """``policy_loss`` of the logits on ``backend``, and ``policy_objective`` of their native
    ``selected_logprobs`` (and entropy): each ``(loss, metrics, [logit gradient])``."""
    arrays, old, scalars = _split(options, x)
    t = {k: fw.tensor(v) for k, v in arrays.items()}
    ids, mask, adv = (fw.tensor(x[k]) for k in ("action_ids", "mask", "advantages"))
    upstream = per_token_upstream(x["mask"]) if scalars.get("loss_agg") == "none" else None

    def loss(logits):
        return fw.loss.policy_loss(logits, None, ids, mask, fw.tensor(old), adv,
                                   backend=backend, **t, **scalars)

    def objective(logits):
        logp, ent = fw.loss.selected_logprobs(logits, ids, mask, return_entropy=True,
                                              backend="native")
        return fw.loss.policy_objective(logp, fw.tensor(old), adv, mask, entropy=ent, **t,
                                        **scalars)

    return (fw.run(loss, [x["policy_logits"]], upstream),
            fw.run(objective, [x["policy_logits"]], upstream))


def _assert_same(actual, expected, mask):
    (value, metrics, (grad,)), (want, want_metrics, (want_grad,)) = actual, expected
    assert value.shape == want.shape and value.dtype == np.float32
    assert_close(value, want, LOSS_TOL, "loss")
    assert set(metrics) == set(want_metrics)
    for name in metrics:
        assert_close(metrics[name], want_metrics[name], LOSS_TOL, name)
    assert_close(grad, want_grad, GRAD_TOL, "grad")
    assert np.all(grad[~mask] == 0) and np.all(want_grad[~mask] == 0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_policy_objective_of_the_logprobs_is_policy_loss(native_target, name):
    """On the same data, the same loss, metrics and (chain rule) logit gradient."""
    fw = _framework(native_target)
    x = _inputs(seed=len(name))
    loss, objective = _call_both(fw, x, CASES[name], "native")
    _assert_same(objective, loss, x["mask"])
    if CASES[name].get("loss_agg") == "none":
        inactive = objective[0][~x["mask"]]
        assert np.all(inactive == 0) and not np.signbit(inactive).any()  # +0.0


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_per_token_loss_weighted_is_every_aggregation(target, agg):
    """``sum(loss_none * w) == loss_agg`` with each mode's token weights ``w`` (the core's
    ``aggregation_weights``), on every backend; the per-token loss's gradient under a
    per-token upstream (NaN on inactive rows) is that of the weighted sum."""
    from ratiokl._core.objective import aggregation_weights

    fw = _framework(target)
    x = _inputs(seed=11)
    backend = target.split("-")[1]
    options = {"kl_coef": 0.1, "entropy_coef": 0.05, "segment_ids": True}
    mode = _call_both(fw, x, {**options, "loss_agg": agg}, backend)[0]
    opts = spec.policy_loss_options(**{**spec.POLICY_LOSS_DEFAULTS, "loss_agg": agg})
    weights = np.asarray(aggregation_weights(fw.xp, fw.tensor(x["mask"]),
                                             fw.tensor(x["segment_ids"]), None, opts))
    arrays, old, scalars = _split({**options, "loss_agg": "none"}, x)
    t = {k: fw.tensor(v) for k, v in arrays.items()}

    def per_token(logits):
        return fw.loss.policy_loss(logits, None, fw.tensor(x["action_ids"]),
                                   fw.tensor(x["mask"]), fw.tensor(old),
                                   fw.tensor(x["advantages"]), backend=backend, **t, **scalars)

    weighted = np.where(x["mask"], weights, np.nan).astype(np.float32)  # NaN stays out
    value, metrics, (grad,) = fw.run(per_token, [x["policy_logits"]], weighted)
    assert value.shape == (B, T) and np.all(value[~x["mask"]] == 0)
    assert_close(np.sum(value.astype(np.float64) * weights), mode[0], LOSS_TOL, "loss")
    for name in metrics:
        assert metrics[name] == mode[1][name], name  # metrics do not depend on loss_agg
    assert_close(grad, mode[2][0], GRAD_TOL, "grad")
    assert np.all(grad[~x["mask"]] == 0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_per_token_loss_and_gradient_match_the_spec(target, level):
    """``loss_agg="none"`` on every backend: the per-token loss ``[B, T]`` (+0.0 on inactive
    rows) and the logit gradient under a per-token upstream that is NaN on inactive rows,
    against the float64 spec."""
    fw = _framework(target)
    x = _inputs(seed=1)
    options = {"kl_coef": 0.2, "entropy_coef": 0.1, "loss_agg": "none", "ratio_level": level}
    value, _, (grad,) = _call_both(fw, x, options, target.split("-")[1])[0]
    arrays, old, scalars = _split(options, x)
    args = (x["policy_logits"].astype(np.float64), None, x["action_ids"], x["mask"], old,
            x["advantages"])
    with np.errstate(invalid="ignore"):
        want, _ = spec.policy_loss(*args, **arrays, **scalars)
        want_grad = spec.policy_loss_grad(*args, loss_cotangent=per_token_upstream(x["mask"]),
                                          **arrays, **scalars)
    assert value.shape == (B, T) and value.dtype == np.float32
    assert np.all(value[~x["mask"]] == 0) and not np.signbit(value[~x["mask"]]).any()
    scale = float(np.nanmax(np.abs(x["policy_logits"])))
    assert_close(value, want, spec.forward_tolerance(scale), "loss")
    grad_tol = spec.grad_tolerance("float32", scale, float(np.abs(want_grad).max()))
    assert_close(grad, want_grad, grad_tol, "grad")
    assert np.all(grad[~x["mask"]] == 0)


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_aggregation_weights_are_the_specs_closed_forms(native_target, agg):
    """``loss_mode == sum_t w_t * loss_none_t`` with the weights of the spec's module
    docstring, written out here per row (no segments): the core's ``aggregation_weights``
    (which the test above sums with) are those."""
    from ratiokl._core.objective import aggregation_weights

    fw = _framework(native_target)
    mask = _inputs(seed=2)["mask"]
    lengths = mask.sum(-1, keepdims=True)
    n_seq = int((lengths > 0).sum())
    closed = {
        "token-mean": mask / mask.sum(),
        "token-sum": mask * 1.0,
        "seq-mean-token-mean": mask / np.maximum(lengths, 1) / n_seq,
        "seq-mean-token-sum": mask / n_seq,
        "seq-mean-token-sum-norm": mask / T,
    }
    assert set(closed) == set(AGGREGATIONS)
    opts = spec.policy_loss_options(**{**spec.POLICY_LOSS_DEFAULTS, "loss_agg": agg})
    got = np.asarray(aggregation_weights(fw.xp, fw.tensor(mask), None, None, opts))
    # float32: the count's conversion and up to two divisions; float64: as many
    assert_close(got, closed[agg], spec.rounding_tolerance(3 + 3), f"{agg} weights")


def _objective_call(fw, x, options, fill=None):
    """``policy_objective`` with every input's inactive entries replaced by ``fill`` (None:
    the garbage of :func:`_inputs`); ``(loss, metrics, [d logps, d entropy])``."""
    arrays, old, scalars = _split(options, x)
    mask = x["mask"]
    rng = np.random.default_rng(3)
    logps = np.where(mask, -rng.gamma(2.0, 1.0, mask.shape), np.nan).astype(np.float32)
    entropy = np.where(mask, rng.uniform(0.2, 3.0, mask.shape), -np.inf).astype(np.float32)
    if fill is not None:
        swap = lambda v: np.where(mask, v, fill).astype(v.dtype)  # noqa: E731
        arrays = {k: v if k == "segment_ids" else swap(v) for k, v in arrays.items()}
        logps, entropy, old = swap(logps), swap(entropy), None if old is None else swap(old)
        adv = swap(x["advantages"])
    else:
        adv = x["advantages"]
    t = {k: fw.tensor(v) for k, v in arrays.items()}
    upstream = per_token_upstream(mask) if scalars.get("loss_agg") == "none" else None

    def fn(lp, ent):
        return fw.loss.policy_objective(lp, fw.tensor(old), fw.tensor(adv), fw.tensor(mask),
                                        entropy=ent, **t, **scalars)

    return fw.run(fn, [logps, entropy], upstream)


@pytest.mark.parametrize("name", ["none_kl_entropy", "gspo", "rollout_sequence_mask",
                                  "seq_mean_token_mean_packed"])
def test_inactive_garbage_reaches_nothing(native_target, name):
    """NaN / inf on inactive tokens of logps, entropy, old / ref / rollout log-probs,
    advantages and weights: bitwise the results of 0.5 there, gradients exactly 0."""
    fw = _framework(native_target)
    x = _inputs(seed=5)
    options = {**CASES[name], "importance_weights": True, "entropy_coef": 0.1}
    dirty, clean = _objective_call(fw, x, options), _objective_call(fw, x, options, fill=0.5)
    assert np.array_equal(dirty[0], clean[0])
    assert all(np.array_equal(dirty[1][k], clean[1][k]) for k in clean[1])
    for got, want in zip(dirty[2], clean[2]):
        assert np.array_equal(got, want) and np.all(got[~x["mask"]] == 0)
    assert np.all(np.isfinite(dirty[0])) and np.any(dirty[2][1] != 0)  # entropy's gradient


def test_an_active_nan_stays_visible(native_target):
    fw = _framework(native_target)
    x = _inputs(seed=6)
    row = tuple(np.argwhere(x["mask"])[0])
    x["advantages"][row] = np.nan
    total = _objective_call(fw, x, {"kl_coef": 0.1})[0]
    per_token = _objective_call(fw, x, {"loss_agg": "none"})[0]
    assert np.isnan(total) and np.isnan(per_token[row])
    assert np.isnan(per_token).sum() == 1


@pytest.mark.parametrize("options, name", [
    ({"entropy_coef": 0.1, "entropy": None}, "entropy"),
    ({"kl_coef": 0.1, "ref_logps": None}, "ref_logps"),
    ({"loss_agg": "none", "loss_normalizer": 4.0}, "loss_normalizer"),
])
def test_errors_name_the_argument(native_target, options, name):
    fw = _framework(native_target)
    x = _inputs(seed=7)
    mask, adv, old = (fw.tensor(x[k]) for k in ("mask", "advantages", "old_logps"))
    kw = {"entropy": old, "ref_logps": old, **options}
    with pytest.raises(ValueError, match=f"`{name}`"):
        fw.loss.policy_objective(old, old, adv, mask, **kw)
    if name == "loss_normalizer":  # the logit ops refuse it too, before any work
        logits, ids = fw.tensor(x["policy_logits"]), fw.tensor(x["action_ids"])
        with pytest.raises(ValueError, match="`loss_normalizer`"):
            fw.loss.policy_loss(logits, None, ids, mask, old, adv, **options)
        hidden = fw.tensor(np.zeros((B, T, H), np.float32))
        weight = fw.tensor(np.zeros((V, H), np.float32))
        with pytest.raises(ValueError, match="`loss_normalizer`"):
            fw.loss.linear_policy_loss(hidden, weight, ids, mask, old, adv, **options)


#: ``linear_policy_loss`` calls that take the chunks' two passes (log-probs, then the core):
#: a per-token loss under a per-token upstream that is NaN on inactive rows, and terms
#: aggregated apart with a KL clamp.
TWO_PASS_LINEAR = {
    "per-token": (8, dict(kl_coef=0.1, entropy_coef=0.05, loss_agg="none")),
    "term-options": (24, dict(kl_coef=0.2, entropy_coef=0.05, loss_agg="seq-mean-token-sum",
                              kl_agg="token-mean", entropy_agg="token-mean",
                              kl_entropy_normalizer=9.0, kl_clamp=0.1)),
}


@pytest.mark.parametrize("case", sorted(TWO_PASS_LINEAR))
@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_linear_two_pass_loss_is_policy_loss_of_its_logits(native_target, backend, case):
    """``linear_policy_loss`` on the chunks' two passes against ``policy_loss`` of the
    materialised logits, gradients to hidden and weight included; NaN hidden states on
    inactive rows get exactly 0 gradient."""
    pytest.importorskip("triton")
    fw = _framework(native_target)
    seed, options = TWO_PASS_LINEAR[case]
    x = _inputs(seed=seed)
    rng = np.random.default_rng(seed)
    hidden = np.where(x["mask"][..., None], rng.normal(0.0, 1.0, (B, T, H)), np.nan)
    weight = rng.normal(0.0, 0.5, (V, H))
    ids, mask, old, adv, ref = (fw.tensor(x[k]) for k in (
        "action_ids", "mask", "old_logps", "advantages", "ref_logps"))
    kw = dict(ref_logps=ref, **options)
    keep = fw.tensor(x["mask"][..., None])

    def linear(h, w):
        return fw.loss.linear_policy_loss(h, w, ids, mask, old, adv, chunk_rows=4,
                                          backend=backend, **kw)

    def materialised(h, w):
        logits = fw.where(keep, h, 0.0) @ w.T
        return fw.loss.policy_loss(logits, None, ids, mask, old, adv, backend="native", **kw)

    leaves = [hidden.astype(np.float32), weight.astype(np.float32)]
    upstream = per_token_upstream(x["mask"]) if options["loss_agg"] == "none" else None
    got, want = fw.run(linear, leaves, upstream), fw.run(materialised, leaves, upstream)
    assert_close(got[0], want[0], LOSS_TOL, "loss")
    for d, w_ in zip(got[2], want[2]):
        assert_close(d, w_, spec.grad_tolerance("float32", 8.0, float(np.abs(w_).max())),
                     "grad")
    assert np.all(got[2][0][~x["mask"]] == 0)


def _token_arrays(seed=9):
    x = _inputs(seed=seed)
    rng = np.random.default_rng(seed)
    logps = np.where(x["mask"], -rng.gamma(2.0, 1.0, (B, T)), np.nan).astype(np.float32)
    entropy = np.where(x["mask"], rng.uniform(0.2, 3.0, (B, T)), np.inf).astype(np.float32)
    return x, logps, entropy


def test_jax_jit_grad_and_vmap():
    """``jax.jit(jax.grad)`` equals eager; ``vmap`` over a batch of problems equals each."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss

    x, logps, entropy = _token_arrays()
    old, adv, mask, segs = (jnp.asarray(x[k]) for k in ("old_logps", "advantages", "mask",
                                                        "segment_ids"))

    def value(lp, ent, agg="seq-mean-token-mean"):
        return loss.policy_objective(lp, old, adv, mask, entropy=ent, entropy_coef=0.1,
                                     loss_agg=agg, segment_ids=segs, ratio_level="sequence")[0]

    args = (jnp.asarray(logps), jnp.asarray(entropy))
    eager = jax.grad(value, argnums=(0, 1))(*args)
    jitted = jax.jit(jax.grad(value, argnums=(0, 1)))(*args)
    for got, want in zip(jitted, eager):
        assert_close(got, want, GRAD_TOL, "grad")
        assert np.all(np.asarray(got)[~x["mask"]] == 0)
    batch = jnp.stack([args[0], args[0] - 0.1]), jnp.stack([args[1], args[1] * 0.5])
    mapped = jax.vmap(lambda lp, ent: value(lp, ent, "none"))(*batch)
    for i in range(2):
        assert_close(mapped[i], value(batch[0][i], batch[1][i], "none"), LOSS_TOL, "loss")


def test_torch_compile_fullgraph():
    """``torch.compile(fullgraph=True)`` traces it whole (no graph break); same values and
    gradients as eager (AOTAutograd's graphs, run without code generation)."""
    torch = pytest.importorskip("torch")

    from ratiokl.torch import loss

    x, logps, entropy = _token_arrays()
    old, adv, mask, rollout = (torch.from_numpy(x[k]) for k in (
        "old_logps", "advantages", "mask", "rollout_logps"))

    def step(lp, ent):
        value, metrics = loss.policy_objective(
            lp, old, adv, mask, entropy=ent, entropy_coef=0.1, loss_agg="seq-mean-token-mean",
            rollout_logps=rollout, rollout_correction="sequence-mask")
        return value, metrics["entropy_mean"]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        leaves = [torch.from_numpy(a).requires_grad_() for a in (logps, entropy)]
        value, ent_mean = fn(*leaves)
        results.append((value, ent_mean, *torch.autograd.grad(value, leaves)))
    for got, want in zip(*results):
        assert_close(got, want, GRAD_TOL)
    assert torch.all(results[1][2][torch.from_numpy(~x["mask"])] == 0)
