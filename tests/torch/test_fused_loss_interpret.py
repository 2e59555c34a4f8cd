"""The fused ``policy_loss`` kernel through Triton's CPU interpreter.

``backend="interpret"`` runs ``ratiokl._kernels.fused_loss`` (one pass per
row: log-sum-exp, objective, gradient) exactly as the GPU does. Each case
is checked against the float64 spec (``ratiokl.spec.policy_loss``) and
against the two-pass native path (loss, every metric, the policy-logit
gradient) across clip modes, KL variants, aggregations, packed rows, bf16,
all-inactive input, garbage (NaN, bad ids) in inactive rows and upstream
gradients of 1 (the device-side skip) and not 1, and the entropy bonus
(``entropy_coef``: on masked ``-inf`` vocabularies, per-row temperatures,
negative, with CISPO). The JAX launch
(``ratiokl.jax._triton.policy_loss``) runs through JAX's ``backend="interpret"``
(the interpreter behind ``jax.pure_callback``). Sizes are small: the
interpreter is slow.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from ratiokl import spec  # noqa: E402
from ratiokl.torch import _launch, _route, _triton, loss  # noqa: E402

B, T, V = 3, 4, 37
#: Native and fused paths round the same float32 math in a different order.
RTOL, ATOL = 2e-5, 2e-6

CASES = {
    "ppo_defaults_no_reference": dict(ref="none"),
    "dapo_clip_higher_dual_clip_k3_seq_mean_token_mean": dict(
        clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.1, loss_agg="seq-mean-token-mean"),
    "ratio_cap_k1_straight_through_token_sum_ref_logps_is_weights": dict(
        ref="logps", ratio_cap=1.3, kl_coef=0.2, kl_estimator="k1+", loss_agg="token-sum",
        weights=True),
    "k2_seq_mean_token_sum_packed": dict(
        kl_coef=0.3, kl_estimator="k2", loss_agg="seq-mean-token-sum", packed=True),
    "k3_straight_through_sum_norm_unbounded_per_seq_adv_row_temp": dict(
        kl_coef=0.1, kl_estimator="k3+", loss_agg="seq-mean-token-sum-norm",
        log_ratio_bound=None, per_seq_adv=True, row_temp=True),
    "k3_ratio_weighted_tensor_normalizer_small_bound": dict(
        kl_coef=0.5, kl_estimator="k3-is", loss_normalizer=7.0, log_ratio_bound=0.5),
    "k1_bf16_packed_seq_mean_token_mean": dict(
        kl_coef=0.1, kl_estimator="k1", loss_agg="seq-mean-token-mean", packed=True,
        dtype="bfloat16"),
    "cispo_clip_higher_k3_is_weights_seq_mean_token_mean_packed": dict(
        objective="cispo", clip_eps_high=0.28, kl_coef=0.2, kl_estimator="k3-is",
        loss_agg="seq-mean-token-mean", weights=True, packed=True),
    "cispo_ratio_cap_ref_logps_small_bound_row_temp": dict(
        objective="cispo", clip_eps=0.5, clip_eps_high=1.0, ratio_cap=1.5, ref="logps",
        kl_coef=0.1, log_ratio_bound=1.0, row_temp=True),
    "entropy_bonus_k3_token_mean_masked_vocab": dict(
        entropy_coef=0.3, kl_coef=0.1, masked=True),
    "entropy_penalty_seq_mean_token_mean_row_temp_bf16": dict(
        entropy_coef=-0.2, loss_agg="seq-mean-token-mean", row_temp=True, masked=True,
        dtype="bfloat16"),
    "cispo_entropy_ref_logps_token_sum_packed": dict(
        objective="cispo", entropy_coef=0.25, ref="logps", kl_coef=0.1, loss_agg="token-sum",
        packed=True),
}


def _inputs(seed: int, case: dict):
    """NumPy inputs; inactive rows hold NaN logits, NaN per-token values and bad ids.

    ``masked``: ``-inf`` at every third logit of active rows (never the action; row
    ``[0, 0]`` allows its action alone) and ``+-inf`` rows among the inactive ones.
    """
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    mask = rng.random((B, T)) < 0.75
    mask[0, 0] = True
    logits[~mask] = np.nan
    nan_off = lambda a: np.where(mask, a, np.nan).astype(np.float32)  # noqa: E731
    x = {
        "policy_logits": logits,
        "ref_logits": (logits + rng.normal(0.0, 0.5, logits.shape)).astype(np.float32),
        "action_ids": np.where(mask, rng.integers(0, V, (B, T)), -7),
        "mask": mask,
        "old_logps": nan_off(rng.normal(-3.3, 1.0, (B, T))),
        "advantages": nan_off(rng.normal(0.0, 1.0, (B, T))),
    }
    if case.get("ref") == "logps":
        x["ref_logps"] = nan_off(rng.normal(-3.0, 0.5, (B, T)))
    if case.get("per_seq_adv"):
        x["advantages"] = rng.normal(0.0, 1.0, (B,)).astype(np.float32)
    if case.get("packed"):
        x["segment_ids"] = np.sort(rng.integers(0, 3, (B, T)), axis=-1)
    if case.get("weights"):
        x["importance_weights"] = nan_off(rng.uniform(0.5, 1.5, (B, T)))
    if case.get("row_temp"):
        x["temperature"] = rng.uniform(0.7, 1.4, (B, T)).astype(np.float32)
    if case.get("masked"):
        drop = np.zeros(logits.shape, bool)
        drop[..., ::3] = True
        drop[0, 0] = True
        np.put_along_axis(drop, np.maximum(x["action_ids"], 0)[..., None], False, axis=-1)
        logits[drop & mask[..., None]] = -np.inf
        for n, row in enumerate(map(tuple, np.argwhere(~mask)[:2])):
            logits[row] = (np.inf, -np.inf)[n]
    if case.get("dtype") == "bfloat16":  # exactly representable, so the spec sees the same
        x["policy_logits"] = torch.from_numpy(logits).bfloat16().float().numpy()
        x["ref_logits"] = torch.from_numpy(x["ref_logits"]).bfloat16().float().numpy()
    return x


_FLAGS = ("ref", "per_seq_adv", "packed", "weights", "row_temp", "dtype", "masked")


def _options(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in _FLAGS}


def _torch(x: dict, case: dict, backend: str, upstream: float):
    """``(loss, metrics, grad)`` of one call; the loss is scaled by ``upstream`` before backward."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    dtype = torch.bfloat16 if case.get("dtype") == "bfloat16" else torch.float32
    logits = t.pop("policy_logits").to(dtype).requires_grad_()
    ref = t.pop("ref_logits").to(dtype)
    options = _options(case)
    if "loss_normalizer" in options:
        options["loss_normalizer"] = torch.tensor(options["loss_normalizer"])
    if case.get("ref") == "none":
        ref = None
    elif case.get("ref") == "logps":
        ref = None
    value, metrics = loss.policy_loss(
        logits, ref, t.pop("action_ids"), t.pop("mask"), t.pop("old_logps"),
        t.pop("advantages"), backend=backend, **t, **options,
    )
    (value * upstream).backward()
    return value.item(), {k: v.item() for k, v in metrics.items()}, logits.grad


