"""TRL's own GRPO advantages against ``ratiokl.torch.advantages``, on the same rewards.

TRL (1.16, tested) is the oracle: ``GRPOTrainer._generate_and_score_completions``, the
method that scores a generation batch and computes its advantages inline, run on a real
trainer (a tiny random Llama, a word-level tokenizer built in memory, no download) whose
reward functions return the rewards of the batch's own columns, so TRL's generation runs
but decides nothing. Each ``scale_rewards`` and ``multi_objective_aggregation`` with two
weighted reward functions, on groups (consecutive, ``num_generations`` each: TRL has no
group ids, so unsorted ids are checked on ratiokl's side) holding equal rewards, one
scorable sample, none, and a reward function that returned ``None``; singleton groups
through ``num_generations_eval=1``. Runs in TRL's venv (``.ci/run`` block (d)); skipped
where TRL is not importable.
"""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch")
trl = pytest.importorskip("trl")
pytest.importorskip("datasets")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from ratiokl.torch import advantages  # noqa: E402

# float32 in both; TRL divides by its std + 1e-4, ratiokl rounds its group sums otherwise.
RTOL, ATOL = 1e-5, 1e-5
G = 4  # num_generations
WEIGHTS = (1.0, 0.5)
NAN = math.nan
# Rewards [B, 2] (NaN: the reward function returned None), groups of G in order:
REWARDS = [
    (1.0, 0.0), (0.0, 2.0), (0.5, 1.0), (0.25, 0.5),    # distinct
    (0.1, 0.3), (0.1, 0.3), (0.1, 0.3), (0.1, 0.3),      # equal rewards
    (1.0, NAN), (NAN, NAN), (0.0, 1.0), (2.0, 0.5),      # None from one function; unscorable
    (NAN, NAN), (0.7, 0.2), (NAN, NAN), (NAN, NAN),      # one scorable sample
    (NAN, NAN), (NAN, NAN), (NAN, NAN), (NAN, NAN),      # no scorable sample
]


def _reward(column: str):
    def reward(completions, **columns):
        return columns[column]
    reward.__name__ = column
    return reward


def _trainer(tmp_path, **config) -> "trl.GRPOTrainer":
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "a": 4, "b": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, eos_token_id=1, bos_token_id=2))
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=G, num_generations=G,
        max_completion_length=2, report_to="none", use_cpu=True, save_strategy="no",
        bf16=False, reward_weights=list(WEIGHTS), **config)
    data = Dataset.from_dict({"prompt": ["a b"] * G, "r0": [0.0] * G, "r1": [0.0] * G})
    return trl.GRPOTrainer(model=model, reward_funcs=[_reward("r0"), _reward("r1")],
                           args=args, train_dataset=data, processing_class=tokenizer)


def trl_advantages(trainer, rewards: torch.Tensor) -> torch.Tensor:
    """TRL's advantages ``[B]`` of the rewards ``[B, 2]`` (NaN as the functions' None)."""
    def value(x):
        return None if math.isnan(x) else float(x)
    inputs = [{"prompt": "a b", "r0": value(a), "r1": value(b)} for a, b in rewards.tolist()]
    return trainer._generate_and_score_completions(inputs)["advantages"]


def scored(rewards: torch.Tensor):
    """ratiokl's inputs as TRL forms them: the weighted sum of the rewards with None as 0,
    and ``valid``: some function gave a reward."""
    weighted = torch.nan_to_num(rewards * torch.tensor(WEIGHTS), nan=0.0).sum(-1)
    return weighted, ~torch.isnan(rewards).all(-1)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_sum_then_normalize_equals_trl(tmp_path, scale):
    rewards = torch.tensor(REWARDS)
    expected = trl_advantages(_trainer(tmp_path, scale_rewards=scale), rewards)
    scores, valid = scored(rewards)
    actual = advantages.grpo(scores, group_size=G, valid=valid, scale=scale, eps=1e-4,
                             singleton="zero")
    close(actual, expected)
    # TRL's groups are consecutive; ratiokl's ids may come in any order.
    order = torch.randperm(scores.numel(), generator=torch.Generator().manual_seed(0))
    ids = torch.arange(scores.numel()) // G
    shuffled = advantages.grpo(scores[order], ids[order], valid=valid[order], scale=scale,
                               eps=1e-4, singleton="zero")
    close(shuffled, expected[order])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_singleton_groups_equal_trl(tmp_path, scale):
    """Evaluation with ``num_generations_eval=1``: every group holds one sample."""
    trainer = _trainer(tmp_path, scale_rewards=scale, num_generations_eval=1)
    trainer.model.eval()
    rewards = torch.tensor([(1.0, 0.5), (0.0, 2.0), (NAN, NAN), (0.3, NAN)])
    expected = trl_advantages(trainer, rewards)
    scores, valid = scored(rewards)
    close(advantages.grpo(scores, group_size=1, valid=valid, scale=scale, eps=1e-4,
                          singleton="zero"), expected)


def _normalize_then_sum(rewards):
    """ratiokl's recipe for TRL's ``normalize_then_sum``: GDPO per reward function (no
    whitening), then GRPO over the whole batch as one group; a sample is valid unless every
    reward is None."""
    valid = ~torch.isnan(rewards).all(-1)
    summed = advantages.gdpo(rewards, group_size=G, valid=valid, weights=WEIGHTS, eps=1e-4,
                             singleton="zero", whiten="none")
    return advantages.grpo(summed, group_size=rewards.shape[0], valid=valid, eps=1e-4,
                           singleton="zero")


def test_normalize_then_sum_equals_trl(tmp_path):
    """GDPO per reward function, then TRL's batch step: GRPO over one group of the batch.
    Each sample's rewards are all given or all None (see the next test)."""
    rewards = torch.tensor(REWARDS)
    whole = ~torch.isnan(rewards).any(-1) | torch.isnan(rewards).all(-1)
    rewards = rewards[whole][:16]
    trainer = _trainer(tmp_path, multi_objective_aggregation="normalize_then_sum")
    expected = trl_advantages(trainer, rewards)
    actual = _normalize_then_sum(rewards)
    close(actual, expected)


def test_normalize_then_sum_with_a_missing_reward_differs_from_gdpo(tmp_path):
    """TRL leaves a function's None out of that function's group statistics only; ratiokl's
    ``valid`` is per sample, so it cannot: the documented limit of the recipe."""
    rewards = torch.tensor(REWARDS[8:12])
    trainer = _trainer(tmp_path, multi_objective_aggregation="normalize_then_sum")
    expected = trl_advantages(trainer, rewards)
    actual = _normalize_then_sum(rewards)
    assert not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL)
