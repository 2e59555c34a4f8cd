"""``ratiokl.adapters.trl.GRPOTrainer`` against TRL's own ``GRPOTrainer`` loss step.

A tiny random Llama (saved to a temporary folder: TRL rebuilds the reference model
from its path; a tiny Phi, Cohere, Granite and Gemma 2 for the lm_head options), a
word-level tokenizer built in memory, no download. For each ``GRPOConfig`` the adapter
maps, the same batch goes through TRL's ``_compute_loss`` (its fused log-prob head and
loss) and through the adapter's (``linear_policy_loss`` on the hidden states, or the
two-pass route: ``linear_selected_logprobs`` then ``policy_objective``): the loss, every
parameter's gradient and the logged metrics must agree; with TRL's adaptive entropy
controller, its state too. Then short ``train()`` runs go end to end, and the
configurations ratiokl would compute differently are refused, naming the field.
"""
from __future__ import annotations

import os
import types

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from assertions import assert_close, two_paths  # noqa: E402
from readme_blocks import block_importing  # noqa: E402

from ratiokl.adapters import trl as adapter  # noqa: E402
from ratiokl.adapters._trl_head import head_options  # noqa: E402
from ratiokl.spec import (autocast_tolerance, linear_grad_tolerance,  # noqa: E402
                          trainer_tolerance)

WORDS = "a b c d e f g h i j k l m n o p q r s t".split()
B, P, T = 4, 5, 6  # completions, prompt and completion lengths of the hand-made batch


