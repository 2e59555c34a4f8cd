"""The native backend of both frameworks against the float64 spec, one body per behaviour
(``torch-native``, ``jax-native``).

``selected_logprobs`` and ``ratio_kl``: forward and gradient per logits dtype and leading
shape, each KL estimator, reference log-probs instead of logits, a NaN logit poisoning its
row only, out-of-range active ids named by position, errors that name the argument (each
way either framework's tests knew to get an argument of ``ratio_kl`` wrong), the gradient
reaching the policy logits only, integer masks. What only one framework has stays in
``tests/torch`` and ``tests/jax`` ``test_native.py`` (the runners:
``tests/helpers/native_runners.py``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from assertions import assert_close
from native_runners import (
    DTYPES, case, check_ratio_kl, logit_scale, ratio_kl, selected_logprobs,
)

from ratiokl import harness, spec

V = 11


def _framework(target: str) -> str:
    return harness.TARGETS[target].framework


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(13,), (3, 5), (2, 3, 4)], ids=["N", "BT", "BTK"])
def test_selected_logprobs_matches_spec(native_target, dtype, lead):
    c = case(lead, dtype, V)
    logp, grad = selected_logprobs(_framework(native_target), c, temperature=0.7)
    x = c["policy"].astype(np.float64)
    assert logp.dtype == np.float32 and logp.shape == lead
    scale = logit_scale(x, 0.7)
    want = spec.selected_logprobs(x, c["ids"], c["mask"], temperature=0.7)
    assert_close(logp, want, spec.forward_tolerance(scale), "logp")
    want_grad = spec.selected_logprobs_grad(x, c["ids"], c["mask"], c["g1"], temperature=0.7)
    tol = spec.grad_tolerance(dtype, scale, float(np.abs(want_grad).max()))
    assert_close(grad, want_grad, tol, "grad")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_ratio_kl_matches_spec(native_target, dtype, kl_estimator):
    check_ratio_kl(_framework(native_target), case((3, 5), dtype, V, seed=1),
                   kl_estimator=kl_estimator, temperature=0.9)


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_ref_logps_instead_of_ref_logits(native_target, kl_estimator):
    c = case((4, 6), vocab=V, seed=4)
    ref_logps = spec.selected_logprobs(c["ref"], c["ids"], c["mask"]).astype(np.float32)
    check_ratio_kl(_framework(native_target), c, kl_estimator=kl_estimator,
                   ref_logps=ref_logps)


def test_nan_logit_poisons_only_its_row(native_target):
    c = case((2, 6), vocab=V, seed=6, active=1.0)
    c["policy"][1, 2, 7] = np.nan
    ratio, kl, grad = check_ratio_kl(_framework(native_target), c)
    bad = np.zeros((2, 6), bool)
    bad[1, 2] = True
    assert np.isnan(ratio[bad]).all() and np.isnan(kl[bad]).all() and np.isnan(grad[bad]).all()
    assert np.isfinite(ratio[~bad]).all() and np.isfinite(kl[~bad]).all()
    assert np.isfinite(grad[~bad]).all()


@pytest.mark.parametrize("bad_id", [-1, V, 10**9])
def test_out_of_range_active_id_raises_naming_position(native_target, bad_id):
    c = case((3, 4), vocab=V, seed=8)
    c["ids"][1, 2], c["mask"][1, 2] = bad_id, True
    message = re.escape(f"action_ids[1, 2] = {bad_id} is outside [0, {V})")
    with pytest.raises(ValueError, match=message):
        ratio_kl(_framework(native_target), c)
    with pytest.raises(ValueError, match=message):
        selected_logprobs(_framework(native_target), c)


def _both(message: str) -> dict:
    return {"torch": message, "jax": message}


#: One argument of valid ``ratio_kl`` inputs replaced (``old_logps`` of int32 and of int64,
#: a list, ...), the error and what its message starts with, by framework where the
#: wording is the framework's own.
BAD_ARGS = [pytest.param(change, error, message if isinstance(message, dict) else
                         _both(message), id=name) for name, change, error, message in [
    ("policy-int32", {"policy": np.zeros((4, 6, V), np.int32)}, TypeError,
     "`policy_logits` must be float32, float16 or bfloat16 (or float64, on "
     "backend='native')"),
    ("policy-no-vocab", {"policy": np.zeros((4, 6, 0), np.float32)}, ValueError,
     "`policy_logits` must have shape"),
    ("ids-float", {"ids": np.zeros((4, 6), np.float32)}, TypeError,
     {"torch": "`action_ids` must be int64 or int32",
      "jax": "`action_ids` must be int32 or int64"}),
    ("ids-shape", {"ids": np.zeros((6, 4), np.int32)}, ValueError,
     "`action_ids` must have the logits' leading shape"),
    ("mask-float", {"mask": np.zeros((4, 6), np.float32)}, TypeError, "`mask` must be bool"),
    ("mask-1d", {"mask": np.ones((2,), bool)}, ValueError, "`mask` must have the logits'"),
    ("mask-rows", {"mask": np.ones((2, 6), bool)}, ValueError, "`mask` must have the logits'"),
    ("old-int32", {"old": np.zeros((4, 6), np.int32)}, TypeError,
     "`old_logps` must be a floating"),
    ("old-int64", {"old": np.zeros((4, 6), np.int64)}, TypeError,
     "`old_logps` must be a floating"),
    ("old-list", {"old": [0.0]}, TypeError,
     {"torch": "`old_logps` must be a torch.Tensor", "jax": "`old_logps` must be a jax.Array"}),
    ("ref-vocab", {"ref": np.zeros((4, 6, V + 1), np.float32)}, ValueError,
     "`ref_logits` must have the shape of `policy_logits`"),
    ("ref-lead", {"ref": np.zeros((4, 2, V), np.float32)}, ValueError,
     "`ref_logits` must have the shape of `policy_logits`"),
    ("ref-neither", {"ref": None}, ValueError, "pass exactly one of `ref_logits`"),
    ("ref-both", {"ref_logps": np.zeros((4, 6), np.float32)}, ValueError,
     "pass exactly one of `ref_logits` (reference-model logits [..., V]) and `ref_logps`"),
    ("temperature-zero", {"temperature": 0.0}, ValueError,
     "`temperature` must be a positive finite"),
    ("temperature-nan", {"temperature": float("nan")}, ValueError,
     "`temperature` must be a positive finite"),
    ("temperature-shape", {"temperature": np.ones((2,), np.float32)}, ValueError,
     "`temperature` must have the logits' leading shape"),
    ("temperature-str", {"temperature": "1"}, TypeError, "`temperature` must be a Python float"),
    ("kl_estimator", {"kl_estimator": "k4"}, ValueError, "`kl_estimator` must be one of"),
    ("backend-name", {"backend": "cuda"}, ValueError, "`backend` must be one of"),
    ("backend-triton-here", {"backend": "triton"}, ValueError,
     {"torch": "backend='triton' needs CUDA tensors", "jax": "backend='triton' needs a GPU"}),
    ("check_ids-int", {"check_ids": 1}, TypeError, "`check_ids` must be a Python bool"),
]]


@pytest.mark.parametrize("change, error, message", BAD_ARGS)
def test_validation_errors_name_the_argument(native_target, change, error, message):
    """PyTorch gets tensors, JAX the NumPy arrays as they are (its functions take them;
    ``jnp.asarray`` would make the float64 logits float32)."""
    fw = _framework(native_target)
    if fw == "jax" and change.get("backend") == "triton":
        import jax

        if jax.default_backend() == "gpu":
            pytest.skip("triton may run on a GPU")
    c = {**case((4, 6), vocab=V, seed=13), "backend": "native", **change}
    if fw == "torch":
        import torch

        from ratiokl.torch import loss

        c = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in c.items()}
    else:
        from ratiokl.jax import loss
    opts = {k: c[k] for k in ("ref_logps", "temperature", "kl_estimator", "backend",
                              "check_ids") if k in c}
    with pytest.raises(error, match=re.escape(message[fw])):
        loss.ratio_kl(c["policy"], c["ref"], c["ids"], c["mask"], c["old"], **opts)


def test_gradient_reaches_policy_logits_only(native_target):
    """No gradient reaches ``ref_logits``, ``old_logps``, ``ref_logps`` or a per-row
    ``temperature``: PyTorch's autograd gives none, JAX's gives exact zeros."""
    c = case((3, 4), vocab=V, seed=11)
    temperature = np.full((3, 4), 0.8, np.float32)
    ref_logps = (c["old"] - 0.1).astype(np.float32)
    if _framework(native_target) == "torch":
        import torch

        from ratiokl.torch import loss

        t = {k: torch.from_numpy(c[k]) for k in ("policy", "ref", "ids", "mask", "old")}
        policy, ref, old = (t[k].requires_grad_() for k in ("policy", "ref", "old"))
        temp, r_lp = (torch.from_numpy(a).requires_grad_() for a in (temperature, ref_logps))
        ratio, kl = loss.ratio_kl(policy, ref, t["ids"], t["mask"], old, temperature=temp)
        ratio2, kl2 = loss.ratio_kl(policy, None, t["ids"], t["mask"], old, ref_logps=r_lp)
        (ratio + kl + ratio2 + kl2).sum().backward()
        others = [ref.grad, old.grad, temp.grad, r_lp.grad]
        assert float(policy.grad.abs().sum()) > 0
        assert others == [None] * 4
        return
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    def total(policy, ref, old, temp, r_lp):
        ratio, kl = loss.ratio_kl(policy, ref, c["ids"], c["mask"], old, temperature=temp)
        ratio2, kl2 = loss.ratio_kl(policy, None, c["ids"], c["mask"], old, ref_logps=r_lp)
        return jnp.sum(ratio + kl + ratio2 + kl2)

    grads = jax.grad(total, argnums=(0, 1, 2, 3, 4))(c["policy"], c["ref"], c["old"],
                                                     temperature, ref_logps)
    assert float(jnp.abs(grads[0]).sum()) > 0
    assert all(np.all(np.asarray(g) == 0.0) for g in grads[1:])


def test_integer_mask_is_accepted(native_target):
    c = case((3, 4), vocab=V, seed=12)
    as_int = dict(c, mask=c["mask"].astype(np.int32))
    fw = _framework(native_target)
    for a, b in zip(ratio_kl(fw, c) + selected_logprobs(fw, c),
                    ratio_kl(fw, as_int) + selected_logprobs(fw, as_int)):
        np.testing.assert_array_equal(a, b)


def test_neg_inf_at_other_tokens_stays_finite(native_target):
    c = case((4, 6), vocab=V, seed=7, active=1.0)
    others = np.arange(V) != c["ids"][..., None]
    c["policy"] = np.where(others & (np.arange(V) % 3 == 0), -np.inf, c["policy"])
    ratio, kl, grad = check_ratio_kl(_framework(native_target), c)
    assert np.isfinite(ratio).all() and np.isfinite(kl).all() and np.isfinite(grad).all()


def test_check_ids_false_poisons_the_row_without_raising(native_target):
    c = case((3, 4), vocab=V, seed=9, active=1.0)
    c["ids"][1, 2] = V + 3
    fw = _framework(native_target)
    ratio, kl, grad = ratio_kl(fw, c, check_ids=False)
    logp, grad_logp = selected_logprobs(fw, c, check_ids=False)
    ok = np.ones((3, 4), bool)
    ok[1, 2] = False
    for out in (ratio, kl, logp, grad, grad_logp):
        assert np.isnan(out[1, 2]).all() and np.isfinite(out[ok]).all()
    args = [c[k][ok].astype(np.float64) for k in ("policy", "ref")]
    want_ratio, _ = spec.ratio_kl(*args, c["ids"][ok], c["mask"][ok], c["old"][ok])
    assert_close(ratio[ok], want_ratio, spec.forward_tolerance(logit_scale(c["policy"])))


@pytest.mark.parametrize("lead, active", [((0,), 0.7), ((2, 0), 0.7), ((3, 4), 0.0)],
                         ids=["empty", "empty_BT", "all_inactive"])
def test_empty_and_all_inactive(native_target, lead, active):
    c = case(lead, vocab=V, seed=10, active=active)
    ratio, kl, grad = check_ratio_kl(_framework(native_target), c)
    assert ratio.shape == kl.shape == lead and grad.shape == (*lead, V)
    assert np.all(ratio == 1.0) and np.all(kl == 0.0) and np.all(grad == 0.0)
