"""``kl_agg`` / ``entropy_agg`` / ``kl_entropy_normalizer`` and ``kl_clamp`` against the
trainers' own formulas, written here independently in float64 PyTorch (autograd gives
their gradients), on both frameworks' ``policy_objective`` and ``policy_loss``:

* OpenRLHF 0.11.2 (``PolicyLoss`` + ``PPOActor.training_step``): the policy term by
  ``aggregate_loss(token_level_loss)``, the KL and the entropy by ``aggregate_loss`` with
  ``token_level_loss=True`` whatever the policy's, each over ``batch_num_tokens / dp_size``
  or ``global_batch_size / dp_size``; ``compute_approx_kl``'s value clamped to [-10, 10]
  (here a small bound, so that tokens sit beyond it, and one token exactly at it:
  ``torch.clamp`` passes the gradient there);
* TRL 1.16 (``GRPOTrainer._compute_loss``, ``loss_type="dapo"``): the policy and KL term over
  the batch normaliser, the entropy bonus a token mean over local tokens divided by the
  gradient-accumulation steps.

The fixtures ``policy_kl_*``, ``objective_kl_*`` and ``objective_entropy_agg_*`` pin the
float64 values on every backend; ``linear_policy_loss`` with these options against
``policy_loss`` of its materialised logits: ``tests/test_policy_objective.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from assertions import assert_close
from ratiokl import spec

# The framework runners and inputs of tests/test_policy_objective.py (one copy of them).
_SPEC = importlib.util.spec_from_file_location(
    "_policy_objective_tests", Path(__file__).with_name("test_policy_objective.py"))
_OBJ = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_OBJ)
GRAD_TOL, LOSS_TOL, _framework, _inputs = (_OBJ.GRAD_TOL, _OBJ.LOSS_TOL, _OBJ._framework,
                                           _OBJ._inputs)

torch = pytest.importorskip("torch")

B, T = 3, 6
EPS = 0.2


def _openrlhf(logp, old, adv, mask, ref, ent, *, token_level, estimator, clamp, kl_coef,
              ent_coef, dp_size, batch_num_tokens, global_batch_size):
    """OpenRLHF 0.11.2's actor loss (PolicyLoss, compute_approx_kl, aggregate_loss)."""
    def aggregate(loss, token):
        if token:
            return (loss * mask).sum() / batch_num_tokens * dp_size
        counts = mask.sum(-1)
        seq = (loss * mask).sum(-1) / (counts + 1e-8)
        return (seq * (counts > 0)).sum() / global_batch_size * dp_size

    ratio = (logp - old).clamp(-20.0, 20.0).exp()
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    policy = aggregate(-surr, token_level)
    log_ratio = logp - ref
    if estimator == "k1":
        kl = log_ratio
    else:
        lr = log_ratio.clamp(min=-10)
        kl = (-lr).exp() - 1 + lr
    kl = kl.clamp(min=-clamp, max=clamp)
    return policy + kl_coef * aggregate(kl, True) - ent_coef * aggregate(ent, True)


def _trl_dapo(logp, old, adv, mask, ref, ent, *, beta, ent_coef, normalizer, gas):
    """TRL 1.16's ``loss_type="dapo"`` loss with ``entropy_coef`` (one micro-batch)."""
    ratio = (logp - old).exp()
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    d = ref - logp
    per_token = -surr + beta * (d.exp() - d - 1)
    loss = (per_token * mask).sum() / normalizer
    entropy = (ent * mask).sum() / mask.sum().clamp(min=1.0) / gas
    return loss - ent_coef * entropy


def _data(seed):
    """Clean float64 arrays for the trainer, and the same with NaN / inf on inactive tokens
    for ratiokl."""
    x = _inputs(seed=seed)
    rng = np.random.default_rng(seed)
    mask = x["mask"]
    logp = np.where(mask, -rng.gamma(2.0, 1.0, (B, T)), 0.0)
    arrays = {
        "logps": logp,
        "old_logps": logp + rng.normal(0.0, 0.3, (B, T)),
        "ref_logps": logp + rng.normal(0.0, 0.8, (B, T)),
        "entropy": rng.uniform(0.2, 3.0, (B, T)),
        "advantages": np.broadcast_to(rng.normal(0.0, 1.0, (B, 1)), (B, T)).copy(),
    }
    first = tuple(np.argwhere(mask)[0])
    arrays["logps"][first], arrays["ref_logps"][first] = -1.0, -1.5  # k1 = 0.5 exactly
    clean = {k: np.where(mask, v, 0.0) for k, v in arrays.items()}
    garbage = np.choose(np.arange(B * T).reshape(B, T) % 3, [np.nan, np.inf, -np.inf])
    poisoned = {k: np.where(mask, v, garbage).astype(np.float32) for k, v in arrays.items()}
    return mask, clean, poisoned


