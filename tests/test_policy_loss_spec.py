"""``policy_loss`` against the float64 spec (``ratiokl.spec.policy_loss``), one body per
behaviour run for both frameworks (native backend).

Each option's loss, metrics and policy-logit gradient on inputs whose inactive rows hold NaN
logits, NaN old log-probs / advantages / weights and out-of-range ids; packed rows;
per-token advantages; float16 / bfloat16 logits (the gradient in their dtype). The
framework-only behaviours stay in ``tests/torch/test_policy_loss.py`` and
``tests/jax/test_policy_loss.py``.
"""

from __future__ import annotations

import pytest

from policy_runners import assert_matches_spec, run_jax, run_torch
from policy_test_cases import OPTIONS, PACKED, make_inputs

FRAMEWORKS = ["torch", "jax"]


def _run(framework, x, options, **kw):
    pytest.importorskip(framework)
    return (run_torch if framework == "torch" else run_jax)(x, options, **kw)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_matches_spec(framework, name):
    x = make_inputs(seed=len(name))
    keys = ("importance_weights",) if name == "ppo_default" else ()
    assert_matches_spec(*_run(framework, x, OPTIONS[name], keys=keys))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(PACKED))
def test_packed_rows_match_spec(framework, name):
    x = make_inputs(seed=5, active=0.9)
    assert_matches_spec(*_run(framework, x, PACKED[name], keys=("segment_ids",)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_per_token_advantages_with_nan_on_inactive_rows(framework):
    x = make_inputs(seed=3, per_token_adv=True)
    options = {"dual_clip": 2.0, "kl_coef": 0.1}
    assert_matches_spec(*_run(framework, x, options, keys=("importance_weights",)))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_logits(framework, dtype):
    x = make_inputs(seed=6)
    assert_matches_spec(*_run(framework, x, {"kl_coef": 0.1}, dtype=dtype), dtype)
