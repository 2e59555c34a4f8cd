"""verl's own loss code against ``ratiokl.torch.loss.policy_loss``, on the same batch.

verl (0.9.1, tested) is the oracle: ``workers.utils.losses.ppo_loss`` (its model-engine
actor's loss step: ``core_algos``' registered policy losses, ``agg_loss`` with the
engine's ``dp_size`` / ``batch_num_tokens`` / ``global_batch_size``, ``kl_penalty`` and
the entropy term) on float64 log-probs and entropies from verl's own
``logprobs_from_logits`` / ``entropy_from_logits``, and ``rollout_corr_helper`` for the
rollout-correction weights and rejection mask. ratiokl gets the float32 logits with
NaN / inf on the padded positions (``tests/helpers/trainer_batch.py``) and the options
``_mapped`` gives; the loss and the logits' gradient must agree. The tests named
``*_differs`` pin a difference ``docs/policy_loss.md`` states. Runs in its own venv
(``.ci/run`` block (d)); skipped where verl is not importable.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is not installed (see .ci/run block (d))")

import verl.utils.torch_functional as verl_F  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from assertions import assert_close  # noqa: E402
from trainer_batch import (  # noqa: E402
    LENGTHS, B, T, assert_matches, differs, make_batch, token_logps, tolerances)
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_and_rejection_mask)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from ratiokl.spec import rounding_tolerance, trainer_tolerance  # noqa: E402
from ratiokl.torch import loss  # noqa: E402

P = 2  # prompt positions; row 1's prompt is left-padded to one token
AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm")
KL = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3",
      "k1+": "k1+", "k3+": "k3+"}
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)


def _config(loss_mode="vanilla", **fields) -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode), **fields)


def _engine_info(mask, dp_size=1, batch_num_tokens=None, global_batch_size=None):
    """What verl's FSDP engine sets: every rank's active tokens, the mini-batch's sequences."""
    return dict(dp_size=dp_size,
                batch_num_tokens=float(mask.sum()) if batch_num_tokens is None else batch_num_tokens,
                global_batch_size=B if global_batch_size is None else global_batch_size)


def _rollout_mapping(rollout: dict):
    """verl's ``rollout_is`` / ``rollout_rs`` settings as ratiokl's rollout options."""
    if rollout.get("rollout_rs") == "token_k1":
        # rejection keeps 1/hi <= exp(old - rollout)... as a bound on the inverse ratio;
        # the kept tokens carry rollout_is="token"'s weight
        lower, upper = (float(v) for v in rollout["rollout_rs_threshold"].split("_"))
        return "token-mask", (1.0 / upper, 1.0 / lower)
    level, threshold = rollout["rollout_is"], rollout["rollout_is_threshold"]
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = (float(v) for v in threshold.split("_"))
        return f"{level}-mask", (lo, hi)
    return f"{level}-truncate", (0.0, float(threshold))


def _mapped(config: ActorConfig, info: dict, rollout=None) -> dict:
    """ratiokl's options for a verl actor config and the engine's batch info."""
    agg, dp = config.loss_agg_mode, info["dp_size"]
    mode = config.policy_loss.loss_mode
    normalizer = {
        "token-mean": info["batch_num_tokens"] / dp,
        "token-sum": 1.0 / dp,
        "seq-mean-token-mean": info["global_batch_size"] / dp,
        "seq-mean-token-sum": info["global_batch_size"] / dp,
        "seq-mean-token-sum-norm":
            info["global_batch_size"] * (config.loss_scale_factor or T) / dp,
    }[agg]
    options = dict(clip_eps=config.clip_ratio_low, clip_eps_high=config.clip_ratio_high,
                   loss_agg=agg, loss_normalizer=normalizer, entropy_coef=config.entropy_coeff)
    if mode == "vanilla":
        options["dual_clip"] = config.clip_ratio_c
    elif mode == "gspo":
        options["ratio_level"] = "sequence"
    elif mode == "cispo":
        options["objective"] = "cispo"
    if config.use_kl_loss:
        options.update(kl_coef=config.kl_loss_coef, kl_estimator=KL[config.kl_loss_type])
    if rollout:
        options["rollout_correction"], options["rollout_bounds"] = _rollout_mapping(rollout)
    return options


def _flat(values, mask):
    """A ``[B, T]`` response tensor in the engine's no-padding layout: each sequence's
    prompt and response positions, the response's values one position early."""
    prompt_lens = mask[:, :P].sum(1).tolist()
    rows = [torch.cat([values.new_zeros(p - 1), values[b, :r], values.new_zeros(1)])
            for b, (p, r) in enumerate(zip(prompt_lens, LENGTHS))]
    return torch.cat(rows)


