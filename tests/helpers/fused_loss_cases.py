"""The fused-loss cases the interpreter tests run (``tests/test_fused_loss_interpret.py`` on
both frameworks; ``tests/torch`` and ``tests/jax`` ``test_fused_loss_interpret.py`` for what
only one has): the inputs, the options, and one call per framework (``call``)."""

from __future__ import annotations

import numpy as np
import torch

from ratiokl import spec
from ratiokl.torch import loss

B, T, V = 3, 4, 37
#: The float32 loss and metrics (sums of B*T per-token terms) against the float64 spec.
SPEC_TOL = spec.reduction_tolerance(B * T)
#: Native and fused paths round the same float32 math (sums of B*T terms) in another order.
LOSS_TOL = spec.paths_tolerance(B * T)
#: ``max |logits|``: normal(0, 2) draws of B*T*V entries stay below it.
LOGIT_SCALE = 10.0


def grad_tolerance(case: dict, expected: np.ndarray):
    """The policy-logit gradient's tolerance (stored in the case's dtype) against the spec."""
    return spec.grad_tolerance(case.get("dtype", "float32"), LOGIT_SCALE,
                               float(np.abs(expected).max()))

CASES = {
    "ppo_defaults_no_reference": dict(ref="none"),
    "dapo_clip_higher_dual_clip_k3_seq_mean_token_mean": dict(
        clip_eps_high=0.28, dual_clip=3.0, kl_coef=0.1, loss_agg="seq-mean-token-mean"),
    "ratio_cap_k1_straight_through_token_sum_ref_logps_is_weights": dict(
        ref="logps", ratio_cap=1.3, kl_coef=0.2, kl_estimator="k1+", loss_agg="token-sum",
        weights=True),
    "k2_seq_mean_token_sum_packed": dict(
        kl_coef=0.3, kl_estimator="k2", loss_agg="seq-mean-token-sum", packed=True),
    "k3_straight_through_sum_norm_unbounded_per_seq_adv_row_temp": dict(
        kl_coef=0.1, kl_estimator="k3+", loss_agg="seq-mean-token-sum-norm",
        log_ratio_bound=None, per_seq_adv=True, row_temp=True),
    "k3_ratio_weighted_tensor_normalizer_small_bound": dict(
        kl_coef=0.5, kl_estimator="k3-is", loss_normalizer=7.0, log_ratio_bound=0.5),
    "k1_bf16_packed_seq_mean_token_mean": dict(
        kl_coef=0.1, kl_estimator="k1", loss_agg="seq-mean-token-mean", packed=True,
        dtype="bfloat16"),
    "cispo_clip_higher_k3_is_weights_seq_mean_token_mean_packed": dict(
        objective="cispo", clip_eps_high=0.28, kl_coef=0.2, kl_estimator="k3-is",
        loss_agg="seq-mean-token-mean", weights=True, packed=True),
    "cispo_ratio_cap_ref_logps_small_bound_row_temp": dict(
        objective="cispo", clip_eps=0.5, clip_eps_high=1.0, ratio_cap=1.5, ref="logps",
        kl_coef=0.1, log_ratio_bound=1.0, row_temp=True),
    "entropy_bonus_k3_token_mean_masked_vocab": dict(
        entropy_coef=0.3, kl_coef=0.1, masked=True),
    "entropy_penalty_seq_mean_token_mean_row_temp_bf16": dict(
        entropy_coef=-0.2, loss_agg="seq-mean-token-mean", row_temp=True, masked=True,
        dtype="bfloat16"),
    "cispo_entropy_ref_logps_token_sum_packed": dict(
        objective="cispo", entropy_coef=0.25, ref="logps", kl_coef=0.1, loss_agg="token-sum",
        packed=True),
}


