"""OpenRLHF's own training step against ``ratiokl.torch.loss.policy_loss``, on the same batch.

OpenRLHF (0.11.2, tested) is the oracle: ``ActorPPOTrainer.__init__`` builds its
``PolicyLoss`` from the CLI's arguments, and ``training_step`` runs ``Actor.forward``
(``log_probs_from_logits``, ``compute_entropy``), ``PolicyLoss`` (clip, dual clip, token-
or sequence-level loss, GSPO, the train / rollout correction), ``compute_approx_kl`` and
``aggregate_loss`` with ``get_loss_batch_info``'s denominators, then the backward. The
actor wraps a model whose output logits are a parameter, so ``d loss / d logits`` is
that parameter's gradient (float32: ``Actor.forward`` casts the logits to float32).
ratiokl gets the same logits with NaN / inf on the padded positions
(``tests/helpers/trainer_batch.py``) and ``_mapped``'s options (``kl_agg`` /
``entropy_agg``, ``kl_clamp``, ``token-clip`` and ``sequence-geomean-mask`` included). The
``*_differs`` tests pin what differs without those options, and the two semantics ratiokl
cannot express (``unbiased_gradient``, GSPO with per-token advantages).

OpenRLHF is imported with its CUDA-only packages stubbed and its trainer built on the CPU
as ``tests/helpers/openrlhf_stubs.py`` says. Runs in its own venv (``.ci/run`` block (d)).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (see .ci/run block (d))")

from openrlhf_stubs import build_trainer, import_openrlhf, trainer_args  # noqa: E402
from trainer_batch import B, T, V, assert_matches, differs, make_batch, tolerances  # noqa: E402

from ratiokl.torch import loss  # noqa: E402

P = 2  # prompt positions before the completion

try:
    ppo_actor = import_openrlhf()
except ImportError as error:  # a dependency that is neither installed nor stubbed
    pytest.skip(f"OpenRLHF's training step is not importable: {error}", allow_module_level=True)

from openrlhf.models import Actor  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402


class _Logits(torch.nn.Module):
    """A causal LM whose output logits ``[B, P + T, V]`` are its one parameter."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, sequences, attention_mask=None, position_ids=None, **_):
        return CausalLMOutputWithPast(logits=self.logits * 1.0)


def _actor(batch, temperature):
    g = torch.Generator().manual_seed(2)
    full = torch.randn(B, P + T, V, generator=g)
    full[:, P - 1:P + T - 1] = batch.logits  # position P-1+t predicts completion token t
    actor = Actor(_Logits(full), temperature=temperature)
    actor.packing_samples = False  # set by Actor.__init__ only when it loads a checkpoint
    return actor


def _openrlhf_step(args, batch, temperature=1.0, seq_adv=False, batch_info=None):
    """OpenRLHF's ``training_step`` on the batch: ``(loss, d loss / d logits)``."""
    actor = _actor(batch, temperature)
    trainer, strategy = build_trainer(ppo_actor, args, actor, B)
    sequences = torch.cat([torch.full((B, P), 3), batch.ids], 1)
    experience = Experience(
        sequences=sequences, attention_mask=torch.cat([torch.ones(B, P, dtype=torch.long),
                                                       batch.mask.long()], 1),
        action_mask=batch.mask, action_log_probs=batch.old, base_action_log_probs=batch.ref,
        rollout_log_probs=batch.rollout, advantages=batch.adv_seq if seq_adv else batch.adv,
        info={})
    trainer.training_step(experience, args.algo.kl.init_coef, 0, batch_info)
    return strategy.loss, actor.model.logits.grad[:, P - 1:P + T - 1]


def _batch_info(batch, batch_info):
    """``get_loss_batch_info``'s values: every rank's tokens, its non-empty sequences."""
    return batch_info or dict(dp_size=1, batch_num_tokens=float(batch.mask.sum()),
                              global_batch_size=float(batch.mask.any(-1).sum()))


