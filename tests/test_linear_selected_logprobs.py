"""``linear_selected_logprobs`` of both frameworks, one body per behaviour on each target
that runs without a GPU (native and Triton's CPU interpreter; JAX under ``jit``).

Values and the three gradients (the entropy's own included) against the float64 spec
(``ratiokl.spec.linear_selected_logprobs`` / ``_grad``) with its tolerances, ``chunk_rows``
leaving a remainder; bf16 without the entropy in one-row chunks; garbage on inactive rows
leaving every other value and gradient bitwise unchanged; errors that name the argument.
What only one framework has stays in ``tests/torch`` and ``tests/jax``
``test_linear_selected_logprobs.py`` (the cases and the runner:
``tests/helpers/linear_cases.py``). Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from assertions import assert_close
from linear_cases import CASES, B, H, T, V, build, expected, poisoned, run

from ratiokl import harness


def _run(target, x, *args, **kw):
    t = harness.TARGETS[target]
    return run(t.framework, x, t.backend, *args, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_values_and_gradients_match_the_spec(cpu_target, case):
    x = build(case)
    want = expected(x)
    logp, ent, dh, dw, db = _run(cpu_target, x)
    assert logp.shape == (B, T)
    assert_close(logp, want["logp"], want["tol_logp"], "logp")
    assert_close(ent, want["entropy"], want["tol_entropy"], "entropy")
    assert_close(dh, want["d_hidden"], want["tol_d_hidden"], "d hidden")
    assert_close(dw, want["d_weight"], want["tol_d_weight"], "d weight")
    if "bias" in x:
        assert_close(db, want["d_bias"], want["tol_d_bias"], "d bias")


def test_bf16_without_entropy_and_one_row_chunks(cpu_target):
    x = build("softcap-temperature-masked", "bfloat16", seed=1)
    want = expected(x, "bfloat16", entropy=False)
    logp, ent, dh, dw, db = _run(cpu_target, x, "bfloat16", chunk_rows=1, entropy=False)
    assert ent is None
    assert_close(logp, want["logp"], want["tol_logp"], "logp")
    for name, got in (("hidden", dh), ("weight", dw), ("bias", db)):
        assert_close(got, want[f"d_{name}"], want[f"tol_d_{name}"], f"d {name}")


def test_inactive_rows_hold_garbage(cpu_target):
    """NaN / inf hidden states and bad ids on inactive rows: every output, ``d weight``,
    ``d bias`` and the active rows' ``d hidden`` bitwise as with clean rows; the inactive
    rows' ``d hidden`` exactly 0 and their outputs neutral."""
    x = build("softcap-temperature-masked", seed=2)
    clean = _run(cpu_target, x)
    dirty = _run(cpu_target, poisoned(x))
    mask = x["mask"]
    for a, b in zip(clean, dirty):
        if a.shape[:2] == (B, T):
            a, b = a[mask], b[mask]
        np.testing.assert_array_equal(a, b)
    assert not dirty[2][~mask].any() and not dirty[0][~mask].any() and not dirty[1][~mask].any()
    assert np.isfinite(dirty[3]).all() and np.isfinite(dirty[4]).all()


#: (what to change, the error's type, what it names); ``("zeros", shape, dtype)`` is an
#: array of the framework; ``"bad-id"``: an active row's id out of ``[0, V)``.
BAD = [
    (dict(weight=("zeros", (V, H + 1), "float32")), ValueError, "weight"),
    (dict(bias=("zeros", (V + 1,), "float32")), ValueError, "bias"),
    (dict(bias=("zeros", (V,), "bfloat16")), TypeError, "bias"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(logit_scale=-2.0), ValueError, "logit_scale"),
    (dict(logit_scale=True), (ValueError, TypeError), "logit_scale"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=0.0), ValueError, "logit_softcap"),
    (dict(logit_softcap=float("inf")), ValueError, "logit_softcap"),
    (dict(chunk_rows=0), ValueError, "chunk_rows"),
    (dict(action_ids="bad-id"), ValueError, "action_ids"),
]


@pytest.mark.parametrize("bad, error, match", BAD,
                         ids=[f"{next(iter(b))}-{i}" for i, (b, _, _) in enumerate(BAD)])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_errors_name_the_argument(framework, bad, error, match):
    """On the native backend (what ``"auto"`` picks without a GPU)."""
    xp = pytest.importorskip("torch" if framework == "torch" else "jax.numpy")
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    x = build("plain", seed=8)
    if bad.get("action_ids") == "bad-id":
        x["action_ids"][0, 0], x["mask"][0, 0] = V, True
        bad = {}
    as_array = xp.tensor if framework == "torch" else xp.asarray
    kw = dict(weight=as_array(x["weight"]), backend="native")
    for name, value in bad.items():
        kw[name] = (xp.zeros(value[1], dtype=getattr(xp, value[2])) if isinstance(value, tuple)
                    else value)
    with pytest.raises(error, match=match):
        loss.linear_selected_logprobs(as_array(x["hidden"]), kw.pop("weight"),
                                      as_array(x["action_ids"]), as_array(x["mask"]), **kw)