def _spec(x: dict, case: dict):
    args = {k: v for k, v in x.items() if k != "ref_logits"}
    ref = None if case.get("ref") in ("none", "logps") else x["ref_logits"]
    options = _options(case)
    value, metrics = spec.policy_loss(
        args.pop("policy_logits"), ref, args.pop("action_ids"), args.pop("mask"),
        args.pop("old_logps"), args.pop("advantages"), **args, **options)
    grad = spec.policy_loss_grad(
        x["policy_logits"], ref, x["action_ids"], x["mask"], x["old_logps"], x["advantages"],
        **{k: v for k, v in x.items() if k not in ("policy_logits", "ref_logits", "action_ids",
                                                    "mask", "old_logps", "advantages")},
        **options)
    return value, metrics, grad


def _small_tiles(vocab, itemsize, n_rows, write_grad):
    """8-column tiles, two spans a row (V = 37: tiles 0-2, then 3 and the tail), one program."""
    from ratiokl._kernels import LaunchConfig, split_plan
    from ratiokl._kernels.fused_loss import FusedPlan

    spans = split_plan(vocab, 8, 2)
    return FusedPlan(LaunchConfig(8, 1), spans, spans.splits)


def _small_tiles_meeting(vocab, itemsize, n_rows, write_grad):
    """As :func:`_small_tiles`, a program per span: the two meet at the row's counter."""
    return _small_tiles(vocab, itemsize, n_rows, write_grad)._replace(spans_per_program=1)