def _mapped(args, info) -> dict:
    """ratiokl's options for OpenRLHF's arguments and ``get_loss_batch_info``'s values."""
    a, corr, kl = args.actor, args.algo.advantage, args.algo.kl
    token_level = a.loss_agg_mode == "token-mean" and a.policy_loss_type == "ppo"
    options = dict(
        clip_eps=a.eps_clip_low_high[0], clip_eps_high=a.eps_clip_low_high[1],
        dual_clip=a.dual_clip, loss_agg="token-mean" if token_level else "seq-mean-token-mean",
        loss_normalizer=float(info["batch_num_tokens" if token_level else "global_batch_size"])
        / info["dp_size"],
        ratio_level="sequence" if a.policy_loss_type == "gspo" else "token",
        entropy_coef=a.entropy_coef or 0.0)
    if kl.use_loss:  # compute_approx_kl clamps every estimator's value at 10
        options.update(kl_coef=kl.init_coef, kl_estimator=kl.estimator, kl_clamp=10.0)
    if kl.use_loss or a.entropy_coef:  # both always a token mean over batch_num_tokens
        options.update(kl_agg="token-mean", entropy_agg="token-mean",
                       kl_entropy_normalizer=float(info["batch_num_tokens"]) / info["dp_size"])
    if corr.is_correction_level != "off":
        options["rollout_correction"] = (
            "sequence-geomean-mask" if corr.is_correction_level == "seq"
            else "token-clip" if corr.is_correction_mode == "clip" else "token-mask")
        options["rollout_bounds"] = tuple(corr.is_correction_threshold)
    return options


def _ratiokl(batch, options, backend="native", temperature=1.0, seq_adv=False, adv=None):
    p = batch.poisoned()
    y = p.logits.clone().requires_grad_()
    advantages = (p.adv_seq if seq_adv else p.adv) if adv is None else adv
    value, _ = loss.policy_loss(
        y, None, batch.ids, batch.mask, p.old, advantages, ref_logps=p.ref,
        rollout_logps=p.rollout if "rollout_correction" in options else None,
        temperature=temperature, backend=backend, **options)
    value.backward()
    return value.detach(), y.grad


DP = dict(dp_size=2, batch_num_tokens=31.0, global_batch_size=9.0)
KL = {f"kl_{e}": dict(kl=dict(use_loss=True, init_coef=0.1, estimator=e))
      for e in ("k1", "k2", "k3")}
CASES = {
    "ppo_token": {},
    "ppo_dual_clip": dict(actor=dict(dual_clip=3.0)),
    "ppo_sequence": dict(actor=dict(loss_agg_mode="seq-mean-token-mean")),
    "ppo_token_dp": dict(info=DP),
    "ppo_sequence_dp_dual_clip": dict(info=DP, actor=dict(
        loss_agg_mode="seq-mean-token-mean", dual_clip=2.0)),
    "gspo": dict(seq_adv=True, actor=dict(policy_loss_type="gspo",
                                          eps_clip_low_high=(0.1, 0.15))),
    "gspo_dp": dict(seq_adv=True, info=DP, actor=dict(policy_loss_type="gspo")),
    "tis_token_clip": dict(advantage=dict(is_correction_level="token", is_correction_mode="clip",
                                          is_correction_threshold=[0.0, 2.0])),
    "icepop_token_mask": dict(advantage=dict(is_correction_level="token")),
    "tis_token_clip_floor": dict(advantage=dict(is_correction_level="token",
                                                is_correction_mode="clip")),
    "geomean_sequence_mask": dict(advantage=dict(is_correction_level="seq",
                                                 is_correction_threshold=[0.5, 2.0])),
    "kl_k3_entropy_sequence": dict(actor=dict(loss_agg_mode="seq-mean-token-mean",
                                              entropy_coef=0.05),
                                   kl=dict(use_loss=True, init_coef=0.1, estimator="k3")),
    "kl_k2_entropy_sequence_dp": dict(info=DP, actor=dict(
        loss_agg_mode="seq-mean-token-mean", entropy_coef=-0.02),
        kl=dict(use_loss=True, init_coef=0.3, estimator="k2")),
    **KL,
    "entropy": dict(actor=dict(entropy_coef=0.05)),
    "temperature_kl_k3_entropy": dict(temperature=0.8, actor=dict(entropy_coef=-0.02),
                                      kl=dict(use_loss=True, init_coef=0.2, estimator="k3")),
}


def _run(case, backend="native"):
    batch = make_batch()
    args = trainer_args(case.get("actor"), case.get("advantage"), case.get("kl"))
    temperature, seq_adv = case.get("temperature", 1.0), case.get("seq_adv", False)
    want, want_grad = _openrlhf_step(args, batch, temperature, seq_adv, case.get("info"))
    options = _mapped(args, _batch_info(batch, case.get("info")))
    got, grad = _ratiokl(batch, options, backend, temperature, seq_adv)
    return batch, args, (got, grad), (want, want_grad)


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_openrlhf_training_step(name, backend):
    if backend == "interpret":
        pytest.importorskip("triton")
    case = CASES[name]
    batch, _, (got, grad), (want, want_grad) = _run(case, backend)
    assert_matches(got, grad, want, want_grad, batch, case.get("temperature", 1.0),
                   both_float32=True)


