"""``ratiokl.adapters.tunix`` on packed batches and on Tunix's own model classes.

Packed: the hand-made batch packed by Tunix's own packer (``rl.utils.pack_sequences``,
what ``max_seq_token_per_tpu`` runs) into one row of prompts and completions back to back.
Tunix's ``grpo`` loss aggregates a packed row as one sequence; the adapter aggregates
each packed sequence (``segment_ids``). The oracle is Tunix's own loss on the same row
repeated once per packed sequence, each copy's ``completion_mask`` kept to its sequence
(the same model call per copy, so the same log-probs): a "sequence" is then a packed
sequence in both. ``token-mean`` does not depend on the grouping: there the oracle is also
Tunix's loss on the packed batch as it is.

Heads: tiny Gemma (tied embedding, ``final_logit_softcap``), Gemma3, Qwen2 (tied
embedding) and Qwen3 (tied embedding; untied ``lm_head``) built in code with random weights, and the toy with
qwix LoRA (Tunix's ``test_common.get_lora_model``) on its MLP: the ``"ratiokl_grpo"``
loss (hidden states and head) against Tunix's ``grpo`` loss. LoRA on the head is
refused by it, and ``"ratiokl_grpo_logits"`` runs that model as Tunix does.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("tunix")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.gemma import model as gemma_lib  # noqa: E402
from tunix.models.gemma3 import model as gemma3_lib  # noqa: E402
from tunix.models.qwen2 import model as qwen2_lib  # noqa: E402
from tunix.models.qwen3 import model as qwen3_lib  # noqa: E402
from tunix.rl import algo_core  # noqa: E402
from tunix.rl import utils as rl_utils  # noqa: E402
from tunix.tests import test_common  # noqa: E402
from tunix_batches import (  # noqa: E402
    EOS, PAD, NonFiniteAtPads, assert_same_loss, config, example, loss_and_grads, toy_model)

from ratiokl.adapters import tunix as adapter  # noqa: E402

LOSSES = {adapter.NAME: adapter.grpo_loss_fn, adapter.LOGITS_NAME: adapter.grpo_logits_loss_fn}
BUDGET = 32  # the batch's 28 tokens, then 4 of padding


def _packed(batch):
    """The batch as Tunix's packer writes it: one ``[1, BUDGET]`` row."""
    (packed,) = next(rl_utils.pack_sequences(iter([[batch]]), BUDGET, pad_id=PAD))
    assert packed.segment_ids is not None and packed.completion_ids.shape == (1, BUDGET)
    return packed


def _one_copy_per_sequence(packed):
    """The packed row once per packed sequence, each copy active on that sequence only."""
    segments = packed.segment_ids[0]
    count = int(jnp.max(segments))
    keep = (segments[None, :] == jnp.arange(1, count + 1)[:, None]).astype(jnp.int32)

    def rows(x):
        return None if x is None else jnp.repeat(x, count, axis=0)

    return packed.replace(
        prompt_ids=rows(packed.prompt_ids), prompt_mask=rows(packed.prompt_mask),
        completion_ids=rows(packed.completion_ids),
        completion_mask=rows(packed.completion_mask) * keep,
        advantages=rows(packed.advantages), segment_ids=rows(packed.segment_ids),
        segment_positions=rows(packed.segment_positions),
        old_per_token_logps=rows(packed.old_per_token_logps),
        ref_per_token_logps=rows(packed.ref_per_token_logps))


PACKED_CASES = {
    "token_mean_k1": ({"beta": 0.04, "loss_agg_mode": "token-mean"}, True, True),
    "seq_mean_token_mean": ({"beta": 0.0}, True, False),
    "seq_mean_token_sum_mse_kl": ({"beta": 0.1, "kl_loss_mode": "mse_kl",
                                   "loss_agg_mode": "seq-mean-token-sum"}, True, True),
    "gspo_token": ({"beta": 0.0, "loss_algo": "gspo-token"}, True, False),
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_packed_batch_matches_tunix_per_packed_sequence(name, backend, loss, monkeypatch):
    fields, old, ref = PACKED_CASES[name]
    if backend == "interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch")
    algo_config, model = config(**fields), toy_model()
    packed = _packed(example(old, ref))
    want = loss_and_grads(algo_core.grpo_loss_fn, model, _one_copy_per_sequence(packed),
                          algo_config)
    if fields.get("loss_agg_mode") == "token-mean":  # Tunix's own packed loss agrees
        assert_same_loss(loss_and_grads(algo_core.grpo_loss_fn, model, packed, algo_config),
                         want)
    options = adapter.loss_options
    monkeypatch.setattr(adapter, "loss_options", lambda c: {**options(c), "backend": backend})
    assert_same_loss(loss_and_grads(LOSSES[loss], model, packed, algo_config), want)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("name", ["token_mean_k1", "gspo_token"])
