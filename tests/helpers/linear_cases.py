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


def run(framework: str, x: Dict[str, Any], backend: str, dtype: str = "float32",
        chunk_rows: int = 4, entropy: bool = True, weight_dtype: str = None, **head: Any):
    """``(logp, entropy | None, d hidden, d weight, d bias | None)`` of one
    ``linear_selected_logprobs`` call of ``framework`` (JAX under ``jit``) and its backward
    with the case's cotangents, as NumPy (the gradients as float32 after checking they are
    in their inputs' dtypes: ``dtype``, the weight and bias ``weight_dtype`` when given);
    ``head``: more keywords (``logits_dtype``, ``fp32_matmul``)."""
    wdt = weight_dtype or dtype
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        dt, wt = getattr(torch, dtype), getattr(torch, wdt)
        h = torch.tensor(x["hidden"]).to(dt).requires_grad_()
        w = torch.tensor(x["weight"]).to(wt).requires_grad_()
        b = torch.tensor(x["bias"]).to(wt).requires_grad_() if "bias" in x else None
        temp = torch.tensor(x["temperature"]) if "temperature" in x else 1.0
        out = loss.linear_selected_logprobs(
            h, w, torch.tensor(x["action_ids"]), torch.tensor(x["mask"]), bias=b,
            temperature=temp, return_entropy=entropy, chunk_rows=chunk_rows, backend=backend,
            **options(x), **head)
        logp, ent = out if entropy else (out, None)
        total = (logp * torch.tensor(x["g_logp"])).sum()
        if entropy:
            total = total + (ent * torch.tensor(x["g_entropy"])).sum()
        total.backward()
        outs = (logp, ent, h.grad, w.grad, None if b is None else b.grad)
    else:
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import loss

        kinds = {"hidden": dtype, "weight": wdt, "bias": wdt, "temperature": "float32"}
        arrays = {k: jnp.asarray(x[k]).astype(kinds[k]) for k in kinds if k in x}
        ids, mask = jnp.asarray(x["action_ids"]), jnp.asarray(x["mask"])
        g_logp, g_ent = jnp.asarray(x["g_logp"]), jnp.asarray(x["g_entropy"])

        def objective(arrays):
            out = loss.linear_selected_logprobs(
                arrays["hidden"], arrays["weight"], ids, mask, bias=arrays.get("bias"),
                temperature=arrays.get("temperature", 1.0), return_entropy=entropy,
                chunk_rows=chunk_rows, backend=backend, check_ids=False, **options(x), **head)
            logp, ent = out if entropy else (out, None)
            total = jnp.sum(logp * g_logp) + (jnp.sum(ent * g_ent) if entropy else 0.0)
            return total, (logp, ent)

        (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(arrays)
        outs = (logp, ent, grads["hidden"], grads["weight"], grads.get("bias"))
    for value in outs[:2]:
        assert value is None or str(value.dtype).endswith("float32")
    for grad, want in zip(outs[2:], (dtype, wdt, wdt)):
        assert grad is None or str(grad.dtype).endswith(want)
    return tuple(None if a is None else _numpy(a) for a in outs)


def _numpy(a) -> np.ndarray:
    if hasattr(a, "detach"):
        return a.detach().float().numpy()
    return np.asarray(a.astype("float32"))
