"""PyTorch entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Signatures only; each function is one call into
``ratiokl.torch._route`` (``_linear_route`` for the two ops from hidden states), which
validates the inputs once, queues the check of active ids (``check_ids``), runs the
backend and reads the check.

They work under autograd and ``torch.compile``. ``torch.func``: ``selected_logprobs``,
``ratio_kl`` and ``policy_loss`` support ``grad``, ``vjp``, ``jacrev`` and ``vmap`` on the
``native`` and ``interpret`` backends, and ``policy_objective`` (plain autograd ops) every
transform; inside a transform ``backend="triton"``, ``vocab_group`` and the two ops from
hidden states raise ``RuntimeError`` (use ``backward()`` and the leading shape ``[...]``,
or ``ratiokl.jax``). Forward mode (``jvp``) is not supported. The details, and the id
check under ``vmap``: ``docs/api.md``.

The docstrings are written once for both frameworks in ``ratiokl._docs`` (a template per
function, with this framework's pieces); ``@_documented`` sets each function's ``__doc__``
from it, so ``help`` and the API reference show the full text.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl._core import objective_route
from ratiokl._docs import documented
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
from ratiokl.torch import _checks, _linear_route, _route
from ratiokl.torch._arrays import XP
from ratiokl.torch._checks import Temperature

__all__ = ["linear_policy_loss", "linear_selected_logprobs", "policy_loss", "policy_objective",
           "ratio_kl", "selected_logprobs"]

#: A coefficient a trainer may change every step: a Python number or a 0-d float tensor.
Coefficient = Union[float, torch.Tensor]

_documented = documented("torch")


@_documented
def selected_logprobs(
    logits: torch.Tensor,
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
    return_entropy: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    return _route.selected_logprobs(
        logits, action_ids, mask, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group,
        return_entropy=return_entropy,
    )


@_documented
def ratio_kl(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logps: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    kl_estimator: KLEstimator = "k3",
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    return _route.ratio_kl(
        policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps=ref_logps,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group,
    )


@_documented
def policy_loss(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    clip_eps: Coefficient = 0.2,
    clip_eps_high: Optional[Coefficient] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: Coefficient = 0.0,
    kl_estimator: PolicyKLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    loss_normalizer: Union[None, float, torch.Tensor] = None,
    ratio_level: RatioLevel = "token",
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, torch.Tensor] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
    inplace_grad: bool = False,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return _route.policy_loss(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures,
            cached=not torch.compiler.is_compiling()),
        ref_logps=ref_logps, loss_normalizer=loss_normalizer,
        kl_entropy_normalizer=kl_entropy_normalizer, segment_ids=segment_ids,
        importance_weights=importance_weights, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group, inplace_grad=inplace_grad,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


@_documented
def policy_objective(
    logps: torch.Tensor,
    old_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    clip_eps: Coefficient = 0.2,
    clip_eps_high: Optional[Coefficient] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: Coefficient = 0.0,
    kl_estimator: PolicyKLEstimator = "k3",
    loss_agg: LossAgg = "token-mean",
    loss_normalizer: Union[None, float, torch.Tensor] = None,
    ratio_level: RatioLevel = "token",
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, torch.Tensor] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return objective_route.policy_objective(
        XP, _checks, policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level=ratio_level, log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures,
            cached=not torch.compiler.is_compiling()),
        logps, old_logps, advantages, mask, ref_logps=ref_logps, entropy=entropy,
        loss_normalizer=loss_normalizer, kl_entropy_normalizer=kl_entropy_normalizer,
        segment_ids=segment_ids, importance_weights=importance_weights,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


@_documented
def linear_selected_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    bias: Optional[torch.Tensor] = None,
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
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    return _linear_route.linear_selected_logprobs(
        hidden, weight, action_ids, mask, bias=bias, temperature=temperature,
        logit_scale=logit_scale, logit_softcap=logit_softcap, logits_dtype=logits_dtype,
        fp32_matmul=fp32_matmul, grad_weight_accum=grad_weight_accum,
        return_entropy=return_entropy,
        chunk_rows=chunk_rows, backend=backend, check_ids=check_ids, vocab_group=vocab_group,
    )


@_documented
def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor],
    old_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
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
    loss_normalizer: Union[None, float, torch.Tensor] = None,
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, torch.Tensor] = None,
    kl_clamp: Optional[float] = None,
    sapo_temperatures: Optional[Tuple[float, float]] = None,
    segment_ids: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    return _linear_route.linear_policy_loss(
        hidden, weight, action_ids, mask, old_logps, advantages, check_chunk_rows(chunk_rows),
        logit_transform(logit_scale, logit_softcap, logits_dtype, fp32_matmul,
                        grad_weight_accum),
        policy_loss_options(
            clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
            ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
            ratio_level="token", log_ratio_bound=log_ratio_bound, objective=objective,
            entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
            kl_clamp=kl_clamp, sapo_temperatures=sapo_temperatures,
            cached=not torch.compiler.is_compiling()),
        ref_logps=ref_logps, bias=bias, loss_normalizer=loss_normalizer,
        kl_entropy_normalizer=kl_entropy_normalizer, segment_ids=segment_ids,
        importance_weights=importance_weights, temperature=temperature, backend=backend,
        check_ids=check_ids, rollout_logps=rollout_logps,
        rollout_correction=rollout_correction, rollout_bounds=rollout_bounds,
        vocab_group=vocab_group,
    )