def test_actor_forward_matches_selected_logprobs():
    """``Actor.forward``'s action log-probs and entropies (temperature-scaled, as the
    training step takes them) are ratiokl's ``selected_logprobs``."""
    batch = make_batch()
    actor = _actor(batch, temperature=0.8)
    sequences = torch.cat([torch.full((B, P), 3), batch.ids], 1)
    attention = torch.cat([torch.ones(B, P, dtype=torch.long), batch.mask.long()], 1)
    logp, output = actor(sequences, batch.mask, attention_mask=attention, return_output=True,
                         return_entropy=True)
    got, entropy = loss.selected_logprobs(batch.poisoned().logits, batch.ids, batch.mask,
                                          temperature=0.8, return_entropy=True)
    tol, _ = tolerances(batch.logits, logp.detach(), temperature=0.8, both_float32=True)
    assert not differs(got, logp.detach(), tol)
    assert not differs(entropy[batch.mask], output.entropy[:, -T:][batch.mask].detach(), tol)


def _differ(case, **ratiokl_options):
    """ratiokl's mapped call against OpenRLHF's step: ``(value differs, gradient differs)``."""
    batch, args, _, (want, want_grad) = _run(case)
    options = {**_mapped(args, _batch_info(batch, case.get("info"))), **ratiokl_options}
    got, grad = _ratiokl(batch, options, seq_adv=case.get("seq_adv", False))
    tol_value, tol_grad = tolerances(batch.logits, want_grad, both_float32=True)
    return differs(got, want, tol_value), differs(grad, want_grad, tol_grad)


def test_kl_and_entropy_token_mean_under_sequence_loss_differs():
    """OpenRLHF aggregates the KL and entropy terms as a token mean whatever the policy
    loss's level: without ``kl_agg`` / ``entropy_agg`` one ratiokl call aggregates all
    three alike (``kl_k3_entropy_sequence`` above matches with them)."""
    case = CASES["kl_k3_entropy_sequence"]
    assert _differ(case, kl_agg=None, entropy_agg=None, kl_entropy_normalizer=None) \
        == (True, True)


def test_tis_floor_differs():
    """``is_correction_mode="clip"`` clamps the token weight into ``[low, high]``: ratiokl's
    ``token-truncate`` only caps it (three tokens here weigh below 0.5); ``token-clip``
    (``tis_token_clip_floor`` above) matches."""
    assert _differ(CASES["tis_token_clip_floor"], rollout_correction="token-truncate")[0]


def test_geometric_mean_sequence_gate_differs():
    """``is_correction_level="seq"`` gates each sequence on the geometric mean of its token
    weights and keeps the survivors' per-token weights: ratiokl's ``sequence-mask`` gates
    and weighs by the product; ``sequence-geomean-mask`` (``geomean_sequence_mask`` above)
    matches."""
    assert _differ(CASES["geomean_sequence_mask"], rollout_correction="sequence-mask")[0]


def test_unbiased_gradient_differs():
    """``unbiased_gradient``: the KL's value, with the importance-weighted k2 gradient."""
    case = dict(kl=dict(use_loss=True, init_coef=0.5, estimator="k3", unbiased_gradient=True))
    assert _differ(case) == (False, True)


def test_k3_clamp_at_10():
    """``compute_approx_kl`` clamps every estimator's value to ``[-10, 10]``; one token's
    k3 of 49.6 (``d = 4``): ``kl_clamp=10`` matches, ratiokl's unclamped k3 does not."""
    batch = make_batch()
    logp = torch.log_softmax(batch.logits.double(), -1).gather(-1, batch.ids[..., None])[..., 0]
    ref = batch.ref.clone()
    ref[0, 0] = float(logp[0, 0]) + 4.0
    batch = type(batch)(**{**batch.__dict__, "ref": ref})
    args = trainer_args(kl=dict(use_loss=True, init_coef=0.1, estimator="k3"))
    want, want_grad = _openrlhf_step(args, batch)
    options = _mapped(args, _batch_info(batch, None))
    got, grad = _ratiokl(batch, options)
    assert_matches(got, grad, want, want_grad, batch, both_float32=True)
    unclamped, _ = _ratiokl(batch, {**options, "kl_clamp": None})
    assert differs(unclamped, want, tolerances(batch.logits, want_grad, both_float32=True)[0])


def test_gspo_with_per_token_advantages_differs():
    """OpenRLHF's GSPO differentiates the sequence ratio itself; ratiokl's gives each token
    ``d r_t / d logp_t = s``. Equal for per-sequence advantages (``gspo`` above), the
    gradients differ for per-token ones (the value does not)."""
    case = dict(actor=dict(policy_loss_type="gspo", eps_clip_low_high=(0.3, 0.3)))
    assert _differ(case) == (False, True)
