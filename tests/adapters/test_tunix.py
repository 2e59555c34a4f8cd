"""``ratiokl.adapters.tunix``'s ``"ratiokl_grpo"`` against Tunix's own ``"grpo"`` loss.

Tunix's toy transformer (``tunix.tests.test_common``, random weights, no download), a
hand-made ``TrainExample`` (prompts with padding, completions ending in padding), both
losses called as the GRPO learner calls them: the loss, every parameter's gradient
(``nnx.grad``) and the logged ``aux`` entries must agree, on the native and interpreted
Triton backends. The name is registered by the import and resolves through Tunix's
registry; unmapped configurations are refused, naming the field, when the adapter's
``GRPOLearner`` is built on a real (toy) ``RLCluster``.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("tunix")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core, function_registry  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402
from tunix.tests import test_common  # noqa: E402

from readme_blocks import block_importing  # noqa: E402

from ratiokl.adapters import tunix as adapter  # noqa: E402

VOCAB, PAD, EOS = 32, 0, 1
B, P, T = 4, 3, 6


def _model():
    return test_common.ToyTransformer(test_common.ModelConfig(vocab_size=VOCAB),
                                      rngs=nnx.Rngs(0))


def _example(old: bool, ref: bool, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    prompt = jax.random.randint(keys[0], (B, P), 2, VOCAB).at[1, 0].set(PAD)
    completion_mask = jnp.ones((B, T), jnp.int32).at[0, 4:].set(0).at[2, 1:].set(0)
    completion = jax.random.randint(keys[1], (B, T), 2, VOCAB) * completion_mask
    return grpo_learner.TrainExample(
        prompt_ids=prompt, prompt_mask=(prompt != PAD).astype(jnp.int32),
        completion_ids=completion, completion_mask=completion_mask,
        advantages=jax.random.normal(keys[2], (B,)),
        ref_per_token_logps=-3.0 + 0.3 * jax.random.normal(keys[3], (B, T)) if ref else None,
        old_per_token_logps=-3.0 + 0.3 * jax.random.normal(keys[4], (B, T)) if old else None,
    )


def _config(**fields):
    """A ``GRPOConfig``; ``epsilon_c`` and ``kl_clamp_value`` are not its fields: Tunix's
    loss reads them with ``getattr``, so they are set as attributes."""
    extra = {k: fields.pop(k) for k in ("epsilon_c", "kl_clamp_value") if k in fields}
    config = grpo_learner.GRPOConfig(num_generations=2, **fields)
    config.temperature = 0.9  # the learner sets it from the rollout config
    for key, value in extra.items():
        object.__setattr__(config, key, value)
    return config


def _loss_and_grads(fn, model, example, config):
    def loss(m):
        value, aux = fn(m, example, config, PAD, EOS)
        return value, aux

    (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return value, aux, grads


CASES = {
    "grpo_on_policy_seq_mean": ({"beta": 0.0}, False, False),
    "grpo_kl_k1_token_mean": ({"beta": 0.04, "loss_agg_mode": "token-mean"}, True, True),
    "low_var_kl_dual_clip_token_scale": (
        {"beta": 0.1, "kl_loss_mode": "low_var_kl", "epsilon_c": 3.0,
         "loss_agg_mode": "sequence-mean-token-scale"}, True, True),
    "mse_kl_seq_token_sum": ({"beta": 0.1, "kl_loss_mode": "mse_kl",
                              "loss_agg_mode": "seq-mean-token-sum"}, True, True),
    "gspo_token": ({"beta": 0.0, "loss_algo": "gspo-token"}, True, False),
}


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_tunix_grpo(name, backend, monkeypatch):
    fields, old, ref = CASES[name]
    if backend == "interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch")
    config, example = _config(**fields), _example(old, ref)
    model = _model()
    want, want_aux, want_grads = _loss_and_grads(algo_core.grpo_loss_fn, model, example, config)
    options = adapter.loss_options(config)
    monkeypatch.setattr(adapter, "loss_options", lambda c: {**options, "backend": backend})
    got, got_aux, got_grads = _loss_and_grads(adapter.grpo_loss_fn, model, example, config)
    assert float(got) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    flat_want = jax.tree_util.tree_leaves_with_path(nnx.state(want_grads))
    flat_got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(got_grads)))
    assert flat_want and len(flat_want) == len(flat_got)
    for path, g_want in flat_want:
        g_got = flat_got[path]
        scale = float(jnp.max(jnp.abs(g_want))) + 1e-6
        err = float(jnp.max(jnp.abs(g_got - g_want)))
        assert err <= 1e-3 * scale + 1e-6, (jax.tree_util.keystr(path), err, scale)
    for key in ("kl", "pg_clipfrac", "ppo_kl", "is_ratio/mean"):
        assert float(got_aux[key]) == pytest.approx(float(want_aux[key]), rel=1e-4,
                                                    abs=1e-6), key


def test_registered_name_resolves_through_tunix():
    config = _config(policy_loss_fn=adapter.NAME)
    assert function_registry.get_policy_loss_fn(config.policy_loss_fn) is adapter.grpo_loss_fn


def test_jit_with_the_learner_signature():
    """Under ``nnx.jit``, as the trainer runs it: the same value as eager."""
    model, example, config = _model(), _example(True, True), _config(beta=0.04)
    eager, _ = adapter.grpo_loss_fn(model, example, config, PAD, EOS)
    jitted = nnx.jit(lambda m, e: adapter.grpo_loss_fn(m, e, config, PAD, EOS)[0])
    assert float(jitted(model, example)) == pytest.approx(float(eager), rel=1e-6)


@pytest.mark.parametrize("fields, field", [
    ({"kl_loss_mode": "full"}, "kl_loss_mode"),
    ({"loss_agg_mode": "sequence-mean-token-sum-norm"}, "loss_agg_mode"),
    ({"kl_clamp_value": 10.0}, "kl_clamp_value"),
])
def test_refused_configurations_name_the_field(fields, field):
    config = _config()
    for key, value in fields.items():
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.loss_options(config)


def _cluster(packing=None):
    """A Tunix ``RLCluster`` of the toy transformer on one CPU device (vanilla rollout;
    the model's vocabulary of ``VOCAB`` covers the mock tokenizer's)."""
    vocab, model = test_common.MockVocab(), _model()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE,
             rl_cluster_lib.Role.ROLLOUT)
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh=dict.fromkeys(roles, mesh), rollout_engine="vanilla",
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-3), eval_every_n_steps=10, max_steps=1,
            max_seq_token_per_tpu=packing),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=4,
                                                  max_prompt_length=8, kv_cache_size=64))
    return rl_cluster_lib.RLCluster(actor=model, reference=model, tokenizer=vocab,
                                    cluster_config=config)


def _reward(prompts, completions, **_):
    return [0.0] * len(completions)


@pytest.mark.parametrize("fields, packing, field", [
    ({"kl_clamp_value": 10.0}, None, "kl_clamp_value"),
    ({"kl_loss_mode": "full"}, None, "kl_loss_mode"),
    ({"loss_agg_mode": "sequence-mean-token-sum-norm"}, None, "loss_agg_mode"),
    ({}, 64, "max_seq_token_per_tpu"),
    ({"policy_loss_fn": "grpo"}, None, "policy_loss_fn"),
])
def test_learner_refuses_when_built(fields, packing, field):
    """Refused by the learner's constructor, before any rollout (Tunix's own learner only
    reaches the loss inside the first jitted train step)."""
    config = _config(**{"policy_loss_fn": adapter.NAME, **fields})
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.GRPOLearner(_cluster(packing), config, _reward)


def test_learner_built_trains_with_the_ratiokl_loss():
    """A mapped configuration builds, and the actor trainer's loss is ``grpo_loss_fn``."""
    cluster = _cluster()
    config = _config(policy_loss_fn=adapter.NAME, beta=0.04)
    learner = adapter.GRPOLearner(cluster, config, _reward)
    model, example = cluster.actor_trainer.model, _example(True, True)
    got, _ = cluster.actor_trainer.loss_fn(model, example, config)
    want, _ = adapter.grpo_loss_fn(model, example, learner.algo_config, cluster.rollout.pad_id(),
                                   cluster.rollout.eos_id())
    assert np.isfinite(float(want)) and float(got) == float(want)


def test_the_readmes_tunix_block_runs_here():
    """The README's Tunix block, as printed, in Tunix's environment (without TRL)."""
    block = block_importing("ratiokl.adapters.tunix")
    namespace = {}
    exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
    assert namespace["GRPOLearner"] is adapter.GRPOLearner
    assert function_registry.get_policy_loss_fn(
        namespace["algo_config"].policy_loss_fn) is adapter.grpo_loss_fn
