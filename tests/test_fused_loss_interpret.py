"""The fused ``policy_loss`` kernel through Triton's CPU interpreter, one body per behaviour
run on both bindings (``torch-interpret``, ``jax-interpret``).

``backend="interpret"`` runs ``ratiokl._kernels.fused_loss`` (one pass per row: log-sum-exp,
objective, gradient) exactly as the GPU does. Each case is checked against the float64 spec
(``ratiokl.spec.policy_loss``) and against the framework's two-pass native path (loss, every
metric, the policy-logit gradient) across clip modes, KL variants, aggregations, packed rows,
bf16, garbage (NaN, bad ids) in inactive rows, upstream gradients of 1 (the device-side skip)
and not 1, the entropy bonus, rows in one tile or in spans of tiles; then all-inactive and
empty input, NaN inputs and unchecked bad ids on an active row, GSPO's two-pass fallback and
batch invariance (the cases: ``tests/helpers/fused_loss_cases.py``); which kernels the route
launches (the fused one for every option set but GSPO's, whose backward has an entropy term
only with a coefficient) and one program a row against programs meeting, bit for bit. What only one binding
has stays in ``tests/torch`` and ``tests/jax`` ``test_fused_loss_interpret.py``. Sizes are
small: the interpreter is slow.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytest.importorskip("triton")

from assertions import assert_close  # noqa: E402
from fused_loss_cases import (  # noqa: E402
    CASES, LOSS_TOL, SPEC_TOL, B, T, V, call, grad_tolerance, inputs, options,
)

from ratiokl import spec  # noqa: E402


def _framework(target: str) -> str:
    return target.split("-")[0]


def _spec(x: dict, case: dict):
    ref = None if case.get("ref") in ("none", "logps") else x["ref_logits"]
    rest = {k: v for k, v in x.items() if k not in ("policy_logits", "ref_logits", "action_ids",
                                                    "mask", "old_logps", "advantages")}
    args = (x["policy_logits"], ref, x["action_ids"], x["mask"], x["old_logps"],
            x["advantages"])
    value, metrics = spec.policy_loss(*args, **rest, **options(case))
    return value, metrics, spec.policy_loss_grad(*args, **rest, **options(case))


def _small_tiles(vocab, itemsize, n_rows, write_grad):
    """8-column tiles, two spans a row (V = 37: tiles 0-2, then 3 and the tail), one program."""
    from ratiokl._kernels import LaunchConfig, split_plan
    from ratiokl._kernels.heuristics import FusedPlan

    spans = split_plan(vocab, 8, 2)
    return FusedPlan(LaunchConfig(8, 1), spans, spans.splits)


def _small_tiles_meeting(vocab, itemsize, n_rows, write_grad):
    """As :func:`_small_tiles`, a program per span: the two meet at the row's counter."""
    return _small_tiles(vocab, itemsize, n_rows, write_grad)._replace(spans_per_program=1)


@pytest.mark.parametrize("tiles", ["one_tile", "spans_of_8_wide_tiles",
                                   "spans_of_8_wide_tiles_meeting"])
