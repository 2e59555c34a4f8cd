"""The float64 references of the operator table (:mod:`ratiokl.harness._ops`).

Per operator: the argument names it takes from a case, its forward and gradient from
``ratiokl.spec`` (``(arguments) -> {output: array}``, ``(arguments, cotangents) ->
gradient``) and, where the bounds need the inputs, its per-case tolerances.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import numpy as np

from ratiokl import spec
from ratiokl.spec.tolerances import Tolerance

__all__ = ["LINEAR_KW", "OBJECTIVE_KW", "OBJECTIVE_OUTPUTS", "OBJECTIVE_POSITIONAL",
           "POLICY_KW", "POLICY_METRICS", "POLICY_POSITIONAL", "RATIO_KL_KW", "ROLLOUT_KW",
           "entropy_grad", "entropy_reference", "linear_grad", "linear_reference",
           "linear_tolerances", "objective_grad", "objective_reference",
           "objective_tolerances", "policy_grad", "policy_reference", "ratio_kl_grad",
           "ratio_kl_reference", "selected_grad", "selected_reference"]

Arrays = Mapping[str, Any]


def _spec_args(args: Arrays, names: Tuple[str, ...]) -> Dict[str, Any]:
    return {k: args[k] for k in names if k in args}


RATIO_KL_KW = ("ref_logps", "kl_estimator", "temperature")


def ratio_kl_reference(args: Arrays) -> Dict[str, np.ndarray]:
    ratio, kl = spec.ratio_kl(
        args["policy_logits"], args.get("ref_logits"), args["action_ids"], args["mask"],
        args["old_logps"], **_spec_args(args, RATIO_KL_KW),
    )
    return {"ratio": ratio, "kl": kl}


def ratio_kl_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return spec.ratio_kl_grad(
        args["policy_logits"], args.get("ref_logits"), args["action_ids"], args["mask"],
        args["old_logps"], cot["ratio"], cot["kl"], **_spec_args(args, RATIO_KL_KW),
    )


def selected_reference(args: Arrays) -> Dict[str, np.ndarray]:
    logp = spec.selected_logprobs(
        args["logits"], args["action_ids"], args.get("mask"), **_spec_args(args, ("temperature",))
    )
    return {"logp": logp}


def selected_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return spec.selected_logprobs_grad(
        args["logits"], args["action_ids"], args.get("mask"), cot["logp"],
        **_spec_args(args, ("temperature",)),
    )


POLICY_POSITIONAL = (
    "policy_logits", "ref_logits", "action_ids", "mask", "old_logps", "advantages",
)
POLICY_KW = (
    "ref_logps", "clip_eps", "clip_eps_high", "dual_clip", "ratio_cap", "kl_coef",
    "kl_estimator", "loss_agg", "loss_normalizer", "ratio_level", "segment_ids",
    "importance_weights", "log_ratio_bound", "temperature", "objective", "entropy_coef",
    "kl_agg", "entropy_agg", "kl_entropy_normalizer", "kl_clamp", "sapo_temperatures",
)
POLICY_METRICS = (
    "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
    "ratio_mean", "kl_mean", "approx_kl", "entropy_mean",
)
#: ``policy_loss`` with the rollout correction: its arguments and metrics on top.
ROLLOUT_KW = POLICY_KW + ("rollout_logps", "rollout_correction", "rollout_bounds")
#: ``policy_objective``'s outputs, its rollout metrics included.
OBJECTIVE_OUTPUTS = ("loss",) + POLICY_METRICS + spec.ROLLOUT_METRIC_NAMES + \
    spec.ROLLOUT_PARITY_NAMES


def entropy_reference(args: Arrays) -> Dict[str, np.ndarray]:
    return {**selected_reference(args),
            "entropy": spec.entropy(args["logits"], args.get("mask"),
                                    **_spec_args(args, ("temperature",)))}


def entropy_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    return selected_grad(args, cot) + spec.entropy_grad(
        args["logits"], args.get("mask"), cot["entropy"], **_spec_args(args, ("temperature",)))


def policy_reference(args: Arrays) -> Dict[str, np.ndarray]:
    positional = [args.get(k) for k in POLICY_POSITIONAL]
    value, metrics = spec.policy_loss(*positional, **_spec_args(args, ROLLOUT_KW))
    return {"loss": np.asarray(value, np.float64),
            **{k: np.float64(v) for k, v in metrics.items()}}


def policy_grad(args: Arrays, cot: Arrays) -> np.ndarray:
    positional = [args.get(k) for k in POLICY_POSITIONAL]
    kw = _spec_args(args, ROLLOUT_KW)
    if np.ndim(cot["loss"]):  # loss_agg="none": one upstream value per token
        return spec.policy_loss_grad(*positional, loss_cotangent=cot["loss"], **kw)
    return float(cot["loss"]) * spec.policy_loss_grad(*positional, **kw)


OBJECTIVE_POSITIONAL = ("logps", "old_logps", "advantages", "mask")
OBJECTIVE_KW = ("ref_logps", "entropy") + tuple(
    k for k in ROLLOUT_KW if k not in ("ref_logps", "temperature"))


def _objective_args(args: Arrays):
    return [args.get(k) for k in OBJECTIVE_POSITIONAL], _spec_args(args, OBJECTIVE_KW)


def objective_reference(args: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _objective_args(args)
    value, metrics = spec.policy_objective(*positional, **kw)
    return {"loss": np.asarray(value, np.float64),
            **{k: np.float64(v) for k, v in metrics.items()}}


def objective_grad(args: Arrays, cot: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _objective_args(args)
    dlogps, dentropy = spec.policy_objective_grad(*positional, loss_cotangent=cot["loss"], **kw)
    return {"logps": dlogps, "entropy": dentropy}


def objective_tolerances(args: Arrays, cot: Arrays,
                         dtypes: Mapping[str, str]) -> Dict[str, Tolerance]:
    """:func:`default_tolerances` with the log-probs' magnitude as the scale: the float32
    forward loses a few ulps of the largest active ``|logp|`` (of the policy, the behaviour
    policy, the reference and the engine), and each gradient is stored in its argument's
    dtype (``dtypes``)."""
    mask = np.asarray(args["mask"], bool)
    scale = 0.0
    for key in ("logps", "old_logps", "ref_logps", "rollout_logps", "entropy"):
        if args.get(key) is not None:
            values = np.abs(np.asarray(args[key], np.float64)[mask])
            scale = max(scale, float(values[np.isfinite(values)].max(initial=0.0)))
    grads = objective_grad(args, cot)
    tols = {out: spec.forward_tolerance(scale) for out in OBJECTIVE_OUTPUTS}
    for key, arg in (("grad", "logps"), ("grad_entropy", "entropy")):
        finite = np.abs(grads[arg][np.isfinite(grads[arg])])
        tols[key] = spec.grad_tolerance(dtypes[arg], scale, float(finite.max(initial=0.0)))
    return tols


LINEAR_KW = ("bias", "temperature", "logit_scale", "logit_softcap")


def _linear_args(args: Arrays):
    return ((args["hidden"], args["weight"], args["action_ids"], args.get("mask")),
            _spec_args(args, LINEAR_KW))


def linear_reference(args: Arrays, entropy: bool) -> Dict[str, np.ndarray]:
    positional, kw = _linear_args(args)
    out = spec.linear_selected_logprobs(*positional, return_entropy=entropy, **kw)
    return {"logp": out[0], "entropy": out[1]} if entropy else {"logp": out}


def linear_grad(args: Arrays, cot: Arrays) -> Dict[str, np.ndarray]:
    positional, kw = _linear_args(args)
    grads = spec.linear_selected_logprobs_grad(*positional, cot["logp"], cot.get("entropy"),
                                               **kw)
    return {k: g for k, g in zip(("hidden", "weight", "bias"), grads) if g is not None}


def linear_tolerances(args: Arrays, cot: Arrays,
                      dtypes: Mapping[str, str]) -> Dict[str, Tolerance]:
    """``ratiokl.spec.linear_forward_tolerance`` / ``linear_grad_tolerance``: the logits are
    the case's GEMM (float32 in the chunk), and the gradients GEMM sums of ``du`` as
    ``ratiokl.spec.linear_grad_operand`` names it for the head's dtypes (``dtypes``: of
    ``hidden``, ``weight`` and ``bias``), each stored in its argument's dtype."""
    positional, kw = _linear_args(args)
    mask = np.ones(np.shape(args["hidden"])[:-1], bool) if args.get("mask") is None \
        else np.asarray(args["mask"], bool)
    logits = spec.linear_logits(np.where(mask[..., None], args["hidden"], 0.0), args["weight"],
                                kw.get("bias"), logit_scale=kw.get("logit_scale", 1.0),
                                logit_softcap=kw.get("logit_softcap"))
    temp = np.broadcast_to(np.asarray(kw.get("temperature", 1.0), np.float64), mask.shape)
    with np.errstate(invalid="ignore"):
        z = np.abs(logits[mask] / temp[mask][:, None])
    scale = float(z[np.isfinite(z)].max(initial=0.0))
    vocab = np.shape(args["weight"])[0]
    hidden, weight = dtypes["hidden"], dtypes["weight"]
    tols = {"logp": spec.linear_forward_tolerance(hidden, scale, vocab),
            "entropy": spec.linear_forward_tolerance(hidden, scale, vocab, entropy=True)}
    magnitudes = spec.linear_grad_magnitudes(*positional, cot["logp"], cot.get("entropy"),
                                             **kw)
    du = spec.linear_grad_operand(hidden, weight)
    for (key, arg), magnitude in zip((("grad", "hidden"), ("grad_weight", "weight"),
                                      ("grad_bias", "bias")), magnitudes):
        if magnitude is not None:
            tols[key] = spec.linear_grad_tolerance(du, scale, magnitude, stored=dtypes[arg])
    return tols
