"""Tunix batches, configurations and the comparison of two policy losses, for the Tunix
adapter's tests (import after ``pytest.importorskip("tunix")``).

The model is Tunix's toy transformer (``tunix.tests.test_common``, random weights, no
download); the ``TrainExample`` is hand-made: prompts with left padding, completions of
uneven lengths ending in padding (one of a single token).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from assertions import assert_close, two_paths
from flax import nnx
from tunix.rl import common
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common

from ratiokl.spec import linear_grad_tolerance, trainer_tolerance

VOCAB, PAD, EOS = 32, 0, 1
B, P, T = 4, 3, 6

LossFn = Callable[..., Tuple[jax.Array, Dict[str, jax.Array]]]


def toy_model(cls: type = test_common.ToyTransformer, vocab: int = VOCAB) -> nnx.Module:
    """The toy transformer (or a subclass), always the same weights."""
    return cls(test_common.ModelConfig(vocab_size=vocab), rngs=nnx.Rngs(0))


class NonFiniteAtPads(test_common.ToyTransformer):
    """The toy transformer whose hidden states and logits are NaN / +inf wherever the
    input token is padding: the positions that score inactive completion tokens. The
    logits are poisoned after the head (its backward stays finite, so the logits path is
    judged on its logits alone); the hidden states before it."""

    def __call__(self, x, positions, cache=None, attention_mask=None,
                 output_hidden_states=False, images=None, segment_ids=None):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        pads = (x == PAD)[..., None]
        poison = jnp.where((jnp.arange(x.shape[1]) % 2 == 1)[None, :, None], jnp.inf, jnp.nan)
        if output_hidden_states:
            self.sow(nnx.Intermediate, "all_hidden_states", jnp.where(pads, poison, h))
        return jnp.where(pads, poison, self.lm_head(h)), cache


def example(old: bool, ref: bool, seed: int = 0, vocab: int = VOCAB) -> Any:
    """A ``TrainExample`` of ``B`` prompts of ``P`` and completions of ``T`` tokens."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    prompt = jax.random.randint(keys[0], (B, P), 2, vocab).at[1, 0].set(PAD)
    completion_mask = jnp.ones((B, T), jnp.int32).at[0, 4:].set(0).at[2, 1:].set(0)
    completion = jax.random.randint(keys[1], (B, T), 2, vocab) * completion_mask
    return grpo_learner.TrainExample(
        prompt_ids=prompt, prompt_mask=(prompt != PAD).astype(jnp.int32),
        completion_ids=completion, completion_mask=completion_mask,
        advantages=jax.random.normal(keys[2], (B,)),
        ref_per_token_logps=-3.0 + 0.3 * jax.random.normal(keys[3], (B, T)) if ref else None,
        old_per_token_logps=-3.0 + 0.3 * jax.random.normal(keys[4], (B, T)) if old else None,
    )


def config(**fields: Any) -> Any:
    """A ``GRPOConfig``; ``epsilon_c`` and ``kl_clamp_value`` are not its fields: Tunix's
    loss reads them with ``getattr``, so they are set as attributes."""
    extra = {k: fields.pop(k) for k in ("epsilon_c", "kl_clamp_value") if k in fields}
    made = grpo_learner.GRPOConfig(num_generations=2, **fields)
    made.temperature = 0.9  # the learner sets it from the rollout config
    for key, value in extra.items():
        object.__setattr__(made, key, value)
    return made


def cluster(packing: Optional[int] = None, model: Optional[nnx.Module] = None,
            reference: Optional[nnx.Module] = None, seed: Optional[int] = None) -> Any:
    """A Tunix ``RLCluster`` on one CPU device: the toy transformer (``VOCAB`` covers the
    mock tokenizer's ids) as actor and reference unless given, vanilla rollout (seeded
    with ``seed``), SGD, one step, packed rows of ``packing`` tokens."""
    model = model or toy_model()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
             rl_cluster_lib.Role.ROLLOUT)
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh=dict.fromkeys(roles, mesh), rollout_engine="vanilla",
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-2), eval_every_n_steps=10, max_steps=1,
            max_seq_token_per_tpu=packing),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=4, max_prompt_length=8, kv_cache_size=64,
            seed=None if seed is None else jax.random.PRNGKey(seed)))
    return rl_cluster_lib.RLCluster(actor=model, reference=reference or model,
                                    tokenizer=test_common.MockVocab(),
                                    cluster_config=cluster_config)


def logit_scale(model: nnx.Module, batch: Any, temperature: float) -> float:
    """``max |logits / T|`` of ``model`` on ``batch``'s prompts and completions, over the
    finite logits (at least 1)."""
    segments = getattr(batch, "segment_ids", None)
    ids, positions, mask, _ = common.process_ids(
        batch.prompt_ids, batch.completion_ids, PAD, EOS, segment_ids=segments,
        segment_positions=getattr(batch, "segment_positions", None))
    extra = {} if segments is None else {"segment_ids": segments}
    logits, _ = model(ids, positions=positions, attention_mask=mask, cache=None, **extra)
    z = np.abs(np.asarray(logits, np.float64) / temperature)
    return max(1.0, float(np.max(z[np.isfinite(z)], initial=1.0)))


def loss_and_grads(fn: LossFn, model: nnx.Module, batch: Any, algo_config: Any,
                   jit: bool = False) -> Tuple[jax.Array, Dict[str, jax.Array], Any]:
    """``fn``'s ``(loss, aux, d loss / d parameters)`` as the learner calls it, under
    ``nnx.jit`` with ``jit``; ``aux["_logit_scale"]``: :func:`logit_scale` (the tests')."""
    def loss(m, e):
        return fn(m, e, algo_config, PAD, EOS)

    step = nnx.value_and_grad(loss, has_aux=True)
    if jit:
        step = nnx.jit(step)
    (value, aux), grads = step(model, batch)
    scale = logit_scale(model, batch, algo_config.temperature)
    return value, {**aux, "_logit_scale": scale}, grads


def assert_same_loss(got: Tuple[Any, Any, Any], want: Tuple[Any, Any, Any]) -> None:
    """The loss, every parameter's gradient and the aux entries both define alike: two
    float32 evaluations, the loss and aux summed over the ``B x T`` completion tokens;
    each parameter's gradient relative to its largest entry (two backward passes from the
    head's gradients)."""
    (got_loss, got_aux, got_grads), (want_loss, want_aux, want_grads) = got, want
    tol = two_paths(trainer_tolerance(B * T))
    assert_close(got_loss, want_loss, tol, "loss")
    flat_want = jax.tree_util.tree_leaves_with_path(nnx.state(want_grads))
    flat_got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(got_grads)))
    assert flat_want and len(flat_want) == len(flat_got)
    for path, g_want in flat_want:
        g_got = flat_got[path]
        assert bool(jnp.all(jnp.isfinite(g_got))), jax.tree_util.keystr(path)
        grad_tol = linear_grad_tolerance("float32", want_aux["_logit_scale"],
                                         float(jnp.max(jnp.abs(g_want))))
        assert_close(g_got, g_want, two_paths(grad_tol), jax.tree_util.keystr(path))
    for key in ("kl", "pg_clipfrac", "ppo_kl", "is_ratio/mean"):
        assert_close(got_aux[key], want_aux[key], tol, key)
