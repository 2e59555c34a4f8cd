"""``ratiokl.adapters.verl``'s policy losses against verl's own, on the same batch.

verl (0.9.1, tested) is the oracle. Each case runs one of verl's registered policy
losses (``vanilla``, ``gspo``, ``cispo``, from ``core_algos``' registry) on float64
log-probs and the adapter's registered loss (``loss_mode="ratiokl"``, ``"ratiokl_gspo"``,
``"ratiokl_cispo"``) on float32 copies holding NaN / inf on every padded position, with
the same ``ActorConfig`` and engine batch info; the loss, the gradient w.r.t.
``log_prob`` and the clip metrics must agree, and the adapter's gradient must be exactly
0 on the padding. ``test_ppo_loss_*`` run verl's whole ``workers/utils/losses.ppo_loss``
(the model engine's loss step: the policy loss chosen by the config key, then verl's
entropy bonus and KL loss) with ``loss_mode`` switched. The fused forward and a training
step are in ``test_verl_forward.py``. Runs in verl's venv (``.ci/run`` block (d)).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is not installed (see .ci/run block (d))")

from assertions import assert_close  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from trainer_batch import LENGTHS, B, T, make_batch, token_logps, tolerances  # noqa: E402
from verl.trainer.ppo.core_algos import get_policy_loss_fn  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import (  # noqa: E402
    compute_rollout_correction_and_rejection_mask)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import ratiokl.adapters.verl as adapter  # noqa: E402
from ratiokl.spec import trainer_tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OURS = {"vanilla": "ratiokl", "gspo": "ratiokl_gspo", "cispo": "ratiokl_cispo"}
AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm")
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
#: The engine's global batch info beyond the local batch's own counts.
GLOBAL = dict(dp_size=2, batch_num_tokens=31, global_batch_size=9, loss_scale_factor=16)
ROLLOUT = {"token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
           "sequence_icepop": dict(rollout_is="sequence", rollout_is_threshold="0.3_3.0")}

CASES = {
    **{f"{mode}_{agg}_{info}": dict(mode=mode, agg=agg, info=info)
       for mode in OURS for agg in AGGS for info in ("local", "global")},
    "vanilla_dual_clip_2": dict(mode="vanilla", fields=dict(clip_ratio_c=2.0)),
    "vanilla_clip_ratio_only": dict(mode="vanilla", fields=dict(clip_ratio=0.15)),
    "gspo_seq_log_ratio_past_10": dict(mode="gspo", shift=11.0),
    **{f"{mode}_rollout_{name}": dict(mode=mode, rollout=name)
       for mode in OURS for name in ROLLOUT},
}


def _config(mode: str, agg: str = "token-mean", **fields) -> ActorConfig:
    fields = {"loss_agg_mode": agg, **({} if "clip_ratio" in fields else CLIP), **fields}
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(loss_mode=mode), **fields)


def _info(mask, which: str) -> dict:
    """``ppo_loss``'s ``global_batch_info``: this batch's counts on one rank, or GLOBAL."""
    if which == "global":
        return dict(GLOBAL)
    return dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=B,
                loss_scale_factor=None)


def _rollout_weights(batch, name):
    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        batch.old.double(), batch.rollout.double(), batch.mask.double(), **ROLLOUT[name])
    return weights.batch["rollout_is_weights"]


def _inputs(case):
    """``(batch, verl's float64 log_prob, old, advantages, weights)``."""
    batch = make_batch()
    logp = token_logps(batch.logits.double(), batch.ids)
    old = batch.old.double()
    if "shift" in case:  # row 0's mean log-ratio past GSPO's bound of 10
        old = torch.where(torch.arange(B)[:, None] == 0, old - case["shift"], old)
    adv = (batch.adv_seq if case["mode"] == "gspo" and "shift" not in case else batch.adv)
    weights = _rollout_weights(batch, case["rollout"]) if "rollout" in case else None
    return batch, logp, old, adv.double(), weights


def _poison(x, mask):
    """ratiokl's copy: float32, NaN / inf / -inf on the padded positions."""
    bad = torch.tensor([float("nan"), float("inf"), float("-inf")])
    pad = ~mask
    out = x.detach().float().clone()
    out[pad] = bad[torch.arange(int(pad.sum())) % 3]
    return out


def _run(name, config, logp, old, adv, mask, weights):
    x = logp.detach().clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
        loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=weights)
    loss.backward()
    return loss.detach(), x.grad, metrics