@pytest.mark.parametrize("tiles", ["one_tile", "spans_of_8_wide_tiles",
                                   "spans_of_8_wide_tiles_meeting"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_spec_and_native(name, tiles, monkeypatch):
    """A row in one tile (the default here), or in spans of several tiles and a tail,
    taken by one program or by a program per span meeting at the row's counter."""
    if tiles != "one_tile":
        small = _small_tiles_meeting if tiles.endswith("meeting") else _small_tiles
        monkeypatch.setattr(_launch, "launch_plan", small)
        assert small(V, 4, B * T, True).spans == (2, 3)
    case = CASES[name]
    x = _inputs(sum(map(ord, name)), case)
    upstream = 1.0 if name.startswith("ppo") else -2.5  # 1: the backward's device-side skip
    f_loss, f_metrics, f_grad = _torch(x, case, "interpret", upstream)
    n_loss, n_metrics, n_grad = _torch(x, case, "native", upstream)
    e_loss, e_metrics, e_grad = _spec(x, case)
    bf16 = case.get("dtype") == "bfloat16"
    # bf16: the stored gradient is rounded once, then once more when scaled by upstream != 1.
    grad_tol = dict(rtol=2**-6, atol=2**-7 * np.abs(e_grad).max()) if bf16 else \
        dict(rtol=1e-4, atol=1e-5 * max(1.0, np.abs(e_grad).max()))
    np.testing.assert_allclose(f_loss, n_loss, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(f_loss, e_loss, rtol=1e-4, atol=1e-5)
    for key, value in e_metrics.items():
        np.testing.assert_allclose(f_metrics[key], n_metrics[key], rtol=RTOL, atol=ATOL,
                                   err_msg=key)
        np.testing.assert_allclose(f_metrics[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    fused = f_grad.float().numpy()
    np.testing.assert_allclose(fused, upstream * e_grad, **grad_tol)
    np.testing.assert_allclose(fused, n_grad.float().numpy(), **grad_tol)
    assert f_grad.dtype == n_grad.dtype
    inactive = ~x["mask"]
    assert np.all(fused[inactive] == 0.0), "inactive rows must get exactly 0"
    assert np.all(np.isfinite(fused)), "masked (-inf) logits keep the gradient finite"
    assert np.isfinite(f_loss) and f_metrics["entropy_mean"] > 0


def test_all_inactive_gives_zero_loss_metrics_and_grad():
    case = dict(kl_coef=0.1)
    x = _inputs(5, case)
    x["mask"][:] = False
    x["action_ids"][:] = -1
    value, metrics, grad = _torch(x, case, "interpret", 3.0)
    assert value == 0.0 and all(v == 0.0 for v in metrics.values())
    assert torch.equal(grad, torch.zeros_like(grad))


def test_empty_input():
    logits = torch.zeros((0, T, V), requires_grad=True)
    rows = torch.zeros(0, T)
    value, _ = loss.policy_loss(logits, None, torch.zeros((0, T), dtype=torch.long),
                                torch.zeros((0, T), dtype=torch.bool), rows, rows,
                                backend="interpret")
    value.backward()
    assert value.item() == 0.0 and logits.grad.shape == (0, T, V)


@pytest.mark.parametrize("kl", [False, True], ids=["no_kl", "k3"])
def test_a_nan_input_on_an_active_row_is_nan_as_in_the_two_pass_path(kl):
    """NaN ``old_logps`` (or reference log-probs) on an active row makes the loss NaN,
    through ``log_ratio_bound`` too, on both paths; the other rows' gradients stay finite.

    (The bound was ``min(max(x, -b), b)``: on a GPU ``max.f32`` returns the non-NaN
    operand, so the poison vanished there, as it does in Triton >= 3.7's interpreter.)
    """
    x = _inputs(31, {})
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    old = t["old_logps"].clone()
    ref_lp = old + 0.1
    (ref_lp if kl else old)[0, 0] = float("nan")
    t["mask"][0, 0] = True
    got = []
    for backend in ("native", "interpret"):
        logits = t["policy_logits"].clone().requires_grad_()
        value, _ = loss.policy_loss(logits, None, t["action_ids"], t["mask"], old,
                                    t["advantages"], ref_logps=ref_lp,
                                    kl_coef=0.1 if kl else 0.0, backend=backend)
        value.backward()
        got.append((value.item(), logits.grad.numpy()))
    for value, grad in got:
        assert np.isnan(value)
        others = np.ones((B, T), bool)
        others[0, 0] = False
        assert np.all(np.isfinite(grad[others]))


def test_unchecked_bad_active_id_poisons_only_its_row():
    x = _inputs(9, {})
    x["action_ids"][0, 0] = V + 3
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    logits = t["policy_logits"].requires_grad_()
    value, _ = loss.policy_loss(logits, None, t["action_ids"], t["mask"], t["old_logps"],
                                t["advantages"], backend="interpret", check_ids=False)
    value.backward()
    assert np.isnan(value.item())
    grad = logits.grad.numpy()
    assert np.all(np.isnan(grad[0, 0]))
    others = np.ones((B, T), bool)
    others[0, 0] = False
    assert np.all(np.isfinite(grad[others]))


def test_route_fuses_every_option_but_gspo(monkeypatch):
    """The fused kernel runs for every option set but GSPO's (``entropy_coef`` included);
    the native backend has none."""
    backend = _route.resolve("interpret", torch.device("cpu"))
    assert backend.policy_loss is _triton.policy_loss
    assert _route.resolve("native", torch.device("cpu")).policy_loss is None
    launches = []
    run = _launch.POLICY_LOSS.run
    monkeypatch.setattr(_launch.POLICY_LOSS, "run",
                        lambda *a: launches.append(1) or run(*a))
    x = _inputs(5, dict(kl_coef=0.1))
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    args = (t["policy_logits"], None, t["action_ids"], t["mask"], t["old_logps"],
            t["advantages"])
    for options, fuses in ((dict(kl_coef=0.1, dual_clip=2.0, kl_estimator="k3-is"), True),
                           (dict(loss_agg="seq-mean-token-mean"), True),
                           (dict(entropy_coef=0.01), True),
                           (dict(entropy_coef=torch.tensor(0.01), objective="cispo"), True),
                           (dict(ratio_level="sequence"), False),
                           (dict(ratio_level="sequence", entropy_coef=0.01), False)):
        launches.clear()
        loss.policy_loss(*args, ref_logps=t["old_logps"] + 0.1, backend="interpret",
                         **options)
        assert bool(launches) == fuses, options


def test_gspo_falls_back_to_two_pass_and_matches_spec():
    case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean", kl_coef=0.1)
    x = _inputs(11, case)
    f_loss, _, f_grad = _torch(x, case, "interpret", 1.0)
    e_loss, _, e_grad = _spec(x, case)
    np.testing.assert_allclose(f_loss, e_loss, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(f_grad.numpy(), e_grad, rtol=1e-4, atol=1e-6)


def test_two_pass_backward_has_an_entropy_term_only_with_a_coefficient(monkeypatch):
    """GSPO's two-pass route always computes the entropy (``entropy_mean``); nothing
    differentiates it without a coefficient, so its backward kernel has no entropy term."""
    flags = []
    run = _launch.BACKWARD.run
    monkeypatch.setattr(_launch.BACKWARD, "run",
                        lambda *a: flags.append(a[-1] is True) or run(*a))
    for coef in (0.0, 0.2):
        flags.clear()
        case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean", entropy_coef=coef)
        x = _inputs(47, case)
        f_loss, f_metrics, f_grad = _torch(x, case, "interpret", 1.0)
        e_loss, e_metrics, e_grad = _spec(x, case)
        assert flags == [coef != 0.0], (coef, flags)
        np.testing.assert_allclose(f_grad.numpy(), e_grad, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(f_metrics["entropy_mean"], e_metrics["entropy_mean"],
                                   rtol=1e-5)


# --- the JAX launch, through backend="interpret" ------------------------------------------


def test_jax_fused_launch_matches_torch_under_jit_grad_vmap():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    case = dict(clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.1,
                loss_agg="seq-mean-token-mean", packed=True)
    x = _inputs(13, case)
    options = _options(case)
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits, ref, ids, mask, old, adv, segs):
        value, metrics = jax_loss.policy_loss(
            logits, ref, ids, mask, old, adv, segment_ids=segs, backend="interpret",
            check_ids=False, **options)
        return -2.5 * value, metrics

    args = (j["policy_logits"], j["ref_logits"], j["action_ids"], j["mask"],
            j["old_logps"], j["advantages"], j["segment_ids"])
    (value, metrics), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(*args)
    t_loss, t_metrics, t_grad = _torch(x, case, "interpret", -2.5)
    np.testing.assert_allclose(float(value), -2.5 * t_loss, rtol=RTOL, atol=ATOL)
    for key, v in t_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), v, rtol=RTOL, atol=ATOL, err_msg=key)
    np.testing.assert_allclose(np.asarray(grad), t_grad.numpy(), rtol=1e-5, atol=1e-7)
    assert np.all(np.asarray(grad)[~x["mask"]] == 0.0)
    # vmap over a batch of two problems folds into rows: each equals its own call.
    stacked = [jnp.stack([a, a]) for a in args]
    batched = jax.vmap(jax.grad(lambda *a: objective(*a)[0]))(*stacked)
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(grad), rtol=1e-6, atol=1e-8)


def test_a_rows_results_do_not_depend_on_the_batch():
    # w = 1: each row's gradient is its own (the entropy term's too).
    case = dict(kl_coef=0.1, loss_agg="token-sum", entropy_coef=0.1)
    x = _inputs(17, case)
    full = _torch(x, case, "interpret", -1.5)
    part = _torch({k: v[:2] for k, v in x.items()}, case, "interpret", -1.5)
    assert torch.equal(full[2][:2], part[2])


def test_second_backward_of_the_consumed_gradient_raises():
    x = _inputs(19, {})
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    logits = t["policy_logits"].requires_grad_()
    value, _ = loss.policy_loss(logits, None, t["action_ids"], t["mask"], t["old_logps"],
                                t["advantages"], backend="interpret")
    (2.0 * value).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (2.0 * value).backward()


def test_forward_without_gradient_skips_the_sweep_and_gives_the_same_bits(monkeypatch):
    case = dict(kl_coef=0.1, ref="logps")
    x = _inputs(23, case)
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    args = (t["policy_logits"], None, t["action_ids"], t["mask"], t["old_logps"], t["advantages"])
    kw = dict(ref_logps=t["ref_logps"], kl_coef=0.1, backend="interpret")
    with_grad, _ = loss.policy_loss(args[0].clone().requires_grad_(), *args[1:], **kw)
    shapes = []
    launch = _launch.POLICY_LOSS.run

    def spy(*a, **k):
        outs = launch(*a, **k)
        shapes.append(tuple(outs[2].shape))
        return outs

    monkeypatch.setattr(_launch.POLICY_LOSS, "run", spy)
    with torch.no_grad():
        no_grad, metrics = loss.policy_loss(args[0].clone().requires_grad_(), *args[1:], **kw)
    frozen, _ = loss.policy_loss(args[0], *args[1:], **kw)
    assert shapes == [(0, V), (0, V)]  # no [N, V] gradient allocated or written
    assert no_grad.item() == with_grad.item() == frozen.item()
    assert np.isfinite(metrics["kl_mean"].item())


def _fused_launches(launches):
    """The recorded launches of the fused kernel (not the backward's scale)."""
    return [launch for launch in launches if launch.kernel == "policy_loss_kernel"]


def test_jax_primal_reads_once_and_matches_value_and_grad():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import _interpret
    from ratiokl.jax import loss as jax_loss

    x = _inputs(29, {})
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits):
        return jax_loss.policy_loss(logits, None, j["action_ids"], j["mask"], j["old_logps"],
                                    j["advantages"], backend="interpret", check_ids=False)[0]

    with _interpret.recording() as launches:
        primal = jax.block_until_ready(jax.jit(objective)(j["policy_logits"]))
        value, grad = jax.block_until_ready(
            jax.jit(jax.value_and_grad(objective))(j["policy_logits"]))
    written = [launch.constants["WRITE_GRAD"] for launch in _fused_launches(launches)]
    assert written == [False, True]
    assert float(primal) == float(value)
    assert np.all(np.asarray(grad)[~x["mask"]] == 0.0)


# --- opt-in in-place gradient -----------------------------------------------------------------


def _inplace_call(x: dict, case: dict, logits: torch.Tensor, **kw):
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items() if k != "policy_logits"}
    return loss.policy_loss(
        logits, None, t["action_ids"], t["mask"], t["old_logps"], t["advantages"],
        ref_logps=t.get("ref_logps"), backend="interpret", **_options(case), **kw)


def test_inplace_grad_writes_the_gradient_into_the_logits_buffer():
    case = dict(kl_coef=0.1, ref="logps", dual_clip=3.0)
    x = _inputs(31, case)
    want_loss, want_metrics, want_grad = _torch(x, case, "interpret", -1.5)
    base = torch.from_numpy(x["policy_logits"]).requires_grad_()
    logits = base * 1.0  # a non-leaf, as the output of an lm head would be
    value, metrics = _inplace_call(x, case, logits, inplace_grad=True)
    assert value.item() == want_loss
    assert {k: v.item() for k, v in metrics.items()} == want_metrics
    (-1.5 * value).backward()
    # The logits' own buffer now holds d loss / d logits (upstream -1.5 included) ...
    assert torch.equal(logits.detach(), want_grad)
    # ... which is what reached the leaf, bit for bit, inactive rows exactly 0.
    assert torch.equal(base.grad, want_grad)
    assert torch.all(base.grad[torch.from_numpy(~x["mask"])] == 0.0)


def test_inplace_grad_fails_loudly_where_the_logits_are_needed_again():
    case = dict(ref="logps", kl_coef=0.1)
    x = _inputs(37, case)
    pre = torch.from_numpy(x["policy_logits"]).requires_grad_()
    logits = torch.tanh(pre)  # tanh's backward needs its output: the logits
    value, _ = _inplace_call(x, case, logits, inplace_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        value.backward()
    value, _ = _inplace_call(x, case, torch.from_numpy(x["policy_logits"]).requires_grad_(),
                             inplace_grad=True)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_grad=True.*once"):
        value.backward()
    with pytest.raises(ValueError, match="contiguous `policy_logits`"):
        strided = torch.from_numpy(x["policy_logits"]).transpose(0, 1).requires_grad_()
        _inplace_call({**x, "action_ids": x["action_ids"].T, "mask": x["mask"].T,
                       "old_logps": x["old_logps"].T, "advantages": x["advantages"].T,
                       "ref_logps": x["ref_logps"].T}, case, strided, inplace_grad=True)


def test_inplace_grad_without_a_gradient_leaves_the_logits_alone():
    case = dict(ref="logps", kl_coef=0.1)
    x = _inputs(41, case)
    logits = torch.from_numpy(x["policy_logits"].copy())
    with torch.no_grad():
        value, _ = _inplace_call(x, case, logits.clone().requires_grad_(), inplace_grad=True)
    frozen, _ = _inplace_call(x, case, logits, inplace_grad=True)
    np.testing.assert_array_equal(logits.numpy(), x["policy_logits"])  # NaN rows included
    assert value.item() == frozen.item()


def test_jax_inplace_grad_aliases_the_logits_and_matches():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from ratiokl.jax import _interpret
    from ratiokl.jax import loss as jax_loss

    x = _inputs(43, {})
    j = {k: jnp.asarray(v) for k, v in x.items()}

    def objective(logits, inplace):
        return -1.5 * jax_loss.policy_loss(
            logits, None, j["action_ids"], j["mask"], j["old_logps"], j["advantages"],
            backend="interpret", check_ids=False, inplace_grad=inplace)[0]

    with _interpret.recording() as launches:
        want = jax.block_until_ready(
            jax.jit(jax.value_and_grad(lambda p: objective(p, False)))(j["policy_logits"]))
        got = jax.block_until_ready(
            jax.jit(jax.value_and_grad(lambda p: objective(p, True)), donate_argnums=0)(
                jnp.array(j["policy_logits"])))
    aliases = [launch.aliases for launch in _fused_launches(launches)]
    assert aliases == [{}, {0: 6}]  # the gradient: after the six per-row outputs
    assert float(got[0]) == float(want[0])
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("lead", [(3, 5), (2, 2, 4)], ids=["rows", "two_leading_axes"])
def test_per_sequence_advantages_reach_the_kernel_as_given(lead, monkeypatch):
    """Advantages given per sequence are read as ``adv[row // T]`` (no ``[N]`` copy): the
    same bits as the same values given per token, gradient included."""
    g = torch.Generator().manual_seed(7)
    vocab = 37
    logits = torch.randn(*lead, vocab, generator=g)
    ids = torch.randint(0, vocab, lead, generator=g)
    mask = torch.rand(lead, generator=g) < 0.8
    old = -torch.rand(lead, generator=g) * 4
    per_sequence = torch.randn(lead[:-1], generator=g)
    seen = []
    launch = _launch.POLICY_LOSS.run
    monkeypatch.setattr(_launch.POLICY_LOSS, "run",
                        lambda binding, *args: seen.append(args[7:9]) or launch(binding, *args))

    def call(advantages):
        x = logits.clone().requires_grad_()
        value, metrics = loss.policy_loss(x, None, ids, mask, old, advantages,
                                          backend="interpret", clip_eps=0.1)
        return [value, *metrics.values(), torch.autograd.grad(value, x)[0]]

    given = call(per_sequence)
    expanded = call(per_sequence[..., None].expand(lead).contiguous())
    for a, b in zip(given, expanded):
        assert torch.equal(a, b)
    (adv, rows), (adv_tokens, one) = seen
    assert rows == lead[-1] and adv.shape == (math.prod(lead[:-1]),)
    assert one == 1 and adv_tokens.shape == (math.prod(lead),)
