"""One GRPO training step through Tunix's own ``GRPOLearner.train`` with the adapter.

Two runs from the same weights and the same seeded rollout (Tunix's vanilla sampler on
its toy transformer and mock tokenizer): Tunix's learner with its own ``"grpo"`` loss,
and ``ratiokl.adapters.tunix.GRPOLearner`` with ``"ratiokl_grpo"`` (hidden states and the
lm_head). Tunix's code does everything else (rollout, rewards, advantages, reference
and old log-probs, packing, the jitted train step, the optimizer). After the step every
parameter's update must agree. Packed rows (``max_seq_token_per_tpu``) run with
``token-mean``, the aggregation on which Tunix's packed loss and the adapter's agree.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("tunix")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.tests import test_common  # noqa: E402
from assertions import assert_close, two_paths  # noqa: E402
from tunix_batches import cluster, config, example, logit_scale, toy_model  # noqa: E402

from ratiokl.adapters import tunix as adapter  # noqa: E402
from ratiokl.spec import linear_grad_tolerance, update_tolerance  # noqa: E402


def _reward(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def _trained(learner_type, loss, packing, fields):
    vocab = test_common.MockVocab().GetPieceSize()  # sampled ids stay decodable
    built = cluster(packing, model=toy_model(vocab=vocab), reference=toy_model(vocab=vocab),
                    seed=3)
    learner = learner_type(built, config(policy_loss_fn=loss, beta=0.04, **fields), _reward)
    before = nnx.state(built.actor_trainer.model, nnx.Param)
    before = jax.tree_util.tree_map(jnp.copy, before)
    learner.train([{"prompts": np.array(["input string", "hello world"])}])
    assert built.actor_trainer.train_steps == 1
    return before, nnx.state(built.actor_trainer.model, nnx.Param)


@pytest.mark.parametrize("packing, fields", [
    (None, {}), (64, {"loss_agg_mode": "token-mean"})])
def test_one_train_step_matches_tunix(packing, fields):
    start, want = _trained(grpo_learner.GRPOLearner, "grpo", packing, fields)
    _, got = _trained(adapter.GRPOLearner, adapter.NAME, packing, fields)
    start = dict(jax.tree_util.tree_leaves_with_path(start))
    got = dict(jax.tree_util.tree_leaves_with_path(got))
    steps = {path: (w - start[path], got[path] - start[path])
             for path, w in jax.tree_util.tree_leaves_with_path(want)}
    assert max(float(jnp.max(jnp.abs(w))) for w, _ in steps.values()) > 1e-4  # a step
    # The toy model's logit scale on the hand-made batch (the rollout's stays in the learner).
    vocab = test_common.MockVocab().GetPieceSize()
    scale = logit_scale(toy_model(vocab=vocab), example(False, False, vocab=vocab),
                        config().temperature)
    for path, (w, g) in steps.items():  # each parameter's update, Tunix's and the adapter's
        # SGD: the update is the gradient's, scaled; then each side rounds the parameter.
        step = two_paths(linear_grad_tolerance("float32", scale, float(jnp.max(jnp.abs(w)))))
        after = float(jnp.max(jnp.abs(start[path] + w)))
        assert_close(g, w, update_tolerance(step, after), jax.tree_util.keystr(path))
