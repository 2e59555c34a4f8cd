"""NaN / inf sweep of ``linear_policy_loss`` (issue 34): a non-finite hidden state or per-token
input on one active token, on every backend of both frameworks, is as visible as the
float64 spec makes it, and no other token's hidden gradient moves.

The expectation is ``ratiokl.spec.policy_loss`` on the float64 logits ``hidden @ weight.T``
(inactive rows' hidden states zeroed first), with ``d hidden = G @ weight`` and ``d weight =
G.T @ hidden`` from its logit gradient ``G``. Judged as ``test_nonfinite_sweep.py`` judges:
the loss and metrics exactly (NaN where the spec has NaN, equal infinities, finite values
within the spec's tolerance); the gradients row by row (a row finite in the spec is finite
and close; one with NaN has NaN; one with only infinities is non-finite). Chunks of 3 rows:
the poisoned token shares its chunk with others.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

from ratiokl import spec
from ratiokl.harness import Check, compare_close

B, T, H, V = 2, 4, 6, 12
ROW = (0, 1)
MASK = np.array([[True, True, False, True], [True, True, True, False]])
OPTIONS = dict(kl_coef=0.1, entropy_coef=0.2, rollout_correction="token-truncate")
POISONS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
INPUTS = ("hidden", "old_logps", "advantages", "ref_logps", "rollout_logps")
PER_TOKEN = ("old_logps", "advantages", "ref_logps", "rollout_logps")


def _inputs() -> Dict[str, np.ndarray]:
    """Clean inputs; inactive tokens hold NaN hidden states and values, and bad ids."""
    rng = np.random.default_rng(34)
    x = {"hidden": rng.normal(0.0, 1.0, (B, T, H)), "weight": rng.normal(0.0, 0.5, (V, H)),
         "action_ids": np.where(MASK, rng.integers(0, V, (B, T)), -1), "mask": MASK}
    logp = spec.selected_logprobs(np.where(MASK[..., None], x["hidden"], 0.0) @ x["weight"].T,
                                  x["action_ids"], MASK)
    x["old_logps"] = logp + rng.normal(0.0, 0.3, (B, T))
    x["ref_logps"] = logp + rng.normal(0.0, 0.5, (B, T))
    x["rollout_logps"] = x["old_logps"] + rng.normal(0.0, 0.2, (B, T))
    x["advantages"] = rng.normal(0.0, 1.0, (B, T))
    for key in ("hidden",) + PER_TOKEN:
        x[key][~MASK] = np.nan
    return x


def _spec(x) -> Tuple[Dict[str, float], np.ndarray, np.ndarray]:
    """``(loss and metrics, d hidden, d weight)`` in float64."""
    hidden = np.where(MASK[..., None], x["hidden"], 0.0)
    args = (hidden @ x["weight"].T, None, x["action_ids"], MASK, x["old_logps"],
            x["advantages"])
    kw = dict(OPTIONS, ref_logps=x["ref_logps"], rollout_logps=x["rollout_logps"])
    with np.errstate(invalid="ignore", over="ignore"):
        value, metrics = spec.policy_loss(*args, **kw)
        g = spec.policy_loss_grad(*args, **kw)
        return {"loss": value, **metrics}, g @ x["weight"], np.einsum("btv,bth->vh", g, hidden)


def _torch(backend: str, x) -> Tuple[Dict[str, Any], Any, Any]:
    import torch

    from ratiokl.torch import loss

    device = "cuda" if backend == "triton" else "cpu"
    tensor = {k: torch.tensor(v, device=device, dtype=torch.bool if k == "mask" else (
        torch.int64 if k == "action_ids" else torch.float32)) for k, v in x.items()}
    hidden = tensor["hidden"].requires_grad_()
    weight = tensor["weight"].requires_grad_()
    value, metrics = loss.linear_policy_loss(
        hidden, weight, tensor["action_ids"], tensor["mask"], tensor["old_logps"],
        tensor["advantages"], ref_logps=tensor["ref_logps"],
        rollout_logps=tensor["rollout_logps"], chunk_rows=3, backend=backend,
        check_ids=False, **OPTIONS)
    value.backward()
    return {"loss": value, **metrics}, hidden.grad, weight.grad


@functools.lru_cache(maxsize=None)
def _jax_step(backend: str):
    import jax

    from ratiokl.jax import loss

    def value(hidden, weight, x):
        out, metrics = loss.linear_policy_loss(
            hidden, weight, x["action_ids"], x["mask"], x["old_logps"], x["advantages"],
            ref_logps=x["ref_logps"], rollout_logps=x["rollout_logps"], chunk_rows=3,
            backend=backend, **OPTIONS)
        return out, metrics

    return jax.jit(jax.value_and_grad(value, argnums=(0, 1), has_aux=True))


def _jax(backend: str, x) -> Tuple[Dict[str, Any], Any, Any]:
    import jax.numpy as jnp

    arrays = {k: jnp.asarray(v if k == "mask" else v.astype(
        np.int32 if k == "action_ids" else np.float32)) for k, v in x.items()}
    hidden, weight = arrays.pop("hidden"), arrays.pop("weight")
    (value, metrics), (d_hidden, d_weight) = _jax_step(backend)(hidden, weight, arrays)
    return {"loss": value, **metrics}, d_hidden, d_weight


def _run(target: str, x) -> Tuple[Dict[str, np.ndarray], np.ndarray, np.ndarray]:
    framework, backend = target.split("-")
    outputs, d_hidden, d_weight = (_torch if framework == "torch" else _jax)(backend, x)
    as_np = lambda a: np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, np.float64)
    return {k: as_np(v) for k, v in outputs.items()}, as_np(d_hidden), as_np(d_weight)


def _rows(check: Check, what: str, got: np.ndarray, want: np.ndarray, tol) -> None:
    """Row by row (last axis): finite rows close, NaN rows with NaN, inf rows non-finite."""
    finite = np.isfinite(want).all(axis=-1)
    compare_close(check, what, got[finite], want[finite], tol)
    for row in map(tuple, np.argwhere(~finite)):
        if np.isnan(want[row]).any() and not np.isnan(got[row]).any():
            check.fail(f"{what}{list(row)}: no NaN where the spec has NaN: {got[row]}")
        elif np.isfinite(got[row]).all():
            check.fail(f"{what}{list(row)}: finite where the spec is not: {got[row]}")


@functools.lru_cache(maxsize=None)
def _clean(target: str):
    return _run(target, _inputs())


PARAMS = [pytest.param(k, p, id=f"{k}-{p}") for k in INPUTS for p in POISONS]


@pytest.mark.parametrize("key,poison", PARAMS)
def test_poisoned_active_token(target: str, key: str, poison: str) -> None:
    x = _inputs()
    x[key][ROW + ((2,) if key == "hidden" else ())] = POISONS[poison]
    want, want_dh, want_dw = _spec(x)
    got, dh, dw = _run(target, x)
    z = np.abs(np.where(MASK[..., None], _inputs()["hidden"], 0.0) @ _inputs()["weight"].T)
    fwd = spec.forward_tolerance(float(z.max()))
    check = Check()
    for name, value in want.items():
        compare_close(check, name, got[name], np.float64(value), fwd)
    for what, g, w in (("d hidden", dh, want_dh), ("d weight", dw, want_dw)):
        finite = np.abs(w[np.isfinite(w)])
        _rows(check, what, g, w, spec.grad_tolerance("float32", float(z.max()),
                                                     float(finite.max()) if finite.size else 0))
    failures: List[str] = list(check.failures)
    # Other tokens' hidden gradients are bitwise those of the unpoisoned run.
    _, clean_dh, _ = _clean(target)
    keep = np.ones(MASK.shape, dtype=bool)
    keep[ROW] = False
    bits = lambda a: a[keep].astype(np.float32).view(np.uint32)
    if not np.array_equal(bits(dh), bits(clean_dh)):
        failures.append("d hidden changed on tokens the poison does not reach")
    assert not failures, f"{target}: {poison} in {key}: " + "; ".join(failures)


# --- linear_selected_logprobs: a NaN / +-inf hidden state on an active token -------------------


def _logprobs(target: str, x) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(logp, entropy, d hidden)`` of ``linear_selected_logprobs(return_entropy=True)`` with
    the upstream gradients 1 (logp) and 0.5 (entropy), chunks of 3 rows."""
    framework, backend = target.split("-")
    if framework == "torch":
        import torch

        from ratiokl.torch import loss

        device = "cuda" if backend == "triton" else "cpu"
        hidden = torch.tensor(x["hidden"], device=device, dtype=torch.float32,
                              requires_grad=True)
        weight = torch.tensor(x["weight"], device=device, dtype=torch.float32)
        logp, ent = loss.linear_selected_logprobs(
            hidden, weight, torch.tensor(x["action_ids"], device=device),
            torch.tensor(MASK, device=device), return_entropy=True, chunk_rows=3,
            backend=backend, check_ids=False)
        (logp.sum() + 0.5 * ent.sum()).backward()
        return tuple(np.asarray(a.detach().cpu(), np.float64) for a in (logp, ent, hidden.grad))
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    def value(hidden):
        logp, ent = loss.linear_selected_logprobs(
            hidden, jnp.asarray(x["weight"], jnp.float32), jnp.asarray(x["action_ids"]),
            jnp.asarray(MASK), return_entropy=True, chunk_rows=3, backend=backend,
            check_ids=False)
        return jnp.sum(logp) + 0.5 * jnp.sum(ent), (logp, ent)

    (_, (logp, ent)), d_hidden = jax.jit(jax.value_and_grad(value, has_aux=True))(
        jnp.asarray(x["hidden"], jnp.float32))
    return tuple(np.asarray(a, np.float64) for a in (logp, ent, d_hidden))