def _assert_agree(batch, got, want):
    (value, grad, metrics), (want_value, want_grad, want_metrics) = got, want
    tol_value, tol_grad = tolerances(batch.logits, want_grad)
    assert_close(value, want_value, tol_value, "loss")
    assert_close(grad, want_grad, tol_grad, "d loss / d log_prob")
    assert torch.all(grad[~batch.mask] == 0)
    for key, want_metric in want_metrics.items():  # verl's, in float64
        assert_close(metrics[key], want_metric, trainer_tolerance(B * T), key)


@pytest.mark.parametrize("name", list(CASES))
def test_registered_loss_matches_verl(name):
    case = CASES[name]
    batch, logp, old, adv, weights = _inputs(case)
    mask = batch.mask
    config = _config(case["mode"], case.get("agg", "token-mean"), **case.get("fields", {}))
    config.global_batch_info.update(_info(mask, case.get("info", "local")))
    want = _run(case["mode"], config, logp, old, adv, mask, weights)
    ours = _config(OURS[case["mode"]], config.loss_agg_mode, **case.get("fields", {}))
    ours.global_batch_info.update(config.global_batch_info)
    got = _run(OURS[case["mode"]], ours, _poison(logp, mask), _poison(old, mask),
               _poison(adv, mask), mask, None if weights is None else _poison(weights, mask))
    _assert_agree(batch, got, want)


def test_empty_batch_info_takes_verl_defaults():
    """Called outside the engine (``global_batch_info`` empty) the denominators are
    ``agg_loss``'s defaults: active tokens, non-empty sequences, ``T``."""
    batch, logp, old, adv, _ = _inputs(dict(mode="vanilla"))
    for agg in AGGS:
        want = _run("vanilla", _config("vanilla", agg), logp, old, adv, batch.mask, None)
        got = _run("ratiokl", _config("ratiokl", agg), _poison(logp, batch.mask),
                   _poison(old, batch.mask), _poison(adv, batch.mask), batch.mask, None)
        _assert_agree(batch, got, want)


def _flat(values, prompt_lens):
    """A ``[B, T]`` response tensor in the engine's no-padding layout (see
    ``test_verl_parity._flat``): per sequence its prompt and response positions, the
    response's values one position early."""
    rows = [torch.cat([values.new_zeros(p - 1), values[b, :r], values.new_zeros(1)])
            for b, (p, r) in enumerate(zip(prompt_lens, LENGTHS))]
    return torch.cat(rows)


def _ppo_loss(mode, batch, fields, poison):
    """verl's ``ppo_loss`` with ``loss_mode=mode``: ``(loss, d/d log_probs, d/d entropy)``
    w.r.t. the engine's flat model outputs."""
    P = 2
    logits = batch.logits.double()
    attention = torch.ones(B, P + T, dtype=torch.long)
    attention[1, 0] = 0
    attention[:, P:] = batch.mask
    prompt_lens = attention[:, :P].sum(1).tolist()
    logp = _flat(token_logps(logits, batch.ids), prompt_lens).requires_grad_()
    ent = _flat(torch.distributions.Categorical(logits=logits).entropy(),
                prompt_lens).requires_grad_()
    weights = _rollout_weights(batch, "token_tis")
    per_token = dict(old_log_probs=batch.old.double(), advantages=batch.adv.double(),
                     rollout_is_weights=weights)
    if poison:  # read by the policy loss only (verl's own KL and entropy code get finite)
        per_token = {k: _poison(v, batch.mask).double() for k, v in per_token.items()}
    data = TensorDict({"prompts": torch.zeros(B, P, dtype=torch.long), "responses": batch.ids,
                       "attention_mask": attention, "response_mask": batch.mask,
                       "ref_log_prob": batch.ref.double(), **per_token}, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=2, batch_num_tokens=31, global_batch_size=9)
    value, metrics = ppo_loss(_config(mode, **fields), {"log_probs": logp, "entropy": ent},
                              data)
    value.backward()
    return value.detach(), logp.grad, ent.grad