@pytest.mark.parametrize("name", list(CASES))
def test_fused_matches_spec_and_native(interpret_target, name, tiles, monkeypatch):
    """A row in one tile (the default here), or in spans of several tiles and a tail,
    taken by one program or by a program per span meeting at the row's counter."""
    fw = _framework(interpret_target)
    if tiles != "one_tile":
        small = _small_tiles_meeting if tiles.endswith("meeting") else _small_tiles
        monkeypatch.setattr(importlib.import_module(f"ratiokl.{fw}._launch.loss"), "launch_plan",
                            small)
        assert small(V, 4, B * T, True).spans == (2, 3)
    case = CASES[name]
    x = inputs(sum(map(ord, name)), case)
    upstream = 1.0 if name.startswith("ppo") else -2.5  # 1: the backward's device-side skip
    f_loss, f_metrics, fused = call(fw, x, case, "interpret", upstream)
    n_loss, n_metrics, native = call(fw, x, case, "native", upstream)
    e_loss, e_metrics, e_grad = _spec(x, case)
    assert_close(f_loss, n_loss, LOSS_TOL, "loss: fused vs native")
    assert_close(f_loss, e_loss, SPEC_TOL, "loss")
    for key, value in e_metrics.items():
        assert_close(f_metrics[key], n_metrics[key], LOSS_TOL, f"{key}: fused vs native")
        assert_close(f_metrics[key], value, SPEC_TOL, key)
    # Each within the spec's bound (bf16: stored once, and once more when scaled by upstream).
    grad_tol = grad_tolerance(case, upstream * e_grad)
    assert_close(fused, upstream * e_grad, grad_tol, "fused grad")
    assert_close(native, upstream * e_grad, grad_tol, "native grad")
    inactive = ~x["mask"]
    assert np.all(fused[inactive] == 0.0), "inactive rows must get exactly 0"
    assert np.all(np.isfinite(fused)), "masked (-inf) logits keep the gradient finite"
    assert np.isfinite(f_loss) and f_metrics["entropy_mean"] > 0


def test_all_inactive_gives_zero_loss_metrics_and_grad(interpret_target):
    case = dict(kl_coef=0.1)
    x = inputs(5, case)
    x["mask"][:] = False
    x["action_ids"][:] = -1
    value, metrics, grad = call(_framework(interpret_target), x, case, "interpret", 3.0)
    assert value == 0.0 and all(v == 0.0 for v in metrics.values())
    np.testing.assert_array_equal(grad, 0.0)


def test_empty_input(interpret_target):
    x = {"policy_logits": np.zeros((0, T, V), np.float32),
         "ref_logits": np.zeros((0, T, V), np.float32),
         "action_ids": np.zeros((0, T), np.int64), "mask": np.zeros((0, T), bool),
         "old_logps": np.zeros((0, T), np.float32), "advantages": np.zeros((0, T), np.float32)}
    value, _, grad = call(_framework(interpret_target), x, dict(ref="none"), "interpret", 1.0)
    assert value == 0.0 and grad.shape == (0, T, V)


@pytest.mark.parametrize("kl", [False, True], ids=["no_kl", "k3"])
def test_a_nan_input_on_an_active_row_is_nan_as_in_the_two_pass_path(interpret_target, kl):
    """NaN ``old_logps`` (or reference log-probs) on an active row makes the loss NaN,
    through ``log_ratio_bound`` too, on both paths; the other rows' gradients stay finite.

    (The bound was ``min(max(x, -b), b)``: on a GPU ``max.f32`` returns the non-NaN
    operand, so the poison vanished there, as it does in Triton >= 3.7's interpreter.)
    """
    case = dict(ref="logps", kl_coef=0.1 if kl else 0.0)
    x = inputs(31, case)
    x["ref_logps"] = x["old_logps"] + np.float32(0.1)
    x["ref_logps" if kl else "old_logps"][0, 0] = np.nan
    x["mask"][0, 0] = True
    others = np.ones((B, T), bool)
    others[0, 0] = False
    for backend in ("native", "interpret"):
        value, _, grad = call(_framework(interpret_target), x, case, backend, 1.0)
        assert np.isnan(value), backend
        assert np.all(np.isfinite(grad[others])), backend


def test_unchecked_bad_active_id_poisons_only_its_row(interpret_target):
    case = dict(ref="none", check_ids=False)
    x = inputs(9, case)
    x["action_ids"][0, 0] = V + 3
    value, _, grad = call(_framework(interpret_target), x, case, "interpret", 1.0)
    assert np.isnan(value)
    assert np.all(np.isnan(grad[0, 0]))
    others = np.ones((B, T), bool)
    others[0, 0] = False
    assert np.all(np.isfinite(grad[others]))