def _trainer(fn, mask, clean, **kw):
    """The trainer's loss and its gradients w.r.t. the log-probs and the entropies."""
    t = {k: torch.tensor(np.asarray(v, np.float64)) for k, v in clean.items()}
    for k in ("logps", "entropy"):
        t[k].requires_grad_()
    loss = fn(t["logps"], t["old_logps"], t["advantages"], torch.tensor(mask, dtype=torch.float64),
              t["ref_logps"], t["entropy"], **kw)
    loss.backward()
    return loss.item(), t["logps"].grad.numpy(), t["entropy"].grad.numpy()


def _ratiokl(fw, mask, poisoned, options):
    """``policy_objective``'s loss and gradients on the poisoned float32 arrays."""
    p = {k: fw.tensor(v) for k, v in poisoned.items()}

    def fn(logps, entropy):
        return fw.loss.policy_objective(logps, p["old_logps"], p["advantages"],
                                        fw.tensor(mask), ref_logps=p["ref_logps"],
                                        entropy=entropy, **options)

    value, _, (dlogp, dent) = fw.run(fn, [poisoned["logps"], poisoned["entropy"]], None)
    return float(value), dlogp, dent


def _assert_matches(got, want, mask):
    assert_close(got[0], want[0], LOSS_TOL, "loss")
    assert_close(got[1], want[1], GRAD_TOL, "grad logps")
    assert_close(got[2], want[2], GRAD_TOL, "grad entropy")
    assert np.all(got[1][~mask] == 0) and np.all(got[2][~mask] == 0)


@pytest.mark.parametrize("token_level", [False, True])
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_openrlhf_kl_and_entropy_token_means(native_target, token_level, estimator):
    """OpenRLHF's KL and entropy are token means over ``batch_num_tokens / dp_size``
    whatever the policy's aggregation; its KL value clamped (a token exactly at the bound
    keeps its gradient)."""
    fw = _framework(native_target)
    mask, clean, poisoned = _data(seed=21)
    n_tok, n_seq, dp = 2.0 * mask.sum(), 2.0 * mask.any(-1).sum(), 2
    want = _trainer(_openrlhf, mask, clean, token_level=token_level, estimator=estimator,
                    clamp=0.5, kl_coef=0.3, ent_coef=0.05, dp_size=dp,
                    batch_num_tokens=n_tok, global_batch_size=n_seq)
    options = dict(
        clip_eps=EPS, kl_coef=0.3, kl_estimator=estimator, entropy_coef=0.05, kl_clamp=0.5,
        loss_agg="token-mean" if token_level else "seq-mean-token-mean",
        loss_normalizer=(n_tok if token_level else n_seq) / dp,
        kl_agg="token-mean", entropy_agg="token-mean", kl_entropy_normalizer=n_tok / dp)
    _assert_matches(_ratiokl(fw, mask, poisoned, options), want, mask)


def test_trl_entropy_bonus_is_a_token_mean(native_target):
    """TRL's entropy bonus: a token mean over the local tokens divided by the accumulation
    steps, whatever the policy's normaliser (``entropy_coef / gas``, ``entropy_agg``)."""
    fw = _framework(native_target)
    mask, clean, poisoned = _data(seed=22)
    gas, normalizer = 2, 0.8 * mask.sum()
    want = _trainer(_trl_dapo, mask, clean, beta=0.04, ent_coef=0.1, normalizer=normalizer,
                    gas=gas)
    options = dict(clip_eps=EPS, kl_coef=0.04, log_ratio_bound=None, loss_agg="token-sum",
                   loss_normalizer=normalizer, entropy_coef=0.1 / gas,
                   entropy_agg="token-mean")
    _assert_matches(_ratiokl(fw, mask, poisoned, options), want, mask)