@pytest.mark.parametrize("fields", [
    dict(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.05),
    dict(use_kl_loss=True, kl_loss_coef=0.2, kl_loss_type="mse", entropy_coeff=-0.02,
         loss_agg_mode="seq-mean-token-mean"),
    dict(use_kl_loss=True, kl_loss_coef=0.3, kl_loss_type="k1+",
         loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16),
], ids=["k3_entropy_token_mean", "k2_entropy_seq_mean", "k1plus_sum_norm"])
def test_ppo_loss_with_the_config_key_matches_verl(fields):
    """The engine's loss step, ``loss_mode="ratiokl"`` for ``"vanilla"``: the same loss
    and gradients w.r.t. the model's flat ``log_probs`` and ``entropy``, with NaN / inf in
    the padding of the policy loss's own inputs."""
    batch = make_batch()
    want = _ppo_loss("vanilla", batch, fields, poison=False)
    got = _ppo_loss("ratiokl", batch, fields, poison=True)
    tol_value, tol_grad = tolerances(batch.logits, want[1])
    assert_close(got[0], want[0], tol_value, "loss")
    for what, a, e in zip(("d/d log_probs", "d/d entropy"), got[1:], want[1:]):
        assert_close(a, e, tol_grad, what)


@pytest.mark.parametrize("fields, agg, info, field", [
    (dict(), "seq-mean-token-max", {}, "loss_agg_mode"),
    (dict(clip_ratio_c=1.0), "token-mean", {}, "clip_ratio_c"),
    (dict(), "token-mean", dict(dp_size=2), "batch_num_tokens"),
    (dict(), "seq-mean-token-sum", dict(dp_size=2), "global_batch_size"),
])
def test_refusals_name_the_field(fields, agg, info, field):
    batch, logp, old, adv, _ = _inputs(dict(mode="vanilla"))
    config = _config("ratiokl", **fields)
    config.global_batch_info.update(info)
    with pytest.raises(ValueError, match=field):
        get_policy_loss_fn("ratiokl")(old, logp, adv, batch.mask, loss_agg_mode=agg,
                                      config=config)


def _verl_registry_after_import(plugins_dir: Path, policy: str, modules: str = "") -> str:
    code = ("import verl\nfrom verl.trainer.ppo import core_algos\n"
            "print(sorted(k for k in core_algos.POLICY_LOSS_REGISTRY if 'ratiokl' in k))")
    env = {**os.environ, "PYTHONPATH": f"{plugins_dir}{os.pathsep}{ROOT / 'src'}",
           "VERL_USE_EXTERNAL_PLUGINS": policy, "VERL_USE_EXTERNAL_MODULES": modules}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_entry_point_registers_the_losses_when_verl_is_imported(tmp_path):
    """pyproject's ``verl.plugins`` entry point, installed (a dist-info with that entry
    point on the path), makes a bare ``import verl`` register the losses; with verl's
    plugin loading off they are absent, and ``VERL_USE_EXTERNAL_MODULES`` brings them
    back."""
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry["verl.plugins"] == {"ratiokl": "ratiokl.adapters.verl"}
    info = tmp_path / "ratiokl-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ratiokl\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[verl.plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry["verl.plugins"].items()))
    names = "['ratiokl', 'ratiokl_cispo', 'ratiokl_gspo']"
    assert _verl_registry_after_import(tmp_path, "auto") == names
    assert _verl_registry_after_import(tmp_path, "none") == "[]"
    assert _verl_registry_after_import(tmp_path, "none", "ratiokl.adapters.verl") == names