def test_gspo_falls_back_to_two_pass_and_matches_spec(interpret_target):
    case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean", kl_coef=0.1)
    x = inputs(11, case)
    f_loss, _, f_grad = call(_framework(interpret_target), x, case, "interpret", 1.0)
    e_loss, _, e_grad = _spec(x, case)
    assert_close(f_loss, e_loss, SPEC_TOL, "loss")
    assert_close(f_grad, e_grad, grad_tolerance(case, e_grad), "grad")


def test_a_rows_results_do_not_depend_on_the_batch(interpret_target):
    # w = 1: each row's gradient is its own (the entropy term's too).
    case = dict(kl_coef=0.1, loss_agg="token-sum", entropy_coef=0.1)
    x = inputs(17, case)
    fw = _framework(interpret_target)
    full = call(fw, x, case, "interpret", -1.5)
    part = call(fw, {k: v[:2] for k, v in x.items()}, case, "interpret", -1.5)
    np.testing.assert_array_equal(full[2][:2], part[2])


@pytest.mark.parametrize("given", ["[B]", "[B, 1]"])
def test_per_sequence_advantages_reach_the_kernel_as_given(interpret_target, given,
                                                          monkeypatch):
    """One advantage per sequence: the fused kernel reads the ``[B]`` values once per ``T``
    rows (``adv_rows = T``, no ``[N]`` copy), with the same bits as the same advantages
    given per token (read one per row)."""
    case = dict(kl_coef=0.1, entropy_coef=0.1)
    fw = _framework(interpret_target)
    x = inputs(23, case)
    seq = np.random.default_rng(23).normal(0.0, 1.0, (B,)).astype(np.float32)
    seen = _launches(monkeypatch)
    per_seq = call(fw, dict(x, advantages=seq if given == "[B]" else seq[:, None]), case,
                   "interpret", -1.5)
    per_token = call(fw, dict(x, advantages=np.repeat(seq[:, None], T, axis=1)), case,
                     "interpret", -1.5)
    fused = [args for name, args in seen if name == "policy_loss_kernel"]
    assert [(int(a["adv_rows"]), a["adv_ptr"].shape) for a in fused] == [(T, (B,)),
                                                                        (1, (B * T,))]
    assert per_seq[:2] == per_token[:2]
    np.testing.assert_array_equal(per_seq[2], per_token[2])


# --- the route's choices and the launch plans, seen in what the interpreter launches ----------


def _launches(monkeypatch) -> list:
    """``(kernel name, {parameter: argument})`` of every interpreter launch from here on, both
    bindings' (each launches a twin: ``twin[grid](...)`` runs ``Twin.run``). JAX launches
    when its computation runs: block on the results first."""
    from ratiokl._kernels import triton_compat

    seen = []
    real = triton_compat.Twin.run

    def run(self, *args, **kwargs):
        named = dict(zip(self.arg_names, args), **kwargs)
        seen.append((self.fn.__name__, named))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(triton_compat.Twin, "run", run)
    return seen