def _verl_loss(config, batch, info, temperature=1.0, seq_adv=False, entropy=False,
               rollout=None):
    """verl's ``ppo_loss`` on float64 log-probs of the batch's logits: ``(loss, grad)``."""
    x = batch.logits.double().requires_grad_()
    z = x / temperature
    logp = verl_F.logprobs_from_logits(z, batch.ids)
    response_mask, extra = batch.mask, {}
    if rollout:
        weights, response_mask, _ = compute_rollout_correction_and_rejection_mask(
            batch.old.double(), batch.rollout.double(), batch.mask.double(), **rollout)
        response_mask = response_mask.bool()
        if weights is not None:
            extra["rollout_is_weights"] = weights.batch["rollout_is_weights"]
        info = {**info, "batch_num_tokens": float(response_mask.sum())}
    attention = torch.ones(B, P + T, dtype=torch.long)
    attention[1, 0] = 0
    attention[:, P:] = batch.mask
    data = TensorDict({
        "prompts": torch.zeros(B, P, dtype=torch.long), "responses": batch.ids,
        "attention_mask": attention, "response_mask": response_mask,
        "old_log_probs": batch.old.double(),
        "advantages": (batch.adv_seq if seq_adv else batch.adv).double(),
        "ref_log_prob": batch.ref.double(), **extra}, batch_size=[B])
    tu.assign_non_tensor(data, **info)
    output = {"log_probs": _flat(logp, attention)}
    if entropy:
        output["entropy"] = _flat(verl_F.entropy_from_logits(z), attention)
    value, _ = ppo_loss(config, output, data)
    value.backward()
    return value.detach(), x.grad


def _ratiokl_loss(batch, options, backend, temperature=1.0, seq_adv=False):
    p = batch.poisoned()
    y = p.logits.clone().requires_grad_()
    value, metrics = loss.policy_loss(
        y, None, batch.ids, batch.mask, p.old, p.adv_seq if seq_adv else p.adv,
        ref_logps=p.ref, rollout_logps=p.rollout if "rollout_correction" in options else None,
        temperature=temperature, backend=backend, **options)
    value.backward()
    return value.detach(), y.grad, metrics


CASES = {
    **{f"vanilla_{agg}": dict(fields=dict(loss_agg_mode=agg, **CLIP)) for agg in AGGS},
    **{f"gspo_{agg}": dict(mode="gspo", seq_adv=True, fields=dict(
        loss_agg_mode=agg, clip_ratio_low=0.1, clip_ratio_high=0.15)) for agg in AGGS},
    **{f"cispo_{agg}": dict(mode="cispo", fields=dict(loss_agg_mode=agg, **CLIP))
       for agg in ("token-mean", "seq-mean-token-sum-norm")},
    "vanilla_dual_clip_2": dict(fields=dict(clip_ratio_c=2.0, **CLIP)),
    "dp2_token_mean": dict(info=dict(dp_size=2, batch_num_tokens=31.0), fields=CLIP),
    "dp2_token_sum": dict(info=dict(dp_size=2), fields=dict(loss_agg_mode="token-sum")),
    "dp2_seq_mean_token_mean": dict(info=dict(dp_size=2, global_batch_size=9), fields=dict(
        loss_agg_mode="seq-mean-token-mean")),
    "dp2_sum_norm_scale_factor": dict(info=dict(dp_size=2, global_batch_size=9), fields=dict(
        loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16)),
    **{f"kl_{kind}": dict(fields=dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type=kind))
       for kind in ("low_var_kl", "kl", "mse", "k1+", "k3+")},
    "kl_low_var_kl_sum_norm": dict(fields=dict(
        use_kl_loss=True, kl_loss_coef=0.3, loss_agg_mode="seq-mean-token-sum-norm")),
    "entropy_token_mean": dict(entropy=True, fields=dict(entropy_coeff=0.05)),
    "entropy_seq_mean_token_mean": dict(entropy=True, fields=dict(
        entropy_coeff=0.05, loss_agg_mode="seq-mean-token-mean")),
    "entropy_kl_mse_temperature": dict(entropy=True, temperature=0.7, fields=dict(
        entropy_coeff=-0.02, use_kl_loss=True, kl_loss_type="mse", kl_loss_coef=0.2)),
    "rollout_is_token_tis": dict(rollout=dict(rollout_is="token", rollout_is_threshold=2.0)),
    "rollout_is_sequence_tis": dict(rollout=dict(rollout_is="sequence",
                                                 rollout_is_threshold=2.0)),
    "rollout_is_token_icepop": dict(rollout=dict(rollout_is="token",
                                                 rollout_is_threshold="0.5_5.0")),
    "rollout_is_sequence_icepop": dict(rollout=dict(rollout_is="sequence",
                                                    rollout_is_threshold="0.3_3.0")),
    "rollout_rs_token_k1": dict(rollout=dict(
        rollout_is="token", rollout_is_threshold=5.0, rollout_rs="token_k1",
        rollout_rs_threshold="0.2_2.0")),
}


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_verl_ppo_loss(name, backend):
    case = CASES[name]
    if backend == "interpret":
        pytest.importorskip("triton")
    batch = make_batch()
    config = _config(case.get("mode", "vanilla"), **case.get("fields", CLIP))
    info = _engine_info(batch.mask, **case.get("info", {}))
    temperature, seq_adv = case.get("temperature", 1.0), case.get("seq_adv", False)
    want, want_grad = _verl_loss(config, batch, info, temperature, seq_adv,
                                 case.get("entropy", False), case.get("rollout"))
    options = _mapped(config, info, case.get("rollout"))
    if case.get("rollout", {}).get("rollout_rs"):  # rejected tokens leave verl's denominator
        rejected = compute_rollout_correction_and_rejection_mask(
            batch.old, batch.rollout, batch.mask.float(), **case["rollout"])[1]
        options["loss_normalizer"] = float(rejected.sum())
    got, grad, _ = _ratiokl_loss(batch, options, backend, temperature, seq_adv)
    assert_matches(got, grad, want, want_grad, batch, temperature)


