"""``ratiokl.jax.loss.policy_loss`` with the rollout correction: what only JAX has.

One trace when only values change; ``vmap``. Every mode against the spec, zero-weight and
inactive rows, all-inactive and empty batches on both frameworks:
``tests/test_rollout_loss.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from assertions import assert_close  # noqa: E402
from ratiokl import spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402
from rollout_test_cases import B, T, make_inputs  # noqa: E402

POSITIONAL = ("policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")


def _array(v):
    return jnp.asarray(v.astype(np.float32) if v.dtype.kind == "f" else v)


def test_one_trace_when_only_values_change() -> None:
    traces = []

    def fn(logits, rest, rollout):
        traces.append(1)
        return loss.policy_loss(logits, *rest, rollout_logps=rollout, check_ids=False,
                                rollout_correction="token-mask", rollout_bounds=(0.5, 5.0))[0]

    step = jax.jit(jax.grad(fn))
    for seed in (30, 31, 32):
        x = make_inputs(seed=seed)
        step(_array(x["policy_logits"]), [_array(x[k]) for k in POSITIONAL[1:]],
             _array(x["rollout_logps"]))
    assert len(traces) == 1


@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_vmap_over_a_batch_axis_matches_separate_calls(backend) -> None:
    """``"interpret"``: the one-launch weights map the framework ops under ``vmap``."""
    if backend == "interpret":
        pytest.importorskip("triton")
    xs = [make_inputs(seed=40 + i) for i in range(2)]
    static = dict(rollout_correction="sequence-truncate", rollout_bounds=(0.0, 1.3),
                  backend=backend)

    def fn(logits, ref, ids, mask, old, adv, rollout):
        return loss.policy_loss(logits, ref, ids, mask, old, adv, rollout_logps=rollout,
                                check_ids=False, **static)

    stacked = [jnp.stack([_array(x[k]) for x in xs])
               for k in POSITIONAL + ("rollout_logps",)]
    values, metrics = jax.vmap(fn)(*stacked)
    for i, x in enumerate(xs):
        value, single = fn(*[_array(x[k]) for k in POSITIONAL + ("rollout_logps",)])
        assert_close(values[i], value, spec.paths_tolerance(B * T), "loss")
        assert_close(metrics["rollout_k3"][i], single["rollout_k3"], spec.paths_tolerance(B * T),
                     "rollout_k3")