def _forward(fw: str, x: dict, case: dict, logits=None):
    """``(loss, metrics)`` of one call without a gradient (PyTorch: under ``no_grad``; JAX:
    no ``vjp``), as Python floats; a NumPy 0-d option becomes the framework's array."""
    xp = importlib.import_module("torch" if fw == "torch" else "jax.numpy")
    as_array = xp.from_numpy if fw == "torch" else xp.asarray
    t = {k: as_array(np.asarray(v)) for k, v in x.items()}
    ref = None if case.get("ref") in ("none", "logps") else t["ref_logits"]
    kwargs = {k: as_array(v) if isinstance(v, np.ndarray) else v
              for k, v in options(case).items()}
    rest = {k: v for k, v in t.items() if k not in (
        "policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages")}
    loss = importlib.import_module(f"ratiokl.{fw}.loss")
    grad_off = importlib.import_module("torch").no_grad() if fw == "torch" else (
        importlib.import_module("contextlib").nullcontext())
    with grad_off:
        value, metrics = loss.policy_loss(
            t["policy_logits"] if logits is None else logits, ref, t["action_ids"], t["mask"],
            t["old_logps"], t["advantages"], backend="interpret", **rest, **kwargs)
    return float(value), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("case, fuses", [
    (dict(kl_coef=0.1, dual_clip=2.0, kl_estimator="k3-is"), True),
    (dict(loss_agg="seq-mean-token-mean"), True),
    (dict(entropy_coef=0.01), True),
    (dict(entropy_coef=np.asarray(0.01, np.float32), objective="cispo"), True),
    (dict(ratio_level="sequence"), False),
    (dict(ratio_level="sequence", entropy_coef=0.01), False),
], ids=["kl-dual-clip", "seq-mean", "entropy", "tensor-entropy-cispo", "gspo", "gspo-entropy"])
def test_route_fuses_every_option_but_gspo(interpret_target, case, fuses, monkeypatch):
    """The fused kernel runs for every option set but GSPO's (``entropy_coef`` included);
    GSPO takes the log-prob kernels."""
    fw = _framework(interpret_target)
    case = dict(case, ref="logps")
    x = inputs(5, case)
    launches = _launches(monkeypatch)
    _forward(fw, x, case)
    kernels = {name for name, _ in launches}
    assert ("policy_loss_kernel" in kernels) == fuses, kernels
    assert ("logp_forward_kernel" in kernels or "logp_split_kernel" in kernels) != fuses, kernels


def test_two_pass_backward_has_an_entropy_term_only_with_a_coefficient(interpret_target,
                                                                         monkeypatch):
    """GSPO's two-pass route always computes the entropy (``entropy_mean``); nothing
    differentiates it without a coefficient, so its backward kernel has no entropy term."""
    fw = _framework(interpret_target)
    launches = _launches(monkeypatch)
    for coef in (0.0, 0.2):
        launches.clear()
        case = dict(ratio_level="sequence", loss_agg="seq-mean-token-mean", entropy_coef=coef)
        x = inputs(47, case)
        f_loss, f_metrics, f_grad = call(fw, x, case, "interpret", 1.0)
        e_loss, e_metrics, e_grad = _spec(x, case)
        flags = [bool(args["ENTROPY"]) for name, args in launches
                 if name == "logp_backward_kernel"]
        assert flags == [coef != 0.0], (coef, flags)
        assert_close(f_grad, e_grad, grad_tolerance(case, e_grad), "grad")
        assert_close(f_metrics["entropy_mean"], e_metrics["entropy_mean"], SPEC_TOL,
                     "entropy_mean")


@pytest.mark.parametrize("case", [dict(kl_coef=0.1), dict(ref="logps", kl_coef=0.1),
                                  dict(kl_coef=0.1, entropy_coef=0.05, masked=True)],
                         ids=["ref_logits", "ref_logps", "entropy_bonus_masked_vocab"])
def test_one_program_a_row_and_programs_meeting_give_the_same_bits(interpret_target, case,
                                                                   monkeypatch):
    """Spans of 8-wide tiles with a tail (V = 37): a program that owns its row folds every
    span in one loop; a program per span publishes and meets. The same partials reach the
    same combine: loss, metrics and gradient bit for bit, and the forward alone too."""
    fw = _framework(interpret_target)
    x = inputs(23, case)
    got = {}
    for plan in (_small_tiles, _small_tiles_meeting):
        monkeypatch.setattr(importlib.import_module(f"ratiokl.{fw}._launch.loss"), "launch_plan",
                            plan)
        got[plan] = call(fw, x, case, "interpret", -1.5), _forward(fw, x, case)
    (one, fwd_one), (meeting, fwd_meeting) = got[_small_tiles], got[_small_tiles_meeting]
    assert one[0] == meeting[0] and one[1] == meeting[1]
    np.testing.assert_array_equal(one[2], meeting[2])
    assert fwd_one[0] == one[0] == fwd_meeting[0]
    assert fwd_one[1] == one[1] == fwd_meeting[1]
