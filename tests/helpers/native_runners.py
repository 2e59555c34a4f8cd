"""``selected_logprobs`` and ``ratio_kl`` of either framework on NumPy inputs, for the tests
that run one body on both (``tests/test_native.py``).

Inputs are a dict of NumPy arrays (:func:`case`): logits exactly representable in their
dtype, ids, mask, old log-probs and two upstream cotangents. Each runner returns NumPy
arrays: the op's outputs as they come and the policy-logit gradient (as float32) after
checking it is in the logits' dtype.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from assertions import assert_close

from ratiokl import spec

DTYPES = ("float32", "float16", "bfloat16")


def _round(a: np.ndarray, dtype: str) -> np.ndarray:
    """``a`` rounded to ``dtype`` (float16 / bfloat16) and back to float32."""
    if dtype == "float32":
        return a.astype(np.float32)
    import ml_dtypes

    low = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    return a.astype(low).astype(np.float32)


def case(lead, dtype: str = "float32", vocab: int = 11, seed: int = 0, active: float = 0.7,
         scale: float = 3.0) -> dict:
    """Random inputs of leading shape ``lead`` (logits ``lead + (vocab,)``, scale 3)."""
    rng = np.random.default_rng(seed)
    return {
        "dtype": dtype,
        "policy": _round(rng.normal(scale=scale, size=(*lead, vocab)), dtype),
        "ref": _round(rng.normal(scale=scale, size=(*lead, vocab)), dtype),
        "ids": rng.integers(0, vocab, size=lead),
        "mask": rng.random(lead) < active,
        "old": (rng.normal(scale=2.0, size=lead) - 3.0).astype(np.float32),
        "g1": rng.normal(size=lead).astype(np.float32),
        "g2": rng.normal(size=lead).astype(np.float32),
    }


def _torch_args(c: dict, keys):
    import torch

    out = {k: torch.from_numpy(np.asarray(c[k])) for k in keys}
    if "policy" in out:
        out["policy"] = out["policy"].to(getattr(torch, c["dtype"])).requires_grad_()
    if "ref" in out:
        out["ref"] = out["ref"].to(getattr(torch, c["dtype"]))
    return out


def _jax_args(c: dict, keys):
    import jax.numpy as jnp

    out = {k: jnp.asarray(c[k]) for k in keys}
    for k in ("policy", "ref"):
        if k in out:
            out[k] = out[k].astype(c["dtype"])
    if "ids" in out:
        out["ids"] = out["ids"].astype(jnp.int32)
    return out


def _grad_out(grad, dtype: str) -> np.ndarray:
    assert str(grad.dtype).endswith(dtype), (grad.dtype, dtype)
    if hasattr(grad, "detach"):
        return grad.detach().float().numpy()
    return np.asarray(grad.astype("float32"))


def _array(framework: str, value):
    if value is None or isinstance(value, (float, int)):
        return value
    if framework == "torch":
        import torch

        return torch.from_numpy(np.asarray(value))
    import jax.numpy as jnp

    return jnp.asarray(value)


def selected_logprobs(framework: str, c: dict, *, temperature=1.0, backend: str = "native",
                      **kw):
    """``(logp, d(sum g1 * logp) / d policy)``."""
    keys = ("policy", "ids", "mask", "g1")
    temperature = _array(framework, temperature)
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        t = _torch_args(c, keys)
        logp = loss.selected_logprobs(t["policy"], t["ids"], t["mask"], temperature=temperature,
                                      backend=backend, **kw)
        (grad,) = torch.autograd.grad((logp * t["g1"]).sum(), t["policy"])
        return logp.detach().numpy(), _grad_out(grad, c["dtype"])
    import jax

    from ratiokl.jax import loss

    j = _jax_args(c, keys)
    logp, vjp = jax.vjp(lambda x: loss.selected_logprobs(
        x, j["ids"], j["mask"], temperature=temperature, backend=backend, **kw), j["policy"])
    (grad,) = vjp(j["g1"])
    return np.asarray(logp), _grad_out(grad, c["dtype"])


def ratio_kl(framework: str, c: dict, *, ref_logps: Optional[np.ndarray] = None,
             temperature=1.0, backend: str = "native", **kw):
    """``(ratio, kl, d(sum g1 * ratio + g2 * kl) / d policy)``; ``ref_logps``: instead of
    the reference logits."""
    keys = ("policy", "ref", "ids", "mask", "old", "g1", "g2")
    temperature, ref_logps = _array(framework, temperature), _array(framework, ref_logps)
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        t = _torch_args(c, keys)
        ratio, kl = loss.ratio_kl(t["policy"], None if ref_logps is not None else t["ref"],
                                  t["ids"], t["mask"], t["old"], ref_logps=ref_logps,
                                  temperature=temperature, backend=backend, **kw)
        (grad,) = torch.autograd.grad((ratio * t["g1"] + kl * t["g2"]).sum(), t["policy"])
        return ratio.detach().numpy(), kl.detach().numpy(), _grad_out(grad, c["dtype"])
    import jax

    from ratiokl.jax import loss

    j = _jax_args(c, keys)
    ref = None if ref_logps is not None else j["ref"]
    (ratio, kl), vjp = jax.vjp(lambda x: loss.ratio_kl(
        x, ref, j["ids"], j["mask"], j["old"], ref_logps=ref_logps, temperature=temperature,
        backend=backend, **kw), j["policy"])
    (grad,) = vjp((j["g1"], j["g2"]))
    return np.asarray(ratio), np.asarray(kl), _grad_out(grad, c["dtype"])


def logit_scale(logits: np.ndarray, temperature=1.0) -> float:
    """``max |logits / T|`` over the finite entries (at least 1)."""
    t = np.asarray(temperature, np.float64)
    z = np.abs(logits.astype(np.float64) / (t[..., None] if t.ndim else t))
    return float(np.max(z[np.isfinite(z)], initial=1.0))


def check_ratio_kl(framework: str, c: dict, *, kl_estimator: str = "k3", temperature=1.0,
                   ref_logps: Optional[np.ndarray] = None):
    """:func:`ratio_kl` against the float64 spec; returns its outputs."""
    ratio, kl, grad = ratio_kl(framework, c, ref_logps=ref_logps, temperature=temperature,
                               kl_estimator=kl_estimator)
    args = (c["policy"].astype(np.float64),
            None if ref_logps is not None else c["ref"].astype(np.float64), c["ids"],
            c["mask"], c["old"])
    opts = dict(kl_estimator=kl_estimator, temperature=temperature, ref_logps=ref_logps)
    want_ratio, want_kl = spec.ratio_kl(*args, **opts)
    want_grad = spec.ratio_kl_grad(*args, c["g1"], c["g2"], **opts)
    scale = logit_scale(c["policy"], temperature)
    assert ratio.dtype == kl.dtype == np.float32
    assert_close(ratio, want_ratio, spec.forward_tolerance(scale), "ratio")
    assert_close(kl, want_kl, spec.forward_tolerance(scale), "kl")
    gscale = float(np.max(np.abs(np.nan_to_num(want_grad)), initial=0.0))
    assert_close(grad, want_grad, spec.grad_tolerance(c["dtype"], scale, gscale), "grad")
    return ratio, kl, grad