def test_packed_nonfinite_padding_is_isolated(name, loss):
    """A packed row with NaN / +inf hidden states and logits on its trailing padding and
    NaN / -inf old and reference log-probs wherever ``completion_mask`` is 0 (prompts,
    padding, the dropped first position): Tunix's per-sequence loss on the clean row."""
    fields, old, ref = PACKED_CASES[name]
    algo_config, packed = config(**fields), _packed(example(old, ref))
    inactive = packed.completion_mask == 0
    poison = jnp.where(jnp.arange(BUDGET) % 2 == 0, jnp.nan, -jnp.inf)

    def poisoned(x):
        return None if x is None else jnp.where(inactive, poison, x)

    batch = packed.replace(old_per_token_logps=poisoned(packed.old_per_token_logps),
                           ref_per_token_logps=poisoned(packed.ref_per_token_logps))
    want = loss_and_grads(algo_core.grpo_loss_fn, toy_model(), _one_copy_per_sequence(packed),
                          algo_config)
    assert_same_loss(loss_and_grads(LOSSES[loss], toy_model(NonFiniteAtPads), batch,
                                    algo_config), want)


def test_packed_token_scale_is_refused():
    """``sequence-mean-token-scale`` divides by the padded completion length: refused on
    a packed batch, naming ``segment_ids``."""
    packed = _packed(example(True, False))
    algo_config = config(loss_agg_mode="sequence-mean-token-scale")
    for fn in LOSSES.values():
        with pytest.raises(ValueError, match="`segment_ids="):
            fn(toy_model(), packed, algo_config, PAD, EOS)


def _gemma(softcap):
    """Gemma with its embedding scaled up, so that logits reach past the softcap."""
    layers = 2
    model = gemma_lib.Gemma(gemma_lib.ModelConfig(
        num_layers=layers, num_embed=48, embed_dim=16, hidden_dim=32, num_heads=2,
        head_dim=8, num_kv_heads=1, final_logit_softcap=softcap, use_post_attn_norm=True,
        use_post_ffw_norm=True, attention_types=(gemma_lib.AttentionType.GLOBAL,) * layers),
        rngs=nnx.Rngs(1))
    embedding = model.embedder.input_embedding
    embedding[...] = embedding[...] * 300.0
    return model


def _gemma3():
    return gemma3_lib.Gemma3(gemma3_lib.ModelConfig(
        num_layers=2, num_embed=48, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
        num_kv_heads=1, sliding_window_size=4, param_dtype=jnp.float32), rngs=nnx.Rngs(1))


def _qwen(lib, cls, tied):
    return cls(lib.ModelConfig(
        num_layers=2, vocab_size=48, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
        num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=tied),
        rngs=nnx.Rngs(1))


MODELS = {"gemma_softcap": lambda: _gemma(5.0), "gemma3": _gemma3,
          "qwen2_tied": lambda: _qwen(qwen2_lib, qwen2_lib.Qwen2, True),
          "qwen3_tied": lambda: _qwen(qwen3_lib, qwen3_lib.Qwen3, True),
          "qwen3_lm_head": lambda: _qwen(qwen3_lib, qwen3_lib.Qwen3, False)}


#: On-policy GSPO: with these models' log-probs far from the batch's old ones, off-policy
#: GSPO clips every sequence and leaves a gradient of float32 rounding noise only.
HEAD_CASES = {"token_mean_k1": PACKED_CASES["token_mean_k1"],
              "gspo_on_policy": ({"beta": 0.0, "loss_algo": "gspo-token"}, False, False)}


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_tunix_models_heads_match_tunix_grpo(model_name, name):
    fields, old, ref = HEAD_CASES[name]
    algo_config, batch, model = config(**fields), example(old, ref, vocab=48), \
        MODELS[model_name]()
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config)
    assert_same_loss(loss_and_grads(adapter.grpo_loss_fn, model, batch, algo_config), want)


def _lora(module_path):
    return test_common.get_lora_model(toy_model(), module_path=module_path)


def test_lora_model_matches_tunix_grpo():
    """LoRA on the toy's MLP (Tunix's own test pattern): the head is untouched, and the
    loss and every gradient (the LoRA parameters' included) are Tunix's."""
    algo_config, batch, model = config(beta=0.04), example(True, True), _lora(".*w1|.*w2")
    assert jax.tree_util.tree_leaves(nnx.state(model, nnx.LoRAParam))
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config)
    assert_same_loss(loss_and_grads(adapter.grpo_loss_fn, model, batch, algo_config), want)


def test_lora_on_the_head_is_refused_and_the_logits_loss_runs_it():
    algo_config, batch, model = config(beta=0.04), example(True, True), _lora(".*lm_head")
    with pytest.raises(ValueError, match="lm_head.kernel.*LoRA.*ratiokl_grpo_logits"):
        adapter.grpo_loss_fn(model, batch, algo_config, PAD, EOS)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config)
    assert_same_loss(loss_and_grads(adapter.grpo_logits_loss_fn, model, batch, algo_config),
                     want)
