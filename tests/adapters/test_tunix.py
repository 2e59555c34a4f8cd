"""``ratiokl.adapters.tunix``'s losses against Tunix's own ``"grpo"`` loss.

Tunix's toy transformer and a hand-made ``TrainExample`` (``tunix_batches``): both losses
called as the GRPO learner calls them, eagerly and under ``nnx.jit``; the loss, every
parameter's gradient (``nnx.grad``) and the logged ``aux`` entries must agree, on the
native and interpreted Triton backends, for ``"ratiokl_grpo"`` (hidden states and the
lm_head) and ``"ratiokl_grpo_logits"`` (the model's logits). The names are registered by
the import and resolve through Tunix's registry; unmapped configurations are refused,
naming the field, when the adapter's ``GRPOLearner`` is built on a real (toy)
``RLCluster``.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("tunix")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl import algo_core, function_registry  # noqa: E402

from readme_blocks import block_importing  # noqa: E402
from tunix_batches import (  # noqa: E402
    EOS, PAD, NonFiniteAtPads, assert_same_loss, cluster, config, example, loss_and_grads,
    toy_model)

from ratiokl.adapters import tunix as adapter  # noqa: E402

LOSSES = {adapter.NAME: adapter.grpo_loss_fn, adapter.LOGITS_NAME: adapter.grpo_logits_loss_fn}


def _with_backend(monkeypatch, backend):
    if backend == "interpret":
        pytest.importorskip("triton")
        pytest.importorskip("torch")
    options = adapter.loss_options
    monkeypatch.setattr(adapter, "loss_options", lambda c: {**options(c), "backend": backend})


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


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_tunix_grpo(name, backend, loss, monkeypatch):
    fields, old, ref = CASES[name]
    algo_config, batch, model = config(**fields), example(old, ref), toy_model()
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config)
    _with_backend(monkeypatch, backend)
    assert_same_loss(loss_and_grads(LOSSES[loss], model, batch, algo_config), want)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("name", ["grpo_kl_k1_token_mean", "gspo_token"])
def test_matches_tunix_grpo_under_jit(name, loss):
    """Both losses' ``value_and_grad`` under ``nnx.jit``, as Tunix's train step runs."""
    fields, old, ref = CASES[name]
    algo_config, batch, model = config(**fields), example(old, ref), toy_model()
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config, jit=True)
    assert_same_loss(loss_and_grads(LOSSES[loss], model, batch, algo_config, jit=True), want)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", ["grpo_kl_k1_token_mean", "low_var_kl_dual_clip_token_scale",
                                  "gspo_token"])
def test_nonfinite_padding_is_isolated(name, backend, loss, monkeypatch):
    """NaN / inf hidden states, logits, old and reference log-probs on the padded
    positions: the loss, aux and every gradient are Tunix's on the clean batch (Tunix's own
    loss turns NaN there into a NaN loss)."""
    fields, old, ref = CASES[name]
    algo_config, clean = config(**fields), example(old, ref)
    inactive = clean.completion_mask == 0
    poison = jnp.where(jnp.arange(clean.completion_ids.shape[1]) % 2 == 0, jnp.nan, -jnp.inf)

    def poisoned(x):
        return None if x is None else jnp.where(inactive, poison, x)

    batch = clean.replace(old_per_token_logps=poisoned(clean.old_per_token_logps),
                          ref_per_token_logps=poisoned(clean.ref_per_token_logps))
    want = loss_and_grads(algo_core.grpo_loss_fn, toy_model(), clean, algo_config)
    tunix_on_poison, _, _ = loss_and_grads(algo_core.grpo_loss_fn, toy_model(NonFiniteAtPads),
                                           batch, algo_config)
    assert not np.isfinite(float(tunix_on_poison))  # the poison reaches Tunix's own loss
    _with_backend(monkeypatch, backend)
    assert_same_loss(loss_and_grads(LOSSES[loss], toy_model(NonFiniteAtPads), batch,
                                    algo_config), want)


def _compiled(fn, model, batch, algo_config):
    step = nnx.jit(nnx.value_and_grad(lambda m, e: fn(m, e, algo_config, PAD, EOS)[0]))
    return step.lower(model, batch).compile().as_text()


def test_hidden_state_loss_builds_no_model_logits():
    """Under ``jit`` the ``"ratiokl_grpo"`` step holds no ``[B, P + T, V]`` float32 array:
    XLA drops the toy model's own head (the logits loss keeps it: the check can fail).
    The vocabulary is one no other array of the toy has as a dimension."""
    vocab = 40
    algo_config, batch, model = config(beta=0.04), example(True, True, vocab=vocab), \
        toy_model(vocab=vocab)
    rows, length = batch.completion_ids.shape[0], batch.prompt_ids.shape[1] + \
        batch.completion_ids.shape[1]
    logits_shape = f"f32[{rows},{length},{vocab}]"
    assert logits_shape in _compiled(adapter.grpo_logits_loss_fn, model, batch, algo_config)
    assert logits_shape not in _compiled(adapter.grpo_loss_fn, model, batch, algo_config)


def test_registered_names_resolve_through_tunix():
    for name, fn in LOSSES.items():
        assert function_registry.get_policy_loss_fn(
            config(policy_loss_fn=name).policy_loss_fn) is fn


class _Unregistered(nnx.Module):
    """A model class the adapter does not know (it wraps the toy transformer)."""

    def __init__(self):
        self.inner = toy_model()
        self.config = self.inner.config  # Tunix's rollout reads it

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def test_unregistered_model_is_refused_and_the_logits_loss_runs_it():
    algo_config, batch, model = config(beta=0.04), example(True, True), _Unregistered()
    with pytest.raises(ValueError, match="_Unregistered.*register_lm_head.*ratiokl_grpo_logits"):
        adapter.grpo_loss_fn(model, batch, algo_config, PAD, EOS)
    want = loss_and_grads(algo_core.grpo_loss_fn, model, batch, algo_config)
    assert_same_loss(loss_and_grads(adapter.grpo_logits_loss_fn, model, batch, algo_config),
                     want)


class _Sowing(_Unregistered):
    """``_Unregistered`` that sows its hidden states as Tunix's models do."""

    def __call__(self, x, positions, cache=None, attention_mask=None,
                 output_hidden_states=False, segment_ids=None):
        h = self.inner.emb(x)
        for layer in self.inner.layers:
            h = layer(h)
        if output_hidden_states:
            self.sow(nnx.Intermediate, "all_hidden_states", h)
        return self.inner.lm_head(h), cache


