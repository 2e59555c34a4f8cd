"""JAX entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Signatures only; each function is one call into
``ratiokl.jax._route`` (``_linear_route`` for the two ops from hidden states), which validates the inputs once, queues the check of
active ids (a host check on concrete inputs, a ``checkify`` check under
tracing), runs the backend and reads the check.

Options that select code paths (``kl_estimator``, ``backend``,
``check_ids``) and a Python-float ``temperature`` are static Python values:
close over them (``jax.jit(lambda *a: loss.ratio_kl(*a, kl_estimator="k2"))``)
or mark them static. Arrays may be traced.

The docstrings are written once for both frameworks in ``ratiokl._docs`` (a template per
function, with this framework's pieces); ``@_documented`` sets each function's ``__doc__``
from it, so ``help`` and the API reference show the full text.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import jax

from ratiokl._core import objective_route
from ratiokl._docs import documented
from ratiokl.jax import _checks, _linear_route, _route
from ratiokl.jax._arrays import XP
from ratiokl.jax._checks import Temperature
from ratiokl.spec import (
    DEFAULT_LOG_RATIO_BOUND,
    DEFAULT_ROLLOUT_BOUNDS,
    BackendName,
    Fp32Matmul,
    GradWeightAccum,
    KLEstimator,
    LogitsDtype,
    LossAgg,
    Objective,
    PolicyKLEstimator,
    RatioLevel,
    RolloutCorrection,
    TermAgg,
    check_chunk_rows,
    logit_transform,
    policy_loss_options,
)

#: A coefficient a trainer may change every step: a Python number or a 0-d float array.
Coefficient = Union[float, jax.Array]

_documented = documented("jax")

__all__ = ["linear_policy_loss", "linear_selected_logprobs", "policy_loss", "policy_objective",
           "ratio_kl", "selected_logprobs"]


@_documented
def selected_logprobs(
    logits: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array] = None,
    *,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
    return_entropy: bool = False,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    return _route.selected_logprobs(
        logits, action_ids, mask, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_axis=vocab_axis,
        return_entropy=return_entropy,
    )


@_documented
def ratio_kl(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: Optional[jax.Array],
    old_logps: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    kl_estimator: KLEstimator = "k3",
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Tuple[jax.Array, jax.Array]:
    return _route.ratio_kl(
        policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps=ref_logps,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_axis=vocab_axis,
    )


@_documented
def policy_loss(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: Optional[jax.Array],
    old_logps: Optional[jax.Array],
    advantages: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    clip_eps: Coefficient = 0.2,
    clip_eps_high: Optional[Coefficient] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: Coefficient = 0.0,
    kl_estimator: PolicyKLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    loss_normalizer: Union[None, float, jax.Array] = None,
    ratio_level: RatioLevel = "token",
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, jax.Array] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[jax.Array] = None,
    importance_weights: Optional[jax.Array] = None,
    rollout_logps: Optional[jax.Array] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
    inplace_grad: bool = False,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    return _route.policy_loss(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures),
        ref_logps=ref_logps, loss_normalizer=loss_normalizer,
        kl_entropy_normalizer=kl_entropy_normalizer, segment_ids=segment_ids,
        importance_weights=importance_weights, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_axis=vocab_axis, inplace_grad=inplace_grad,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


@_documented
def policy_objective(
    logps: jax.Array,
    old_logps: Optional[jax.Array],
    advantages: jax.Array,
    mask: Optional[jax.Array] = None,
    *,
    ref_logps: Optional[jax.Array] = None,
    entropy: Optional[jax.Array] = None,
    clip_eps: Coefficient = 0.2,
    clip_eps_high: Optional[Coefficient] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: Coefficient = 0.0,
    kl_estimator: PolicyKLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    loss_normalizer: Union[None, float, jax.Array] = None,
    ratio_level: RatioLevel = "token",
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, jax.Array] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[jax.Array] = None,
    importance_weights: Optional[jax.Array] = None,
    rollout_logps: Optional[jax.Array] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    return objective_route.policy_objective(
        XP, _checks, policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures),
        logps, old_logps, advantages, mask, ref_logps=ref_logps, entropy=entropy,
        loss_normalizer=loss_normalizer, kl_entropy_normalizer=kl_entropy_normalizer,
        segment_ids=segment_ids, importance_weights=importance_weights,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


@_documented
def linear_selected_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array] = None,
    *,
    bias: Optional[jax.Array] = None,
    temperature: Temperature = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    logits_dtype: LogitsDtype = "float32",
    fp32_matmul: Fp32Matmul = "bf16x3",
    grad_weight_accum: GradWeightAccum = "float32",
    return_entropy: bool = False,
    chunk_rows: Optional[int] = None,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    return _linear_route.linear_selected_logprobs(
        hidden, weight, action_ids, mask, bias=bias, temperature=temperature,
        logit_scale=logit_scale, logit_softcap=logit_softcap, logits_dtype=logits_dtype,
        fp32_matmul=fp32_matmul, grad_weight_accum=grad_weight_accum,
        return_entropy=return_entropy,
        chunk_rows=chunk_rows, backend=backend, check_ids=check_ids, vocab_axis=vocab_axis,
    )


@_documented
def linear_policy_loss(
    hidden: jax.Array,
    weight: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array],
    old_logps: Optional[jax.Array],
    advantages: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    logits_dtype: LogitsDtype = "float32",
    fp32_matmul: Fp32Matmul = "bf16x3",
    grad_weight_accum: GradWeightAccum = "float32",
    chunk_rows: Optional[int] = None,
    clip_eps: Coefficient = 0.2,
    clip_eps_high: Optional[Coefficient] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: Coefficient = 0.0,
    kl_estimator: PolicyKLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    loss_normalizer: Union[None, float, jax.Array] = None,
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, jax.Array] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[jax.Array] = None,
    importance_weights: Optional[jax.Array] = None,
    rollout_logps: Optional[jax.Array] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    return _linear_route.linear_policy_loss(
        hidden, weight, action_ids, mask, old_logps, advantages, check_chunk_rows(chunk_rows),
        logit_transform(logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                        grad_weight_accum),
        policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level="token", log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures),
        ref_logps=ref_logps, bias=bias, loss_normalizer=loss_normalizer,
        kl_entropy_normalizer=kl_entropy_normalizer, segment_ids=segment_ids,
        importance_weights=importance_weights, temperature=temperature, backend=backend,
        check_ids=check_ids, rollout_logps=rollout_logps,
        rollout_correction=rollout_correction, rollout_bounds=rollout_bounds,
        vocab_axis=vocab_axis,
    )
