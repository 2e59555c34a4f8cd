"""Inputs and float64 expectations for the ops from hidden states, shared by both frameworks'
tests: small shapes (the interpreter is slow), NumPy arrays already rounded to the case's
dtype, and the spec's values, gradients and tolerances."""

from __future__ import annotations

import zlib
from typing import Any, Dict

import numpy as np

from ratiokl import spec
from ratiokl.harness import round_to_dtype

B, T, H, V = 3, 5, 16, 96  # 15 rows: chunk_rows=4 leaves a remainder of 3

#: Option sets: the logit options alone and together, a masked vocabulary (-inf bias) and a
#: per-row temperature.
CASES: Dict[str, Dict[str, Any]] = {
    "plain": {},
    "bias-scale": dict(bias="normal", logit_scale=0.5),
    "softcap-temperature-masked": dict(bias="masked", logit_softcap=2.0, temperature="rows",
                                       logit_scale=1.5),
}


def build(case: str, dtype: str = "float32", seed: int = 0) -> Dict[str, Any]:
    """``{hidden, weight, action_ids, mask, [bias], [temperature], options...}`` as NumPy
    (float32 values rounded to ``dtype``) plus the cotangents ``g_logp``, ``g_entropy``."""
    rng = np.random.default_rng([seed, zlib.crc32(case.encode())])
    opts = dict(CASES[case])
    out: Dict[str, Any] = {
        "hidden": round_to_dtype(rng.standard_normal((B, T, H)), dtype),
        "weight": round_to_dtype(rng.standard_normal((V, H)) * 0.3, dtype),
        "action_ids": rng.integers(0, V, (B, T)),
        "mask": rng.random((B, T)) > 0.3,
        "g_logp": rng.standard_normal((B, T)).astype(np.float32),
        "g_entropy": rng.standard_normal((B, T)).astype(np.float32),
    }
    bias = opts.pop("bias", None)
    if bias is not None:
        b = rng.standard_normal(V) * 0.5
        if bias == "masked":  # a third of the vocabulary masked, never the sampled tokens
            drop = rng.random(V) < 0.3
            drop[out["action_ids"].reshape(-1)] = False
            b[drop] = -np.inf
        out["bias"] = round_to_dtype(b, dtype)
    if opts.pop("temperature", None) == "rows":
        out["temperature"] = rng.uniform(0.5, 2.0, (B, T)).astype(np.float32)
    out.update(opts)
    return out


def poisoned(x: Dict[str, Any]) -> Dict[str, Any]:
    """``x`` with NaN / inf hidden states and out-of-range ids on its inactive rows."""
    dirty = dict(x, hidden=x["hidden"].copy(), action_ids=x["action_ids"].copy())
    inactive = np.argwhere(~x["mask"])
    for n, row in enumerate(map(tuple, inactive)):
        dirty["hidden"][row] = (np.nan, np.inf, -np.inf)[n % 3]
        dirty["action_ids"][row] = (-1, V, V + 7)[n % 3]
    return dirty


_SPEC_KW = ("bias", "temperature", "logit_scale", "logit_softcap")


def expected(x: Dict[str, Any], dtype: str = "float32",
             entropy: bool = True) -> Dict[str, Any]:
    """The spec's ``logp``, ``entropy``, ``d hidden``, ``d weight``, ``d bias`` (of
    ``sum(g_logp logp + g_entropy entropy)``; without ``entropy`` of ``sum(g_logp logp)``)
    and a tolerance for each (``tol_<name>``)."""
    kw = {k: x[k] for k in _SPEC_KW if k in x}
    args = (x["hidden"], x["weight"], x["action_ids"], x["mask"])
    logp, ent = spec.linear_selected_logprobs(*args, return_entropy=True, **kw)
    cot = (x["g_logp"], x["g_entropy"] if entropy else None)
    grads = spec.linear_selected_logprobs_grad(*args, *cot, **kw)
    magnitudes = spec.linear_grad_magnitudes(*args, *cot, **kw)
    scale = _logit_scale(x, kw)
    out = {"logp": logp, "entropy": ent,
           "tol_logp": spec.linear_forward_tolerance(dtype, scale, V),
           "tol_entropy": spec.linear_forward_tolerance(dtype, scale, V, entropy=True)}
    for name, grad, magnitude in zip(("hidden", "weight", "bias"), grads, magnitudes):
        out[f"d_{name}"] = grad
        out[f"tol_d_{name}"] = None if magnitude is None else spec.linear_grad_tolerance(
            dtype, scale, magnitude)
    return out


def _logit_scale(x: Dict[str, Any], kw: Dict[str, Any]) -> float:
    """``max |x / T|`` over active rows' finite logits."""
    mask = x["mask"]
    logits = spec.linear_logits(np.where(mask[..., None], x["hidden"], 0.0), x["weight"],
                                kw.get("bias"), logit_scale=kw.get("logit_scale", 1.0),
                                logit_softcap=kw.get("logit_softcap"))
    temp = np.broadcast_to(np.asarray(kw.get("temperature", 1.0)), mask.shape)
    z = np.abs(logits[mask] / temp[mask][:, None])
    return float(z[np.isfinite(z)].max(initial=0.0))


def options(x: Dict[str, Any]) -> Dict[str, Any]:
    """The scalar options of ``x`` (``logit_scale``, ``logit_softcap``)."""
    return {k: x[k] for k in ("logit_scale", "logit_softcap") if k in x}