def _tokenizer():
    """A word-level tokenizer over ``WORDS`` (vocabulary of 24), built in memory."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({w: 4 + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def _save_tiny(path, config_cls, model_cls, **config):
    """Save a tiny random ``model_cls`` (vocabulary of 24) and the tokenizer to ``path``."""
    config = config_cls(vocab_size=24, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                        bos_token_id=2, **config)
    torch.manual_seed(0)
    model = model_cls(config)
    bias = getattr(model.get_output_embeddings(), "bias", None)
    if bias is not None:  # a bias that moves the logits (models initialise it to 0)
        with torch.no_grad():
            bias.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The path of a saved tiny Llama and its tokenizer."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM)


def _trainer(tiny, tmp_path, backend="native", chunk_rows=2048, logits_dtype="float32",
             **config):
    path, tokenizer = tiny
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
        max_completion_length=T, max_steps=2, logging_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", bf16=False, **config)
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"] * 2})
    return adapter.GRPOTrainer(
        model=path, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=data, processing_class=tokenizer, ratiokl_backend=backend,
        ratiokl_chunk_rows=chunk_rows, ratiokl_logits_dtype=logits_dtype)


def _batch(trainer, old: bool, ref: bool, seed: int = 0):
    """A generation batch as TRL's loss step receives it: left-padded prompts, completions
    ending in padding, per-sequence advantages. ``old``: behaviour log-probs off the
    trainer's policy (TRL's own) by a per-sequence shift, ``(0.3, -0.3, 0.02, -0.06)``
    plus noise, against advantages of signs ``(-, +, +, -)``: the first sequence's ratio
    clips low, the second's high, at the token and at the sequence level, and the last
    one's (about 1.06) passes a ``delta`` of 1.02."""
    g = torch.Generator().manual_seed(seed)
    n_words = len(WORDS) + 4
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    completion_mask = torch.ones(B, T, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 1:] = 0
    batch = {
        "prompt_ids": torch.randint(4, n_words, (B, P), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(4, n_words, (B, T), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(B, generator=g).abs() * torch.tensor([-1.0, 1.0, 1.0, -1.0]),
        "num_items_in_batch": completion_mask.sum(),
    }
    if old:
        with torch.no_grad():
            policy, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                torch.cat([prompt_mask, completion_mask], 1), T)
        shift = torch.tensor([0.3, -0.3, 0.02, -0.06])[:, None]
        batch["old_per_token_logps"] = policy + shift + 0.1 * torch.randn(B, T, generator=g)
    if ref:
        batch["ref_per_token_logps"] = -3.0 + 0.3 * torch.randn(B, T, generator=g)
    return batch


def _step(trainer, compute, batch):
    """``(loss, {parameter: gradient}, logged metrics)`` of one loss step (the metrics of
    the model's mode, ``"train"`` or ``"eval"``)."""
    model = trainer.model
    mode = "train" if model.training else "eval"
    model.zero_grad(set_to_none=True)
    trainer._metrics[mode].clear()
    loss = compute(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logged = {k: v[-1] for k, v in trainer._metrics[mode].items()}
    return loss.item(), grads, logged


def _logit_scale(trainer, batch) -> float:
    """``max |logits / T|`` of the trainer's model on ``batch`` (at least 1)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits.float()
    return max(1.0, float((logits / trainer.temperature).abs().max()))


def _assert_grads_close(got_grads, want_grads, scale):
    """Every parameter's gradient, TRL's and the adapter's: two float32 backward passes from
    the head's gradients, each parameter's error relative to its largest entry (as
    OpenRLHF's adapter test judges its model's)."""
    assert set(got_grads) == set(want_grads)
    for param, want in want_grads.items():
        tol = linear_grad_tolerance("float32", scale, float(want.abs().max()))
        assert_close(got_grads[param], want, two_paths(tol), param)


CONFIGS = {
    "grpo_on_policy": ({"loss_type": "grpo"}, False, False),
    "bnpo_off_policy_kl": ({"loss_type": "bnpo", "beta": 0.04}, True, True),
    "dr_grpo_kl_no_bias_correction": (
        {"loss_type": "dr_grpo", "beta": 0.1, "use_bias_correction_kl": False}, True, True),
    "dapo_clip_higher_delta": (
        {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5}, True, False),
    # delta at or below the clip 1 + epsilon_high: TRL caps a positive advantage's ratio
    # at delta and a negative one's at 1 + epsilon_high (the fourth sequence's ratios, about
    # 1.06, sit on both sides of delta), and counts no high clip.
    "dapo_delta_below_clip": ({"loss_type": "dapo", "epsilon_high": 0.1, "delta": 1.03},
                              True, False),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, True, False),
    # CISPO's cap at or below 1: TRL's default epsilon_high (epsilon, 0.2) is a cap of 0.2.
    "cispo_cap_below_one_kl": ({"loss_type": "cispo", "epsilon_high": 0.9, "beta": 0.04},
                               True, True),
    "cispo_default_cap_on_policy": ({"loss_type": "cispo"}, False, False),
    # LUSPO: the PPO term summed over each sequence, then the mean over sequences.
    "luspo_gspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence",
                    "epsilon": 0.05}, True, False),
    "luspo_token_kl": ({"loss_type": "luspo", "beta": 0.04}, True, True),
    # GSPO: TRL's sequence ratio exp(masked mean log-ratio); small epsilons so that some
    # sequences clip and some do not.
    "gspo_grpo": ({"loss_type": "grpo", "importance_sampling_level": "sequence",
                   "epsilon": 0.05, "epsilon_high": 0.05}, True, False),
    "gspo_bnpo_on_policy": ({"loss_type": "bnpo", "importance_sampling_level": "sequence"},
                            False, False),
    "gspo_dapo_kl_delta": ({"loss_type": "dapo", "importance_sampling_level": "sequence",
                            "epsilon": 0.05, "epsilon_high": 0.01, "delta": 1.02,
                            "beta": 0.04, "use_bias_correction_kl": False}, True, True),
    "gspo_grpo_delta_below_clip": ({"loss_type": "grpo", "importance_sampling_level":
                                    "sequence", "epsilon": 0.05, "epsilon_high": 0.1,
                                    "delta": 1.03}, True, False),
    "gspo_cispo": ({"loss_type": "cispo", "importance_sampling_level": "sequence",
                    "epsilon_high": 1.02}, True, False),
    # SAPO: a soft gate on the ratio (ratiokl's objective="sapo"), aggregated as grpo; at
    # the sequence level TRL differentiates the sequence ratio, as for GSPO's PPO term.
    "sapo_kl": ({"loss_type": "sapo", "beta": 0.04}, True, True),
    "sapo_gspo_temperatures": ({"loss_type": "sapo", "importance_sampling_level": "sequence",
                                "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
                               True, False),
    "sapo_on_policy_entropy_bonus": ({"loss_type": "sapo", "entropy_coef": 0.05},
                                     False, False),
    # VESPO: TRL's gamma weight of the sequence ratio (a product: the first two sequences'
    # weights are far from 1) on CISPO's form; with the bias-corrected KL, the token ratio's.
    "vespo_kl": ({"loss_type": "vespo", "beta": 0.04}, True, True),
    "vespo_own_shape_entropy_bonus": ({"loss_type": "vespo", "vespo_k_pos": 1.0,
                                       "vespo_lambda_pos": 1.5, "vespo_k_neg": 2.0,
                                       "vespo_lambda_neg": 4.0, "entropy_coef": 0.05,
                                       "top_entropy_quantile": 0.5}, True, False),
    "vespo_on_policy_kl_no_bias_correction": ({"loss_type": "vespo", "beta": 0.04,
                                               "use_bias_correction_kl": False},
                                              False, True),
    # GSPO with TRL's bias-corrected KL (its default): k3 times the sequence ratio, which
    # TRL differentiates, so each token's KL reaches every token of its sequence.
    "gspo_grpo_bias_corrected_kl": ({"loss_type": "grpo", "importance_sampling_level":
                                     "sequence", "epsilon": 0.05, "beta": 0.1}, True, True),
    "gspo_bnpo_on_policy_bias_corrected_kl": ({"loss_type": "bnpo", "beta": 0.1,
                                               "importance_sampling_level": "sequence"},
                                              False, True),
    "gspo_cispo_bias_corrected_kl": ({"loss_type": "cispo", "importance_sampling_level":
                                      "sequence", "epsilon_high": 1.02, "beta": 0.1},
                                     True, True),
    # TRL's high-entropy token mask on the policy term, from the same pass's entropies.
    "entropy_quantile_dapo_kl": ({"loss_type": "dapo", "top_entropy_quantile": 0.5,
                                  "beta": 0.04}, True, True),
    "entropy_quantile_gspo_grpo": ({"loss_type": "grpo", "top_entropy_quantile": 0.5,
                                    "importance_sampling_level": "sequence",
                                    "epsilon": 0.05}, True, False),
    # TRL's off-policy sequence mask (DeepSeek-V3.2): the first sequence (advantage < 0,
    # old - logp about 0.3) is dropped from the policy term.
    "off_policy_mask_dapo_kl": ({"off_policy_mask_threshold": 0.1, "beta": 0.04}, True, True),
    "off_policy_mask_gspo_entropy_quantile": (
        {"loss_type": "grpo", "off_policy_mask_threshold": 0.1, "epsilon": 0.05,
         "importance_sampling_level": "sequence", "top_entropy_quantile": 0.5}, True, False),
    # TRL's entropy bonus, a token mean whatever the loss_type: ratiokl's entropy_coef for
    # bnpo, with entropy_agg="token-mean" for the others.
    "bnpo_entropy_bonus_kl": ({"loss_type": "bnpo", "entropy_coef": 0.05, "beta": 0.04},
                              True, True),
    "grpo_entropy_bonus_kl": ({"loss_type": "grpo", "entropy_coef": 0.05, "beta": 0.04},
                              True, True),
    "dapo_entropy_bonus_on_policy": ({"entropy_coef": -0.02}, False, False),
    # With the high-entropy token mask TRL's bonus is a mean over those tokens only.
    "entropy_quantile_bonus_dapo_kl": ({"top_entropy_quantile": 0.5, "entropy_coef": 0.05,
                                        "beta": 0.04}, True, True),
    "entropy_quantile_bonus_bnpo": ({"loss_type": "bnpo", "top_entropy_quantile": 0.5,
                                     "entropy_coef": 0.05}, True, False),
    "entropy_quantile_bonus_gspo_grpo": ({"loss_type": "grpo", "top_entropy_quantile": 0.5,
                                          "importance_sampling_level": "sequence",
                                          "epsilon": 0.05, "entropy_coef": 0.05},
                                         True, False),
    "cispo_entropy_bonus": ({"loss_type": "cispo", "epsilon_high": 1.2,
                             "entropy_coef": 0.05}, True, False),
    "gspo_dr_grpo_entropy_bonus": ({"loss_type": "dr_grpo", "importance_sampling_level":
                                    "sequence", "epsilon": 0.05, "entropy_coef": 0.05},
                                   True, False),
}


def _assert_same_step(trainer, batch, config, ours=None, between=None):
    """TRL's ``_compute_loss`` on ``batch`` and the adapter's (on ``ours``, default
    ``batch``; ``between()`` runs in between): the loss, every parameter's gradient and
    every metric the adapter logs (TRL's names) agree."""
    want_loss, want_grads, want_logged = _step(
        trainer, lambda m, b: trl.GRPOTrainer._compute_loss(trainer, m, b), batch)
    if between is not None:
        between()
    got_loss, got_grads, got_logged = _step(trainer, trainer._compute_loss,
                                            batch if ours is None else ours)
    # TRL's float32 loss and metrics, summed over the batch's tokens in its own order.
    tol = two_paths(trainer_tolerance(B * T))
    assert_close(got_loss, want_loss, tol, "loss")
    _assert_grads_close(got_grads, want_grads, _logit_scale(trainer, batch))
    assert set(got_logged) <= set(want_logged), set(got_logged) - set(want_logged)
    expected = {"entropy"} | ({"kl"} if config.get("beta", 0) != 0 else set())
    if config.get("entropy_coef", 0) != 0 or config.get("use_adaptive_entropy"):
        expected |= {"policy_loss"}
        if trainer.model.training and trainer.accelerator.sync_gradients:
            expected |= {"entropy_coef"}
    if config.get("loss_type") == "vespo":
        expected |= {"vespo/phi_seq_mean"}
    elif config.get("loss_type") not in ("cispo", "sapo"):  # TRL logs no clip ratio for these
        expected |= {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    assert expected <= set(got_logged), expected - set(got_logged)
    for key, value in got_logged.items():
        assert_close(value, want_logged[key], tol, key)
    return want_logged


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_step_matches_trl(tiny, tmp_path, name, backend):
    config, old, ref = CONFIGS[name]
    if backend == "interpret":
        pytest.importorskip("triton")
    trainer = _trainer(tiny, tmp_path, backend=backend, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by train(); 2 tests the factor
    _assert_same_step(trainer, _batch(trainer, old, ref), config)


def _per_token_advantages(batch, seed=1):
    """``[B, T]`` advantages (TRL: "subclasses that provide advantages with shape (B,
    T)"): each sequence's own plus noise whose sign differs within the first, second and
    fourth sequences (so that each side of GSPO's clip meets both signs), NaN on two
    padded positions (TRL multiplies them by the mask; ratiokl never reads them)."""
    g = torch.Generator().manual_seed(seed)
    adv = batch["advantages"][:, None] + torch.randn(B, T, generator=g)
    adv[:, 0] = -adv[:, 1]
    clean = dict(batch, advantages=adv)
    padded = batch["completion_mask"] == 0
    poisoned = dict(batch, advantages=torch.where(
        padded & (torch.arange(T) % 2 == 0), float("nan"), adv))
    return clean, poisoned


@pytest.mark.parametrize("name", [
    "gspo_grpo", "gspo_dapo_kl_delta", "gspo_bnpo_on_policy", "luspo_gspo",
    "gspo_dr_grpo_entropy_bonus", "off_policy_mask_gspo_entropy_quantile", "gspo_cispo",
    "gspo_grpo_bias_corrected_kl", "sapo_gspo_temperatures", "sapo_kl",
    "dapo_clip_higher_delta", "bnpo_off_policy_kl", "entropy_quantile_dapo_kl"])
def test_per_token_advantages_match_trl(tiny, tmp_path, name):
    """Advantages ``[B, T]`` of both signs within a sequence, on every route. With GSPO's
    PPO term TRL multiplies each token's advantage by the sequence ratio and
    differentiates the ratio (the gradient reaches every token of the sequence alike), and
    its clip ratios become means over the active tokens; the adapter's loss, gradients
    and metrics are TRL's."""
    config, old, ref = CONFIGS[name]
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    clean, poisoned = _per_token_advantages(_batch(trainer, old, ref))
    _assert_same_step(trainer, clean, config, ours=poisoned)


def test_per_token_advantages_with_vllm_ratio_match_trl(tiny, tmp_path):
    """GSPO with advantages ``[B, T]`` under vLLM's per-token ``importance_sampling_ratio``
    and the off-policy mask: TRL multiplies each token's term by both before it
    differentiates the sequence ratio; the adapter folds them into the advantages'
    per-sequence means."""
    config = {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon": 0.05,
              "off_policy_mask_threshold": 0.1}
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    batch, _ = _per_token_advantages(_batch(trainer, old=True, ref=False))
    batch["importance_sampling_ratio"] = torch.tensor([[0.5], [1.0], [2.0], [0.0]]) + \
        torch.linspace(0.0, 1.0, T)
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + torch.tensor(
        [-0.3, 0.0, 0.0, 0.3])[:, None]
    _assert_same_step(trainer, batch, config)


@pytest.mark.parametrize("name", ["gspo_grpo", "off_policy_mask_gspo_entropy_quantile",
                                  "dapo_clip_higher_delta"])
def test_advantages_of_shape_b_1_match_trl(tiny, tmp_path, name):
    """Advantages ``[B, 1]`` (TRL unsqueezes only a 1-D tensor): one per sequence, and
    TRL's sequence-level clip ratios over the sequences."""
    config, old, ref = CONFIGS[name]
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch(trainer, old, ref)
    batch["advantages"] = batch["advantages"][:, None]
    _assert_same_step(trainer, batch, config)


_CONTROLLER = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


@pytest.mark.parametrize("loss_type, backend, quantile", [
    ("bnpo", "native", 1.0), ("dapo", "native", 1.0), ("bnpo", "interpret", 1.0),
    ("bnpo", "native", 0.5)])
@pytest.mark.parametrize("entropy_target", [5.0, 1.0], ids=["below_target", "above_target"])
def test_adaptive_entropy_controller_matches_trl(tiny, tmp_path, loss_type, backend, quantile,
                                                 entropy_target):
    """``use_adaptive_entropy``: two optimizer steps of two micro-batches each. No bonus
    in the first window; then the coefficient moves up (entropy below the target, and
    the bonus applies) or down (above it: no bonus). Each micro-batch: TRL's step, the
    controller's state put back, the adapter's step; the loss, gradients, metrics and
    the controller's state after it agree. With ``top_entropy_quantile < 1`` the bonus
    and the controller read the high-entropy tokens only."""
    config = {"loss_type": loss_type, "use_adaptive_entropy": True, "entropy_coef": 0.05,
              "entropy_coef_delta": 0.02, "entropy_target": entropy_target,
              "top_entropy_quantile": quantile}
    if backend == "interpret":
        pytest.importorskip("triton")
    trainer = _trainer(tiny, tmp_path, backend=backend, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2

    def state():
        return {n: (lambda v: v.clone() if torch.is_tensor(v) else v)(getattr(trainer, n))
                for n in _CONTROLLER}

    applied = []
    for micro in range(4):
        trainer.accelerator.gradient_state._set_sync_gradients(micro % 2 == 1)
        before, want = state(), {}
        below = trainer._last_world_entropy <= entropy_target
        applied.append(trainer.entropy_coef if below else 0.0)

        def put_back():
            want.update(state())
            for name, value in before.items():
                setattr(trainer, name, value)

        _assert_same_step(trainer, _batch(trainer, True, False, seed=micro), config,
                          between=put_back)
        got = state()
        assert got["entropy_coef"] == want["entropy_coef"]  # the same steps of the same sizes
        # An entropy sum over the window's tokens (two micro-batches), TRL's and ratiokl's.
        window_tol = two_paths(trainer_tolerance(2 * B * T))
        assert_close(got["_last_world_entropy"], want["_last_world_entropy"], window_tol,
                     "_last_world_entropy")
        if want["_entropy_window_stats"] is None:
            assert got["_entropy_window_stats"] is None
        else:
            assert_close(got["_entropy_window_stats"], want["_entropy_window_stats"],
                         window_tol, "_entropy_window_stats")
    assert applied[:2] == [0.0, 0.0]
    assert applied[2] > 0.05 if entropy_target == 5.0 else applied[2] == 0.0


@pytest.mark.parametrize("name", ["dapo_clip_higher_delta", "grpo_entropy_bonus_kl",
                                  "off_policy_mask_gspo_entropy_quantile"])
def test_evaluation_step_matches_trl(tiny, tmp_path, name):
    """In evaluation (``prediction_step``: the model in eval mode, no accumulation factor,
    ``dapo``'s denominator without ``steps_per_generation``) on each route, TRL's loss and
    its ``eval`` metrics."""
    config, old, ref = CONFIGS[name]
    trainer = _trainer(tiny, tmp_path, steps_per_generation=2, **config)
    trainer.model.eval()
    trainer.current_gradient_accumulation_steps = 2  # must not enter the eval loss
    _assert_same_step(trainer, _batch(trainer, old, ref), config)


@pytest.mark.parametrize("name", ["dapo_clip_higher_delta", "off_policy_mask_dapo_kl",
                                  "off_policy_mask_gspo_entropy_quantile",
                                  "grpo_entropy_bonus_kl"])
def test_padded_positions_may_hold_nan_or_inf(tiny, tmp_path, name):
    """NaN, +inf and -inf in the padded positions of every per-token input (old,
    reference and engine log-probs, vLLM's ratio): the adapter's step on that batch is
    TRL's on the clean one (TRL itself would carry them into its loss)."""
    config, old, ref = CONFIGS[name]
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    clean = _batch(trainer, old, ref)
    clean["importance_sampling_ratio"] = torch.linspace(0.5, 1.5, B * T).reshape(B, T)
    clean["sampling_per_token_logps"] = clean["old_per_token_logps"] - 0.05
    padded = clean["completion_mask"] == 0
    junk = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(B * T)[:B * T]
    poisoned = {k: torch.where(padded, junk.reshape(B, T), v) if k in (
        "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
        "importance_sampling_ratio") else v for k, v in clean.items()}
    _assert_same_step(trainer, clean, config, ours=poisoned)


@pytest.mark.parametrize("config", [
    {"loss_type": "dapo"},
    {"loss_type": "dapo", "importance_sampling_level": "sequence", "epsilon": 0.05},
    {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 1.02},
    {"loss_type": "dapo", "off_policy_mask_threshold": 0.1},
    {"loss_type": "vespo"},
], ids=["token", "gspo", "gspo_cispo", "off_policy_mask", "vespo"])
@pytest.mark.parametrize("ratio_shape", ["sequence", "token"])
def test_vllm_importance_sampling_ratio_weighs_the_policy_term(tiny, tmp_path, config,
                                                               ratio_shape):
    """With vLLM's correction on, TRL multiplies the policy term by the batch's
    ``importance_sampling_ratio`` (``[B, 1]`` in its sequence modes, ``[B, T]`` in its
    token modes, whatever ``importance_sampling_level``; VESPO folds it into its sequence
    ratio instead); so does the adapter. The
    off-policy mask reads the engine's ``sampling_per_token_logps`` (here they put the
    fourth sequence, not the first, beyond the threshold)."""
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    batch = _batch(trainer, old=True, ref=False)
    ratio = torch.tensor([[0.5], [1.0], [2.0], [0.0]])
    if ratio_shape == "token":
        ratio = ratio + torch.linspace(0.0, 1.0, T)
        if config.get("loss_type") == "vespo":  # TRL sums its log over every position:
            # padded ones hold 1 (exp of a masked difference) in TRL's batches.
            ratio = torch.where(batch["completion_mask"].bool(), ratio, 1.0)
    batch["importance_sampling_ratio"] = ratio
    batch["sampling_per_token_logps"] = batch["old_per_token_logps"] + torch.tensor(
        [-0.3, 0.0, 0.0, 0.3])[:, None]
    _assert_same_step(trainer, batch, config)


#: Heads that are not ``hidden @ W.T``, set the way each family's config sets them (TRL's
#: fused head reads the same fields): ``(config class, model class, config fields)``.
HEADS = {
    "phi_bias": ("PhiConfig", "PhiForCausalLM", {}),
    "cohere_logit_scale": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "granite_logits_scaling": ("GraniteConfig", "GraniteForCausalLM",
                               {"logits_scaling": 2.0}),
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                       {"final_logit_softcapping": 1.5, "head_dim": 8}),
    # All three at once, in TRL's order (bias, scale, soft cap, temperature).
    "phi_bias_scale_softcap": ("PhiConfig", "PhiForCausalLM",
                               {"logit_scale": 3.0, "final_logit_softcapping": 2.0}),
}


@pytest.fixture(scope="module", params=list(HEADS))
def tiny_head(request, tmp_path_factory):
    config_cls, model_cls, fields = HEADS[request.param]
    return _save_tiny(tmp_path_factory.mktemp(request.param),
                      getattr(transformers, config_cls), getattr(transformers, model_cls),
                      **fields)


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", ["bnpo_off_policy_kl", "entropy_quantile_gspo_grpo"])
def test_head_bias_scale_and_softcap_match_trl(tiny_head, tmp_path, name, backend):
    """The lm_head's bias and the config's logit scale and soft cap, on the fused route
    and the two-pass one, at a temperature of 0.7, in chunks of 5 of the 24 rows: TRL's
    step, loss, gradients (the bias's included) and metrics."""
    if backend == "interpret":
        pytest.importorskip("triton")
    config, old, ref = CONFIGS[name]
    config = {**config, "temperature": 0.7}
    trainer = _trainer(tiny_head, tmp_path, backend=backend, chunk_rows=5, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    _assert_same_step(trainer, _batch(trainer, old, ref), config)


@pytest.mark.parametrize("config", [
    {"beta": 0.04},
    {"beta": 0.04, "loss_type": "bnpo", "importance_sampling_level": "sequence",
     "use_bias_correction_kl": False, "top_entropy_quantile": 0.5},
    {"beta": 0.04, "loss_type": "grpo", "entropy_coef": 0.01},
    {"beta": 0.04, "use_adaptive_entropy": True, "entropy_target": 5.0},
], ids=["dapo", "gspo_entropy_mask", "entropy_bonus", "adaptive_entropy"])
def test_train_runs_and_logs(tiny, tmp_path, config):
    """Two optimizer steps of real generation and training through the adapter's loss, on
    the fused route and the two-pass one."""
    trainer = _trainer(tiny, tmp_path, **config)
    calls = []
    step = trainer._compute_loss
    trainer._compute_loss = lambda model, inputs: calls.append(1) or step(model, inputs)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert calls, "the adapter's loss step never ran"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all("kl" in h and "entropy" in h for h in logs)
    moved = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert moved, "no parameter changed after two optimizer steps"


@pytest.mark.parametrize("config, field", [
    ({"loss_type": "cispo", "epsilon_high": 0.0}, "epsilon_high"),
    ({"epsilon_high": 0.28, "delta": 0.9}, "delta"),
    ({"epsilon_high": 0.0, "delta": 1.0}, "delta"),
])
def test_refused_configurations_name_the_field(config, field):
    args = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **config)
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.loss_options(args)


@pytest.mark.parametrize("fields, field", [
    ({"logit_scale": 0.0}, "logit_scale"), ({"logits_scaling": 0.0}, "logits_scaling"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
])
def test_refused_heads_name_the_config_field(fields, field):
    """A logit scale or soft cap ratiokl's head options cannot take (TRL would run it)."""
    config = LlamaConfig(vocab_size=24)
    for name, value in fields.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=f"`model.config.{field}="):
        head_options(types.SimpleNamespace(config=config))


def test_moe_router_loss_is_refused_at_construction(tmp_path):
    """TRL adds the router's load-balancing loss of an MoE model; the adapter does not, so
    it refuses the model when TRL would add it, naming ``router_aux_loss_coef``."""
    moe = _save_tiny(tmp_path / "moe", transformers.MixtralConfig,
                     transformers.MixtralForCausalLM, num_local_experts=2,
                     num_experts_per_tok=1)
    with pytest.raises(ValueError, match="`router_aux_loss_coef="):
        _trainer(moe, tmp_path / "out")


def test_bf16_autocast_step_matches_trl(tiny, tmp_path):
    """Under bf16 autocast (``GRPOConfig(bf16=True)`` on a GPU) a backbone may hand back
    bf16 hidden states beside the float32 head (Llama's does not on the CPU: its final
    norm's output is made bf16 here): the head is cast to their dtype for the call, and
    the step stays TRL's within bf16. ``ratiokl_logits_dtype="input"``: the bf16 head
    TRL's chunked head runs (the default, float32 logits, is the fp32 head's)."""
    trainer = _trainer(tiny, tmp_path, loss_type="bnpo", beta=0.04, logits_dtype="input")
    trainer.model.model.norm.register_forward_hook(lambda m, i, out: out.to(torch.bfloat16))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch(trainer, old=True, ref=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_grads, _ = _step(
            trainer, lambda m, b: trl.GRPOTrainer._compute_loss(trainer, m, b), batch)
        got_loss, got_grads, _ = _step(trainer, trainer._compute_loss, batch)
        scale = _logit_scale(trainer, batch)
    # Both round the hidden states and the logits to bfloat16, not always the same ones.
    assert_close(got_loss, want_loss, autocast_tolerance("bfloat16", scale, abs(want_loss)),
                 "loss")
    assert set(got_grads) == set(want_grads)
    for param, want in want_grads.items():
        tol = autocast_tolerance("bfloat16", scale, float(want.abs().max()))
        assert_close(got_grads[param], want, tol, param)


def test_cast_lm_head_to_fp32_under_bf16_matches_trl(tiny, tmp_path):
    """``cast_lm_head_to_fp32``: with bf16 hidden states under bf16 autocast, TRL runs the
    head in float32 outside autocast; so does the adapter (the float32 head and bias, the
    bf16 hidden states as they are: the split products), and the step is TRL's to float32
    tolerances."""
    config = {"loss_type": "bnpo", "beta": 0.04, "cast_lm_head_to_fp32": True}
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.model.norm.register_forward_hook(lambda m, i, out: out.to(torch.bfloat16))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_same_step(trainer, _batch(trainer, old=True, ref=True), config)


@pytest.mark.parametrize("name", ["dapo_clip_higher_delta", "entropy_quantile_gspo_grpo",
                                  "grpo_entropy_bonus_kl"])
def test_tool_mask_leaves_tool_tokens_out(tiny, tmp_path, name):
    """TRL's ``tool_mask`` (tokens a tool wrote, not the policy) multiplies the completion
    mask: the loss, its denominators (but ``dapo``'s ``num_items_in_batch``), the masks
    and the metrics skip those tokens, on every route."""
    config, old, ref = CONFIGS[name]
    trainer = _trainer(tiny, tmp_path, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    batch = _batch(trainer, old, ref)
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[1, 2:4] = 0
    tool_mask[3, 1] = 0
    batch["tool_mask"] = tool_mask
    _assert_same_step(trainer, batch, config)


@pytest.mark.parametrize("keyword, value", [
    ("ratiokl_chunk_rows", 0), ("ratiokl_chunk_rows", 2.5), ("ratiokl_backend", "cuda"),
    ("ratiokl_logits_dtype", "bf16"),
])
def test_bad_adapter_arguments_name_themselves(tiny, tmp_path, keyword, value):
    """Checked at construction, before TRL loads anything, naming the adapter's argument."""
    with pytest.raises(ValueError, match=f"`{keyword}`"):
        adapter.GRPOTrainer(model=tiny[0], reward_funcs=lambda completions, **_: [0.0],
                            args=trl.GRPOConfig(output_dir=str(tmp_path), report_to="none",
                                                use_cpu=True), **{keyword: value})


def test_backend_the_trainer_cannot_run_is_refused_at_construction(tiny, tmp_path):
    """``"triton"`` on a CPU trainer: refused when the trainer is built (not at the first
    loss step, after generation), naming ``ratiokl_backend``, the device and the fix."""
    with pytest.raises(ValueError, match=r"`ratiokl_backend='triton'`.* cpu.*"
                                         r"ratiokl_backend='auto'"):
        _trainer(tiny, tmp_path, backend="triton")


def test_the_readmes_trl_block_runs_here():
    """The README's TRL block, as printed, in TRL's environment (without Tunix)."""
    block = block_importing("ratiokl.adapters.trl")
    namespace = {}
    exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
    assert namespace["GRPOTrainer"] is adapter.GRPOTrainer