def test_register_lm_head_teaches_a_class(monkeypatch):
    """A registered class that sows its hidden states runs as Tunix's loss; one that does
    not is refused, naming what it lacks."""
    monkeypatch.setattr(adapter._tunix_heads, "_HEADS", dict(adapter._tunix_heads._HEADS))

    def head_of(m):
        return adapter.LMHead(m.inner.lm_head.kernel[...].T, m.inner.lm_head.bias[...])

    for cls in (_Sowing, _Unregistered):
        adapter.register_lm_head(cls, head_of)
    algo_config, batch = config(beta=0.04), example(True, True)
    want = loss_and_grads(algo_core.grpo_loss_fn, _Sowing(), batch, algo_config)
    assert_same_loss(loss_and_grads(adapter.grpo_loss_fn, _Sowing(), batch, algo_config), want)
    with pytest.raises(ValueError, match="sowed no 'all_hidden_states'"):
        adapter.grpo_loss_fn(_Unregistered(), batch, algo_config, PAD, EOS)


@pytest.mark.parametrize("fields, field", [
    ({"kl_loss_mode": "full"}, "kl_loss_mode"),
    ({"loss_agg_mode": "sequence-mean-token-sum-norm"}, "loss_agg_mode"),
    ({"kl_clamp_value": 10.0}, "kl_clamp_value"),
])
def test_refused_configurations_name_the_field(fields, field):
    algo_config = config()
    for key, value in fields.items():
        object.__setattr__(algo_config, key, value)
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.loss_options(algo_config)


def _reward(prompts, completions, **_):
    return [0.0] * len(completions)


@pytest.mark.parametrize("fields, packing, field", [
    ({"kl_clamp_value": 10.0}, None, "kl_clamp_value"),
    ({"kl_loss_mode": "full"}, None, "kl_loss_mode"),
    ({"loss_agg_mode": "sequence-mean-token-sum-norm"}, None, "loss_agg_mode"),
    ({"loss_agg_mode": "sequence-mean-token-scale"}, 64, "max_seq_token_per_tpu"),
    ({"policy_loss_fn": "grpo"}, None, "policy_loss_fn"),
])
def test_learner_refuses_when_built(fields, packing, field):
    """Refused by the learner's constructor, before any rollout (Tunix's own learner only
    reaches the loss inside the first jitted train step)."""
    algo_config = config(**{"policy_loss_fn": adapter.NAME, **fields})
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.GRPOLearner(cluster(packing), algo_config, _reward)


def test_learner_refuses_an_unregistered_actor_when_built():
    with pytest.raises(ValueError, match="_Unregistered.*ratiokl_grpo_logits"):
        adapter.GRPOLearner(cluster(model=_Unregistered()),
                            config(policy_loss_fn=adapter.NAME), _reward)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("packing", [None, 64])
def test_learner_built_trains_with_the_ratiokl_loss(loss, packing):
    """A mapped configuration builds (packed or not), and the actor trainer's loss is the
    selected one."""
    built = cluster(packing)
    algo_config = config(policy_loss_fn=loss, beta=0.04)
    learner = adapter.GRPOLearner(built, algo_config, _reward)
    model, batch = built.actor_trainer.model, example(True, True)
    got, _ = built.actor_trainer.loss_fn(model, batch, algo_config)
    want, _ = LOSSES[loss](model, batch, learner.algo_config, built.rollout.pad_id(),
                           built.rollout.eos_id())
    assert np.isfinite(float(want)) and float(got) == float(want)


def test_the_readmes_tunix_block_runs_here():
    """The README's Tunix block, as printed, in Tunix's environment (without TRL)."""
    block = block_importing("ratiokl.adapters.tunix")
    namespace = {}
    exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
    assert namespace["GRPOLearner"] is adapter.GRPOLearner
    assert function_registry.get_policy_loss_fn(
        namespace["algo_config"].policy_loss_fn) is adapter.grpo_loss_fn