@pytest.mark.parametrize("options", [
    {"kl_agg": "token-mean", "entropy_agg": "seq-mean-token-sum", "entropy_coef": 0.1},
    {"kl_clamp": 0.05},
])
def test_policy_loss_with_term_options_is_the_objective(native_target, options):
    """``policy_loss`` from logits (the two-pass route) equals the spec."""
    fw = _framework(native_target)
    x = _inputs(seed=23)
    options = dict(options, kl_coef=0.2, loss_agg="seq-mean-token-mean")
    loss, _ = fw.loss.policy_loss(
        fw.tensor(x["policy_logits"]), None, fw.tensor(x["action_ids"]), fw.tensor(x["mask"]),
        fw.tensor(x["old_logps"]), fw.tensor(x["advantages"]),
        ref_logps=fw.tensor(x["ref_logps"]), backend="native", **options)
    want, _ = spec.policy_loss(x["policy_logits"], None, x["action_ids"], x["mask"],
                               x["old_logps"], x["advantages"], ref_logps=x["ref_logps"],
                               **options)
    assert_close(np.asarray(loss), want, LOSS_TOL, "loss")


@pytest.mark.parametrize("options, name", [
    ({"kl_agg": "none"}, "kl_agg"),
    ({"entropy_agg": "token-mean", "loss_agg": "none"}, "entropy_agg"),
    ({"kl_entropy_normalizer": 4.0}, "kl_entropy_normalizer"),
    ({"kl_clamp": 0.0}, "kl_clamp"),
])
def test_errors_name_the_option(native_target, options, name):
    fw = _framework(native_target)
    mask, _, poisoned = _data(seed=25)
    with pytest.raises(ValueError, match=f"`{name}`"):
        _ratiokl(fw, mask, poisoned, options)


@pytest.mark.parametrize("options", [{"kl_agg": "token-mean"}, {"kl_clamp": 1.0}])
def test_inplace_grad_says_the_options_take_the_two_pass_route(native_target, options):
    """The one-kernel path's ``inplace_grad`` cannot apply where these options route the
    call through the two passes: the error names them."""
    pytest.importorskip("triton")
    fw = _framework(native_target)
    x = _inputs(seed=26)
    with pytest.raises(ValueError, match="`kl_agg` / `entropy_agg` / `kl_clamp`"):
        fw.loss.policy_loss(
            fw.tensor(x["policy_logits"].copy()), None, fw.tensor(x["action_ids"]),
            fw.tensor(x["mask"]), fw.tensor(x["old_logps"]), fw.tensor(x["advantages"]),
            ref_logps=fw.tensor(x["ref_logps"]), kl_coef=0.1, backend="interpret",
            inplace_grad=True, **options)


@pytest.mark.parametrize("loss_agg, entropy_agg", [("token-sum", "token-mean"),
                                                   ("seq-mean-token-mean", "seq-mean-token-sum")])
def test_torch_compile_fullgraph(loss_agg, entropy_agg):
    """``torch.compile(fullgraph=True)`` traces the options (with and without the
    sequences) and gives the eager loss and gradient."""
    mask, _, poisoned = _data(seed=27)
    t = {k: torch.from_numpy(v) for k, v in poisoned.items()}
    from ratiokl.torch import loss

    def step(logps, entropy):
        value, _ = loss.policy_objective(
            logps, t["old_logps"], t["advantages"], torch.from_numpy(mask),
            ref_logps=t["ref_logps"], entropy=entropy, kl_coef=0.3, entropy_coef=0.05,
            loss_agg=loss_agg, kl_agg="token-mean", entropy_agg=entropy_agg,
            kl_clamp=0.5)
        return value

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        leaves = [t["logps"].clone().requires_grad_(), t["entropy"].clone().requires_grad_()]
        value = fn(*leaves)
        value.backward()
        results.append((value.item(), leaves[0].grad.numpy(), leaves[1].grad.numpy()))
    (want, *want_grads), (got, *got_grads) = results
    assert_close(got, want, LOSS_TOL, "loss")
    for g, w in zip(got_grads, want_grads):
        assert_close(g, w, GRAD_TOL, "grad")
