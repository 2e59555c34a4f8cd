"""``ratiokl.adapters.trl.GRPOTrainer`` against TRL's own ``GRPOTrainer`` loss step.

A tiny random Llama (saved to a temporary folder: TRL rebuilds the reference model
from its path), a word-level tokenizer built in memory, no download. For each
``GRPOConfig`` the adapter maps, the same batch goes through TRL's
``_compute_loss`` (its fused log-prob head and loss) and through the adapter's
(``linear_policy_loss`` on the hidden states): the loss, every parameter's gradient
and the logged metrics must agree. Then a short ``train()`` runs end to end, and the
configurations ratiokl would compute differently are refused, naming the field.
"""

from __future__ import annotations

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

from readme_blocks import block_importing  # noqa: E402

from ratiokl.adapters import trl as adapter  # noqa: E402

WORDS = "a b c d e f g h i j k l m n o p q r s t".split()
B, P, T = 4, 5, 6  # completions, prompt and completion lengths of the hand-made batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The path of a saved tiny Llama and its tokenizer (vocabulary of 24)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({w: 4 + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _trainer(tiny, tmp_path, backend="native", **config):
    path, tokenizer = tiny
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
        max_completion_length=T, max_steps=2, logging_steps=1, report_to="none",
        use_cpu=True, save_strategy="no", bf16=False, **config)
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "g h", "i j k l"] * 2})
    return adapter.GRPOTrainer(
        model=path, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args, train_dataset=data, processing_class=tokenizer, ratiokl_backend=backend)


def _batch(old: bool, ref: bool, seed: int = 0):
    """A generation batch as TRL's loss step receives it: left-padded prompts, completions
    ending in padding, per-sequence advantages."""
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
        "advantages": torch.randn(B, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }
    if old:  # a behaviour policy a little off the current one
        batch["old_per_token_logps"] = -3.0 + 0.3 * torch.randn(B, T, generator=g)
    if ref:
        batch["ref_per_token_logps"] = -3.0 + 0.3 * torch.randn(B, T, generator=g)
    return batch


def _step(trainer, compute, batch):
    """``(loss, {parameter: gradient}, logged metrics)`` of one loss step."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = compute(model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return loss.item(), grads, logged


CONFIGS = {
    "grpo_on_policy": ({"loss_type": "grpo"}, False, False),
    "bnpo_off_policy_kl": ({"loss_type": "bnpo", "beta": 0.04}, True, True),
    "dr_grpo_kl_no_bias_correction": (
        {"loss_type": "dr_grpo", "beta": 0.1, "use_bias_correction_kl": False}, True, True),
    "dapo_clip_higher_delta": (
        {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5}, True, False),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.2}, True, False),
}


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_step_matches_trl(tiny, tmp_path, name, backend):
    config, old, ref = CONFIGS[name]
    if backend == "interpret":
        pytest.importorskip("triton")
    trainer = _trainer(tiny, tmp_path, backend=backend, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2  # set by train(); 2 tests the factor
    batch = _batch(old, ref)
    want_loss, want_grads, want_logged = _step(
        trainer, lambda m, b: trl.GRPOTrainer._compute_loss(trainer, m, b), batch)
    got_loss, got_grads, got_logged = _step(trainer, trainer._compute_loss, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    assert set(got_grads) == set(want_grads)
    for param, want in want_grads.items():
        torch.testing.assert_close(got_grads[param], want, rtol=2e-3, atol=2e-6, msg=param)
    assert set(got_logged) <= set(want_logged), set(got_logged) - set(want_logged)
    assert "entropy" in got_logged and ("kl" in got_logged) == (config.get("beta", 0) != 0)
    for key, value in got_logged.items():
        assert value == pytest.approx(want_logged[key], rel=1e-4, abs=1e-6), key


def test_vllm_importance_sampling_ratio_weighs_the_policy_term(tiny, tmp_path):
    """With vLLM's correction on, TRL multiplies the policy term by the batch's
    ``importance_sampling_ratio`` (``[B, 1]`` in its sequence modes); so does the adapter."""
    trainer = _trainer(tiny, tmp_path, loss_type="dapo")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    batch = _batch(old=True, ref=False)
    batch["importance_sampling_ratio"] = torch.tensor([[0.5], [1.0], [2.0], [0.0]])
    want_loss, want_grads, _ = _step(
        trainer, lambda m, b: trl.GRPOTrainer._compute_loss(trainer, m, b), batch)
    got_loss, got_grads, _ = _step(trainer, trainer._compute_loss, batch)
    assert got_loss == pytest.approx(want_loss, rel=1e-4, abs=1e-6)
    for param, want in want_grads.items():
        torch.testing.assert_close(got_grads[param], want, rtol=2e-3, atol=2e-6, msg=param)


def test_train_runs_and_logs(tiny, tmp_path):
    """Two optimizer steps of real generation and training through the adapter's loss."""
    trainer = _trainer(tiny, tmp_path, beta=0.04)
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
    ({"loss_type": "sapo"}, "loss_type"),
    ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile"),
    ({"entropy_coef": 0.01}, "entropy_coef"),
    ({"loss_type": "cispo", "epsilon_high": 0.28}, "epsilon_high"),
])
def test_refused_configurations_name_the_field(config, field):
    args = trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True, **config)
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.loss_options(args)


def test_bf16_autocast_step_matches_trl(tiny, tmp_path):
    """Under bf16 autocast (``GRPOConfig(bf16=True)`` on a GPU) a backbone may hand back
    bf16 hidden states beside the float32 head (Llama's does not on the CPU: its final
    norm's output is made bf16 here): the head is cast to their dtype for the call, and
    the step stays TRL's within bf16."""
    trainer = _trainer(tiny, tmp_path, loss_type="bnpo", beta=0.04)
    trainer.model.model.norm.register_forward_hook(lambda m, i, out: out.to(torch.bfloat16))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = _batch(old=True, ref=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, want_grads, _ = _step(
            trainer, lambda m, b: trl.GRPOTrainer._compute_loss(trainer, m, b), batch)
        got_loss, got_grads, _ = _step(trainer, trainer._compute_loss, batch)
    assert got_loss == pytest.approx(want_loss, rel=2e-2, abs=1e-3)
    for param, want in want_grads.items():
        rel = float((got_grads[param] - want).norm() / (want.norm() + 1e-12))
        assert rel < 3e-2, (param, rel)


@pytest.mark.parametrize("keyword, value", [
    ("ratiokl_chunk_rows", 0), ("ratiokl_chunk_rows", 2.5), ("ratiokl_backend", "cuda"),
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
