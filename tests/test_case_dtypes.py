"""Cases whose inputs carry their own dtype (``input_dtypes``): a float32 lm_head beside
bfloat16 hidden states, or the reverse. The case format stays what it was for every other
case; each input is rounded to, cast to and judged in its own dtype, and the linear ops'
gradient tolerances follow from the head's two dtypes (``ratiokl.spec.linear_grad_operand``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from ratiokl import harness, spec

LEAD, H, V = (2, 3), 8, 11
HEAD = {"weight": "float32", "bias": "float32"}


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return {"hidden": rng.normal(0.0, 1.0, (*LEAD, H)), "weight": rng.normal(0.0, 0.5, (V, H)),
            "bias": rng.normal(0.0, 1.0, V), "action_ids": rng.integers(0, V, LEAD),
            "mask": rng.random(LEAD) < 0.8}


def _case(input_dtypes=None, name: str = "mixed") -> harness.Case:
    rng = np.random.default_rng(1)
    cot = {"logp": rng.normal(size=LEAD), "entropy": rng.normal(size=LEAD)}
    return harness.build_case(name, "mixed", "linear_selected_logprobs_entropy", "bfloat16",
                              _inputs(), cotangents=cot, input_dtypes=input_dtypes)


def _exact_in(x: np.ndarray, dtype: str) -> bool:
    return bool(np.array_equal(harness.round_to_dtype(x, dtype), x))


def test_each_input_is_rounded_to_its_own_dtype_and_the_manifest_says_so(tmp_path) -> None:
    case = _case(HEAD)
    arrays = case.arrays
    assert _exact_in(arrays["hidden"], "bfloat16")
    assert not _exact_in(arrays["weight"], "bfloat16") and not _exact_in(arrays["bias"],
                                                                         "bfloat16")
    assert np.array_equal(arrays["weight"], _inputs()["weight"].astype(np.float32))
    assert [case.dtype_of(k) for k in ("hidden", "weight", "bias")] == [
        "bfloat16", "float32", "float32"]
    harness.write_fixtures([case, _case(name="plain")], tmp_path, generator="test")
    entries = json.loads((tmp_path / "manifest.json").read_text())["cases"]
    assert entries["mixed"]["input_dtypes"] == HEAD and "input_dtypes" not in entries["plain"]
    loaded = harness.load_case("mixed", tmp_path)
    assert loaded.input_dtypes == HEAD
    assert harness.TargetCall.of(loaded).dtype_of("weight") == "float32"


def test_a_case_of_one_dtype_is_written_as_before() -> None:
    """No ``input_dtypes`` key where every input has the case's dtype (an entry naming the
    case's own dtype is the same case): the committed fixtures' entries do not change."""
    assert "input_dtypes" not in _case().manifest_entry()
    same = _case({"weight": "bfloat16"})
    assert same.input_dtypes == {} and same.manifest_entry() == _case().manifest_entry()
    assert all(np.array_equal(same.arrays[k], _case().arrays[k]) for k in same.arrays)


@pytest.mark.parametrize("given, named", [({"mask": "float32"}, "'mask'"),
                                          ({"weight": "float64"}, "input_dtypes['weight']")])
def test_input_dtypes_outside_the_ops_logits_arguments_are_refused(given, named) -> None:
    with pytest.raises(ValueError, match="input_dtypes") as err:
        _case(given)
    assert named in str(err.value)


def test_the_gradient_tolerances_follow_the_heads_dtypes() -> None:
    """``d loss / d x`` of a mixed head is float32 (two bfloat16 pieces on a GPU), and each
    gradient is judged in its argument's dtype: d hidden as bfloat16, d weight as float32;
    a head of one dtype keeps the tolerances it had."""
    mixed, plain = _case(HEAD).tolerances, _case().tolerances
    u_bf16, u_split, u_fp32 = (spec.GRAD_ROUNDOFF[k] for k in ("bfloat16", "bf16x2",
                                                              "float32"))
    assert mixed["grad"].rtol == 2 * u_bf16 and mixed["grad_weight"].rtol == 2 * u_fp32
    assert mixed["grad_bias"].rtol == 2 * u_fp32 and plain["grad_weight"].rtol == 2 * u_bf16
    assert mixed["grad_weight"].atol < plain["grad_weight"].atol / 50
    assert spec.linear_grad_operand("bfloat16", "float32") == "bf16x2"
    assert spec.linear_grad_operand("float32", "bfloat16") == "bf16x2"
    assert spec.linear_grad_operand("float16", "float16") == "float16"
    one = spec.linear_grad_tolerance("bfloat16", 3.0, 2.0)
    assert spec.linear_grad_tolerance("bfloat16", 3.0, 2.0, stored="bfloat16") == one
    split = spec.linear_grad_tolerance("bf16x2", 3.0, 2.0, stored="bfloat16")
    assert split.rtol == one.rtol and split.atol < one.atol / 50
    assert u_split < u_bf16


def _perfect(case: harness.Case) -> harness.Outcome:
    """The expectations, each gradient rounded to and labelled with its argument's dtype."""
    grads = {k: harness.round_to_dtype(case.arrays[f"expected_grad{s}"], case.dtype_of(k))
             for k, s in (("hidden", ""), ("weight", "_weight"), ("bias", "_bias"))}
    outputs = {o: case.arrays[f"expected_{o}"].astype(np.float32) for o in case.spec.outputs}
    return harness.Outcome(outputs, {o: "float32" for o in outputs}, grads.pop("hidden"),
                           case.dtype_of("hidden"), extra_grads=grads,
                           extra_grad_dtypes={k: case.dtype_of(k) for k in grads})


@pytest.mark.parametrize("name", ["linear_fp32_weight_bf16", "linear_bf16_weight_fp32"])
def test_the_judge_wants_each_gradient_in_its_arguments_dtype(name) -> None:
    case = harness.load_case(name)
    assert harness.judge(case, _perfect(case)).passed
    for key in ("hidden", "weight"):
        outcome = _perfect(case)
        wrong = case.dtype if case.dtype_of(key) != case.dtype else case.input_dtypes["weight"]
        if key == "hidden":
            outcome.grad_dtype = wrong
        else:
            outcome.extra_grad_dtypes[key] = wrong
        check = harness.judge(case, outcome)
        assert not check.passed and f"expected {case.dtype_of(key)}" in check.failures[0], key


def test_a_head_rounded_to_the_hidden_states_dtype_fails_the_mixed_fixture() -> None:
    """The fixture pins the float32 weight down: the log-probs of its bfloat16 rounding
    (what a harness with one dtype per case computed) are far outside the tolerance."""
    case = harness.load_case("linear_fp32_weight_bf16")
    args = dict(case.arguments())
    args.update({k: harness.round_to_dtype(args[k], "bfloat16") for k in ("weight", "bias")})
    rounded = case.spec.reference(args)
    outcome = _perfect(case)
    outcome.outputs["logp"] = rounded["logp"].astype(np.float32)
    check = harness.judge(case, outcome)
    assert not check.passed and check.failures[0].startswith("logp: error is")