def inputs(seed: int, case: dict):
    """NumPy inputs; inactive rows hold NaN logits, NaN per-token values and bad ids.

    ``masked``: ``-inf`` at every third logit of active rows (never the action; row
    ``[0, 0]`` allows its action alone) and ``+-inf`` rows among the inactive ones.
    """
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    mask = rng.random((B, T)) < 0.75
    mask[0, 0] = True
    logits[~mask] = np.nan
    nan_off = lambda a: np.where(mask, a, np.nan).astype(np.float32)  # noqa: E731
    x = {
        "policy_logits": logits,
        "ref_logits": (logits + rng.normal(0.0, 0.5, logits.shape)).astype(np.float32),
        "action_ids": np.where(mask, rng.integers(0, V, (B, T)), -7),
        "mask": mask,
        "old_logps": nan_off(rng.normal(-3.3, 1.0, (B, T))),
        "advantages": nan_off(rng.normal(0.0, 1.0, (B, T))),
    }
    if case.get("ref") == "logps":
        x["ref_logps"] = nan_off(rng.normal(-3.0, 0.5, (B, T)))
    if case.get("per_seq_adv"):
        x["advantages"] = rng.normal(0.0, 1.0, (B,)).astype(np.float32)
    if case.get("packed"):
        x["segment_ids"] = np.sort(rng.integers(0, 3, (B, T)), axis=-1)
    if case.get("weights"):
        x["importance_weights"] = nan_off(rng.uniform(0.5, 1.5, (B, T)))
    if case.get("row_temp"):
        x["temperature"] = rng.uniform(0.7, 1.4, (B, T)).astype(np.float32)
    if case.get("masked"):
        drop = np.zeros(logits.shape, bool)
        drop[..., ::3] = True
        drop[0, 0] = True
        np.put_along_axis(drop, np.maximum(x["action_ids"], 0)[..., None], False, axis=-1)
        logits[drop & mask[..., None]] = -np.inf
        for n, row in enumerate(map(tuple, np.argwhere(~mask)[:2])):
            logits[row] = (np.inf, -np.inf)[n]
    if case.get("dtype") == "bfloat16":  # exactly representable, so the spec sees the same
        x["policy_logits"] = torch.from_numpy(logits).bfloat16().float().numpy()
        x["ref_logits"] = torch.from_numpy(x["ref_logits"]).bfloat16().float().numpy()
    return x


FLAGS = ("ref", "per_seq_adv", "packed", "weights", "row_temp", "dtype", "masked")


def options(case: dict) -> dict:
    return {k: v for k, v in case.items() if k not in FLAGS}


def torch_call(x: dict, case: dict, backend: str, upstream: float):
    """``(loss, metrics, grad)`` of one call; the loss is scaled by ``upstream`` before backward."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in x.items()}
    dtype = torch.bfloat16 if case.get("dtype") == "bfloat16" else torch.float32
    logits = t.pop("policy_logits").to(dtype).requires_grad_()
    ref = t.pop("ref_logits").to(dtype)
    kwargs = options(case)
    if "loss_normalizer" in kwargs:
        kwargs["loss_normalizer"] = torch.tensor(kwargs["loss_normalizer"])
    if case.get("ref") in ("none", "logps"):
        ref = None
    value, metrics = loss.policy_loss(
        logits, ref, t.pop("action_ids"), t.pop("mask"), t.pop("old_logps"),
        t.pop("advantages"), backend=backend, **t, **kwargs,
    )
    (value * upstream).backward()
    return value.item(), {k: v.item() for k, v in metrics.items()}, logits.grad


def jax_call(x: dict, case: dict, backend: str, upstream: float):
    """:func:`torch_call` through ``ratiokl.jax`` (``jax.vjp``): ``(loss, metrics, grad)``."""
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss as jax_loss

    dtype = jnp.bfloat16 if case.get("dtype") == "bfloat16" else jnp.float32
    t = {k: jnp.asarray(v) for k, v in x.items()}
    logits = t.pop("policy_logits").astype(dtype)
    ref = t.pop("ref_logits").astype(dtype)
    if case.get("ref") in ("none", "logps"):
        ref = None
    rows = [t.pop(k) for k in ("action_ids", "mask", "old_logps", "advantages")]
    rows[0] = rows[0].astype(jnp.int32)

    kwargs = options(case)
    if "loss_normalizer" in kwargs:
        kwargs["loss_normalizer"] = jnp.asarray(kwargs["loss_normalizer"], jnp.float32)

    def fn(z):
        return jax_loss.policy_loss(z, ref, *rows, backend=backend, **t, **kwargs)

    (value, metrics), vjp = jax.vjp(fn, logits)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, metrics)
    (grad,) = vjp((jnp.asarray(upstream, jnp.float32), zeros))
    assert grad.dtype == dtype
    return float(value), {k: float(v) for k, v in metrics.items()}, grad


def call(framework: str, x: dict, case: dict, backend: str, upstream: float):
    """``(loss, metrics, grad)`` of ``framework``'s call; the gradient as float32 NumPy."""
    if framework == "jax":
        value, metrics, grad = jax_call(x, case, backend, upstream)
        return value, metrics, np.asarray(grad, np.float32)
    value, metrics, grad = torch_call(x, case, backend, upstream)
    assert grad.dtype == (torch.bfloat16 if case.get("dtype") == "bfloat16" else torch.float32)
    return value, metrics, grad.float().numpy()