def test_clip_metrics_match_verl():
    """``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` are ratiokl's
    ``clip_fraction``, ``dual_clip_fraction`` and ``approx_kl``."""
    batch, config = make_batch(), _config(**CLIP)
    _, metrics = core_algos.compute_policy_loss_vanilla(
        batch.old.double(), token_logps(batch.logits.double(), batch.ids), batch.adv.double(),
        batch.mask, config=config)
    _, _, got = _ratiokl_loss(batch, _mapped(config, _engine_info(batch.mask)), "native")
    assert got["dual_clip_fraction"] > 0 and got["clip_fraction"] > 0
    for verl_key, key in (("pg_clipfrac", "clip_fraction"), ("ppo_kl", "approx_kl"),
                          ("pg_clipfrac_lower", "dual_clip_fraction")):
        assert_close(got[key], metrics[f"actor/{verl_key}"], trainer_tolerance(B * T),
                     verl_key)  # verl's, in float64


def test_fused_linear_forward_matches_selected_logprobs():
    """verl's fused actor forward (``use_fused_kernels``, torch backend: ``FusedLinearForPPO``
    on the last hidden states and the lm_head weight, float32 inside) gives the log-probs
    and entropies ratiokl's ``selected_logprobs`` gives on ``hidden @ weight.T``, and the
    same gradients to both (the seam ``linear_selected_logprobs`` will take)."""
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(B, T, 16, generator=g), torch.randn(37, 16, generator=g)
    ids = torch.randint(0, 37, (B, T), generator=g)
    up = torch.randn(2, B, T, generator=g)

    def run(fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp, ent = fn(h, w)
        ((logp * up[0]).sum() + (ent * up[1]).sum()).backward()
        return logp.detach(), ent.detach(), h.grad, w.grad

    want = run(lambda h, w: FusedLinearForPPO(chunk_size=7)(h, w, ids, 0.8))
    got = run(lambda h, w: loss.selected_logprobs(h @ w.T, ids, temperature=0.8,
                                                  backend="native", return_entropy=True))
    for what, a, e in zip(("log_probs", "entropy", "d/d hidden", "d/d weight"), got, want):
        _, tol = tolerances(hidden @ weight.T, e, temperature=0.8, both_float32=True)
        assert_close(a, e, tol, what)


def test_seq_mean_token_sum_norm_default_denominator_differs():
    """verl 0.9.1 divides ``seq-mean-token-sum-norm`` by ``global_batch_size *
    loss_scale_factor / dp_size`` (by default the non-empty sequences times ``T``);
    ratiokl's default ``D`` is ``T``: the mapping passes ``loss_normalizer``."""
    batch, config = make_batch(), _config(loss_agg_mode="seq-mean-token-sum-norm", **CLIP)
    want, _ = core_algos.compute_policy_loss_vanilla(
        batch.old.double(), token_logps(batch.logits.double(), batch.ids), batch.adv.double(),
        batch.mask, loss_agg_mode=config.loss_agg_mode, config=config)
    options = _mapped(config, _engine_info(batch.mask, global_batch_size=4))
    got, grad, _ = _ratiokl_loss(batch, options, "native")
    tol, _ = tolerances(batch.logits, grad)
    assert not differs(got, want, tol)
    default, _, _ = _ratiokl_loss(batch, {**options, "loss_normalizer": None}, "native")
    assert differs(default, want, tol)
    # The same sums over a denominator a quarter as large: a division's rounding each.
    assert_close(default, 4 * got, rounding_tolerance(2), "default / got")


def test_k3_value_clamp_differs():
    """verl clamps the k3 *value* to ``[-10, 10]`` (zero gradient beyond); ratiokl bounds
    only ``d`` (at ``log_ratio_bound``). One token with ``d = 4`` (k3 = 49.6) tells them
    apart; below the clamp they agree (``kl_low_var_kl`` above)."""
    batch = make_batch()
    logp = token_logps(batch.logits.double(), batch.ids)
    ref = batch.ref.clone()
    ref[0, 0] = float(logp[0, 0]) + 4.0
    batch = type(batch)(**{**batch.__dict__, "ref": ref})
    config = _config(use_kl_loss=True, kl_loss_coef=0.1, **CLIP)
    info = _engine_info(batch.mask)
    want, want_grad = _verl_loss(config, batch, info)
    got, grad, _ = _ratiokl_loss(batch, _mapped(config, info), "native")
    tol, _ = tolerances(batch.logits, want_grad)
    assert differs(got, want, tol)
