"""The trainer check targets (``ratiokl.harness.targets``) on a few fixture groups, each
in its trainer's venv (``.ci/run`` block (d)); skipped where the trainer is absent.

The trainer's own loss code is the oracle of what it computes; these tests pin that its
target runs, agrees with the spec where the trainer defines the same quantity, and
reports (never crashes on) the documented differences.
"""

from __future__ import annotations

import importlib.util

import pytest

from ratiokl import harness

pytest.importorskip("torch")


def _results(target, *groups):
    names = sorted({n for g in groups for n in harness.list_cases(g)})
    return {n: harness.run_case(harness.load_case(n), target) for n in names}


@pytest.fixture(scope="module")
def verl():
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (see .ci/run block (d))")
    from ratiokl.harness.targets import verl

    return verl


def test_verl_agrees_where_it_defines_the_same_loss(verl):
    results = _results(verl.TARGET, "policy_clip_higher", "policy_dual_clip", "policy_gspo",
                       "policy_kl_k*", "policy_entropy_token_mean", "objective_token_mean",
                       "objective_cispo", "objective_gspo", "policy_global_normalizer")
    failed = {n: r.failures for n, r in results.items() if r.status == "failed"}
    passed = [n for n, r in results.items() if r.status == "passed"]
    assert failed == {} and len(passed) >= 15, (failed, passed)


@pytest.mark.parametrize("trainer", ["verl", "openrlhf", "trl"])
def test_the_actor_log_probs_agree_and_entropy_of_masked_vocab_is_nan(trainer, request):
    """The trainers' own log-prob helpers agree with the spec, also with -inf logits; their
    entropy helpers turn a -inf logit into NaN (``p * logits`` at ``p = 0``): reported on
    the ``entropy_masked_vocab`` cases, the entropy output named."""
    module = request.getfixturevalue(trainer)
    groups = ["selected_logprobs_no_mask", "selected_logprobs_inactive_rows", "vocab_50257",
              "entropy_flat", "entropy_inactive_rows"]
    agree = _results(module.TARGET, *groups, *(["kl_k*", "vocab_2"] if trainer != "trl" else []))
    failed = {n: r.failures for n, r in agree.items() if r.status == "failed"}
    assert failed == {} and sum(r.status == "passed" for r in agree.values()) >= 10, failed
    masked = _results(module.TARGET, "entropy_masked_vocab")
    assert masked and all(r.status == "failed" and r.failures[0].startswith("entropy: ")
                          for r in masked.values())


def test_verl_reports_its_differences_case_by_case(verl):
    """verl's seq-mean-token-sum-norm divides by n_seq * T (ratiokl: T), and with the
    fixtures' NaN padding its masked sums turn NaN: failures naming the loss, not crashes."""
    norm = _results(verl.TARGET, "policy_agg_seq_mean_token_sum_norm")
    assert [r.status for r in norm.values()] == ["failed"]
    assert next(iter(norm.values())).failures[0].startswith("loss: error is")
    padded = _results(verl.NAN_PADDED, "policy_kl_k1")
    assert all(r.status == "failed" and "NaN" in " ".join(r.failures) for r in padded.values())


def test_verl_refuses_what_it_cannot_express_by_name(verl):
    reasons = {r.skipped for r in _results(verl.TARGET, "policy_ratio_cap", "policy_agg_none",
                                           "linear_bias").values()}
    assert {"verl has no ratio_cap", "verl's policy loss always aggregates (loss_agg='none')"} \
        <= reasons
    assert any(r.startswith("linear_selected_logprobs_entropy: verl has no code for it")
               for r in reasons)


@pytest.fixture(scope="module")
def openrlhf():
    if importlib.util.find_spec("openrlhf") is None:
        pytest.skip("OpenRLHF is not installed (see .ci/run block (d))")
    from ratiokl.harness.targets import openrlhf

    return openrlhf


def test_openrlhf_agrees_where_it_defines_the_same_loss(openrlhf):
    results = _results(openrlhf.TARGET, "policy_clip_higher", "policy_dual_clip", "policy_gspo",
                       "policy_kl_k*", "policy_entropy_token_mean", "objective_token_mean",
                       "policy_agg_seq_mean_token_mean", "policy_global_normalizer")
    failed = {n: r.failures for n, r in results.items() if r.status == "failed"}
    passed = [n for n, r in results.items() if r.status == "passed"]
    assert failed == {} and len(passed) >= 12, (failed, passed)


def test_openrlhf_reports_its_token_mean_entropy_under_gspo(openrlhf):
    """OpenRLHF aggregates the entropy per token whatever the policy's aggregation (GSPO:
    per sequence): a reported loss difference, case by case."""
    results = _results(openrlhf.TARGET, "policy_entropy_gspo")
    assert [r.status for r in results.values()] == ["failed"]
    assert next(iter(results.values())).failures[0].startswith("loss: error is")
    assert {r.skipped for r in _results(openrlhf.TARGET, "objective_cispo").values()} == {
        "OpenRLHF has no CISPO or SAPO objective"}


@pytest.fixture(scope="module")
def trl():
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (see .ci/run block (d))")
    from ratiokl.harness.targets import trl

    return trl


def test_trl_agrees_where_it_defines_the_same_loss(trl):
    """``GRPOTrainer._compute_loss`` itself, on bnpo, grpo, dapo (a normalizer), GSPO,
    ``delta``, the bias-corrected KL and the vLLM importance weights."""
    results = _results(trl.TARGET, "policy_clip_higher", "policy_gspo", "policy_kl_k3",
                       "policy_kl_k3_ratio_weighted", "policy_ratio_cap",
                       "policy_importance_weights", "policy_entropy_token_mean",
                       "policy_agg_seq_mean_token_mean", "policy_global_normalizer",
                       "objective_token_mean")
    failed = {n: r.failures for n, r in results.items() if r.status == "failed"}
    passed = [n for n, r in results.items() if r.status == "passed"]
    assert failed == {} and len(passed) >= 12, (failed, passed)


def test_trl_reports_its_cispo_and_refuses_by_name(trl):
    """TRL's CISPO weight has no lower clip (``clamp(r, max=epsilon_high)``): a reported loss
    difference; its KL is k3 only: a named refusal."""
    cispo = _results(trl.TARGET, "policy_cispo_token_mean")
    assert cispo and all(r.status == "failed" and r.failures[0].startswith("loss: error is")
                         for r in cispo.values())
    assert {r.skipped for r in _results(trl.TARGET, "policy_kl_k1").values()} == {
        "TRL's KL is k3 only (kl_estimator='k1')"}