@pytest.mark.parametrize("poison", list(POISONS))
def test_linear_logprobs_poisoned_hidden(target: str, poison: str) -> None:
    """The poisoned token's logp, entropy and d hidden are exactly as non-finite as the spec
    makes them; every other token's outputs and d hidden are bitwise the clean run's."""
    clean = _inputs()
    x = _inputs()
    x["hidden"][ROW + (2,)] = POISONS[poison]
    with np.errstate(invalid="ignore", over="ignore"):
        args = (np.where(MASK[..., None], x["hidden"], 0.0), x["weight"], x["action_ids"], MASK)
        want_logp, want_ent = spec.linear_selected_logprobs(*args, return_entropy=True)
        want_dh, _, _ = spec.linear_selected_logprobs_grad(*args, np.ones(MASK.shape),
                                                           np.full(MASK.shape, 0.5))
    got = _logprobs(target, x)
    base = _logprobs(target, clean)
    failures = []
    for what, g, w in (("logp", got[0], want_logp), ("entropy", got[1], want_ent)):
        if not np.array_equal(np.isnan(g[ROW]), np.isnan(w[ROW])):
            failures.append(f"{what}: NaN {g[ROW]} where the spec has {w[ROW]}")
    if np.isnan(want_dh[ROW]).any() and not np.isnan(got[2][ROW]).any():
        failures.append(f"d hidden: no NaN where the spec has NaN: {got[2][ROW]}")
    keep = np.ones(MASK.shape, dtype=bool)
    keep[ROW] = False
    bits = lambda a: a[keep].astype(np.float32).view(np.uint32)  # noqa: E731
    for what, g, b in zip(("logp", "entropy", "d hidden"), got, base):
        if not np.array_equal(bits(g), bits(b)):
            failures.append(f"{what} changed on tokens the poison does not reach")
    assert not failures, f"{target}: {poison} hidden: " + "; ".join(failures)
