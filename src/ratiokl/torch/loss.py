"""PyTorch entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Signatures and documentation; each function is one call into
``ratiokl.torch._route`` (``_linear_route`` for the two ops from hidden states), which
validates the inputs once, queues the check of active ids (``check_ids``), runs the
backend and reads the check.

They work under autograd and ``torch.compile``; inside a ``torch.func`` transform
(``grad``, ``vmap``, ...) they raise ``RuntimeError`` (use ``backward()`` and the leading
shape ``[...]``, or ``ratiokl.jax``).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl.spec import (
    DEFAULT_LOG_RATIO_BOUND,
    DEFAULT_ROLLOUT_BOUNDS,
    BackendName,
    KLEstimator,
    LossAgg,
    Objective,
    PolicyKLEstimator,
    RatioLevel,
    RolloutCorrection,
    TermAgg,
)
from ratiokl.torch import _linear_route, _objective, _route
from ratiokl.torch._checks import Temperature

__all__ = ["linear_policy_loss", "linear_selected_logprobs", "policy_loss", "policy_objective",
           "ratio_kl", "selected_logprobs"]

#: A coefficient a trainer may change every step: a Python number or a 0-d float tensor.
Coefficient = Union[float, torch.Tensor]


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
    r"""Log-probability of the sampled action per token: ``logp = z[a] - logsumexp(z)``.

    With :math:`z = \mathrm{logits} / T` (row by row), computed in float32 whatever the
    logits' dtype:

    .. math::

        \log p_a = z_a - \log \sum_v e^{z_v}

    and, with ``return_entropy``, the entropy of the same distribution ``p = softmax(z)``
    from the same read of the logits (a running ``sum exp(z - m) * z`` beside the
    log-sum-exp):

    .. math::

        H = -\sum_v p_v \log p_v = \log \sum_v e^{z_v} - \sum_v p_v z_v, \qquad
        \frac{\partial H}{\partial\, \mathrm{logits}_v} = -\frac{p_v (\log p_v + H)}{T}

    Args:
      logits: ``[..., V]`` float32, float16 or bfloat16, any strides.
      action_ids: ``[...]`` int64 or int32 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      temperature: a positive Python float, or a floating ``[...]`` (or 0-d) tensor,
        per row; an entry that is not positive and finite on an active row is
        rejected like a bad id (``check_ids``) and otherwise makes its row NaN.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``.
      check_ids: check active ids (and a per-row temperature) and raise
        ``ValueError`` naming the first bad position. The check is queued before
        the kernels and read after them, so the GPU never waits for the host; the
        call returns once the GPU has reached it. Under ``torch.compile`` it is an op
        of the compiled graph, run before the kernels (on a GPU one host sync there).
        False (required inside a CUDA graph capture, and under ``torch.compile`` with
        ``vocab_group``, where True raises a ``ValueError`` saying so): no host read,
        and a row with a bad active id or temperature gives NaN (and NaN gradient), as
        it does whether checked or not.
      vocab_group: a ``torch.distributed`` process group over which ``logits``
        is sharded along the vocabulary (rank r holds a contiguous column
        block, in rank order; see docs/vocab_parallel.md). ``action_ids`` are
        global and every input but the logits is identical on every rank.

      return_entropy: also return the entropy (with ``vocab_group`` too).

    Returns:
      ``logp``: float32 ``[...]``; exactly 0 on inactive rows. The gradient
      ``g * (onehot(a) - softmax(z)) / T`` reaches ``logits`` in its dtype, and
      is exactly 0 on inactive rows whatever they hold (NaN, inf, any id).
      A NaN logit on an active row makes that row NaN only; ``-inf`` logits at
      other tokens (vocabulary masking) are valid.

      With ``return_entropy``: ``(logp, entropy)``, ``entropy`` float32 ``[...]``, 0 on
      inactive rows (its gradient there exactly 0 too); a ``-inf`` logit contributes 0
      to it and to its gradient (never ``0 * -inf``); a NaN logit makes the row NaN.

    See :func:`ratio_kl` for the references.
    """
    return _route.selected_logprobs(
        logits, action_ids, mask, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group,
        return_entropy=return_entropy,
    )


def ratio_kl(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: torch.Tensor,
    old_logps: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    kl_estimator: KLEstimator = "k3",
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Per-token importance ratio and KL penalty of the policy against a reference.

    With ``logp`` from :func:`selected_logprobs` (float32 math) and ``logp_ref`` the same
    on ``ref_logits`` (or the given ``ref_logps``):

    .. math::

        \mathrm{ratio} = e^{\log p - \log p_\mathrm{old}}, \qquad
        d = \log p_\mathrm{ref} - \log p, \qquad
        \mathrm{kl} = \begin{cases} -d & \text{k1} \\ d^2 / 2 & \text{k2} \\
                      e^{d} - d - 1 & \text{k3 (the default)} \end{cases}

    Args:
      policy_logits: ``[..., V]`` float32, float16 or bfloat16, any strides.
      ref_logits: reference-model logits of the same shape (any of those dtypes),
        or None when ``ref_logps`` is given. Evaluated without autograd.
      action_ids: ``[...]`` int64 or int32 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens.
      old_logps: ``[...]`` floating log-probs of the behaviour policy.
      ref_logps: ``[...]`` floating reference log-probs, instead of ``ref_logits``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
      temperature: a positive Python float, or a floating ``[...]`` tensor (per
        row); it scales the policy and the reference logits alike.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``.
      check_ids: as in :func:`selected_logprobs`.
      vocab_group: as in :func:`selected_logprobs`; ``policy_logits`` and
        ``ref_logits`` are both sharded that way.

    Returns:
      ``(ratio, kl)``, float32 ``[...]`` each. Inactive rows give ``ratio = 1``
      and ``kl = 0`` whatever they hold (NaN/inf logits, NaN ``old_logps``, any
      id). The gradient reaches ``policy_logits`` only, in its dtype
      (per row ``c * (onehot(a) - softmax(z)) / T`` with
      ``c = g_ratio * ratio + g_kl * dkl/dlogp``), exactly 0 on inactive rows;
      ``ref_logits``, ``ref_logps`` and ``old_logps`` get none.

    References:
      J. Schulman et al., "Proximal Policy Optimization Algorithms" (2017),
      arXiv:1707.06347 -- the importance ratio.
      J. Schulman, "Approximating KL Divergence" (2020),
      http://joschu.net/blog/kl-approx.html -- the k1/k2/k3 estimators.
    """
    return _route.ratio_kl(
        policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps=ref_logps,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group,
    )


def policy_loss(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: torch.Tensor,
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
    r"""PPO/GRPO clipped policy loss with a KL penalty, aggregated to one number.

    With ``logp`` from :func:`selected_logprobs`, per active token (:math:`A` the
    advantage, :math:`b` = ``log_ratio_bound``, :math:`\epsilon, \epsilon_h` =
    ``clip_eps``, ``clip_eps_high``, :math:`c_\mathrm{KL}, c_H` = ``kl_coef``,
    ``entropy_coef``, :math:`\mathrm{iw}` = ``importance_weights``):

    .. math::

        r = \exp\big(\mathrm{clip}(\log p - \log p_\mathrm{old}, -b, b)\big), \qquad
        \mathrm{pg} = \max\big(-A r,\; -A\, \mathrm{clip}(r, 1 - \epsilon, 1 + \epsilon_h)\big)

        \mathrm{loss} = w \cdot \mathrm{iw} \cdot \mathrm{pg}
                        + c_\mathrm{KL}\, \mathrm{kl}(\log p_\mathrm{ref} - \log p) - c_H H

    then ``pg = min(pg, -A * dual_clip)`` for :math:`A < 0`, and ``ratio_cap`` caps
    :math:`r` likewise; :math:`H = -\sum_v p_v \log p_v` is the entropy of the token's
    :math:`p = \mathrm{softmax}(z / T)` (:math:`\partial H / \partial z_v = -p_v (\log p_v
    + H) / T`; a ``-inf`` logit adds 0 to both), and :math:`w` the rollout correction's
    weight (1 without ``rollout_correction``), from the token's
    :math:`\ell = \log p_\mathrm{old} - \log p_\mathrm{rollout}` (or its sum over the
    sequence, at the sequence level):

    .. math::

        e = \exp\big(\mathrm{clip}(\ell, -b, b)\big), \qquad
        w = \begin{cases} \min(e, \mathrm{hi}) & \text{truncate} \\
            e \text{ if } \mathrm{lo} \le e \le \mathrm{hi}, \text{ else } 0 & \text{mask}
            \end{cases}

    ``objective="cispo"`` (MiniMax-M1) replaces ``pg`` by
    ``-sg(clip(r, 1-clip_eps, min(1+clip_eps_high, ratio_cap))) * A * logp``: the
    clipped ratio, detached, weighs every active token's log-prob gradient
    (``dual_clip`` is rejected with it).
    ``ratio_level="sequence"`` (GSPO) uses the sequence's mean log-ratio for
    ``r`` (value ``sg(s)``, gradient on each token's own ``logp``). The tokens
    are then aggregated by ``loss_agg``. docs/policy_loss.md has every formula
    and the table of verl / TRL equivalents.

    On the Triton backends one kernel computes the loss, the metrics and the
    policy-logit gradient in the forward (the backward only scales the stored
    gradient by the upstream value); every option fuses except
    ``ratio_level="sequence"`` and ``vocab_group``, which take the two-pass path
    (log-probs forward, gradient in the backward), as the native backends do.

    Args:
      policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps: as in
        :func:`ratio_kl`; ``ref_logits`` and ``ref_logps`` may both be None when
        ``kl_coef == 0``. ``old_logps`` None: on-policy, ``old_logp = sg(logp)`` (one
        optimisation step per rollout: ``r = 1`` in value, ``dr/dlogp = 1``; the ratio
        is never clipped and ``approx_kl`` is 0), as TRL and Liger do when the behaviour
        policy's log-probs were not computed; not with ``rollout_logps``.
      temperature, backend, check_ids, vocab_group: as in :func:`ratio_kl`.
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      clip_eps: ratio floor ``1 - clip_eps``; clip_eps_high: ceiling
        ``1 + clip_eps_high`` (DAPO clip-higher; default ``clip_eps``).
        ``clip_eps``, ``clip_eps_high``, ``kl_coef`` and ``entropy_coef`` may be 0-d float
        tensors on the logits' device (a schedule or an adaptive KL controller: traced by
        ``torch.compile``, no recompile per value; not range-checked, as reading
        them would synchronise).
      dual_clip: ``c > 1`` caps the loss of ``A < 0`` tokens at ``-A*c``; None: off.
      ratio_cap: INTELLECT-2's ``delta > 1``, an upper cap on the ratio; None: off.
      kl_coef, kl_estimator: KL weight and variant: ``"k1"``, ``"k2"``, ``"k3"``,
        ``"k1+"``/``"k3+"`` (value of k1/k3, gradient of k2), ``"k3-is"`` (k3 times r).
      loss_agg: ``"token-mean"``, ``"token-sum"``, ``"seq-mean-token-mean"``,
        ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``, or ``"none"``: no
        aggregation, the per-token loss ``[...]`` (the term each mode weighs, GSPO's with the
        sequence ratio; not with ``loss_normalizer``), for a trainer's own reduction.
      loss_normalizer: replaces the aggregation's denominator (a global token or
        sequence count, or a constant): a positive number or a 0-d tensor.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
      objective: ``"ppo"`` (the clipped surrogate above) or ``"cispo"`` (clipped
        importance-sampling weight on the log-prob); composes with every ``loss_agg``,
        KL variant and ``ratio_level`` (``"sequence"``: the weight clips ``s``).
      entropy_coef: weight of the entropy bonus ``-entropy_coef * H`` in each token's
        loss, aggregated by the same ``loss_agg`` (verl's ``entropy_coeff``): any finite
        number (> 0 rewards entropy, < 0 penalises it) or a 0-d float tensor (a schedule:
        no recompile per value, not read on the host). 0 (the number): the entropy is
        only averaged into ``metrics["entropy_mean"]``, from the same read of the
        logits, and costs no pass of its own.
      kl_agg, entropy_agg: None (the default): the KL (entropy) term joins each token's
        loss and follows ``loss_agg`` and ``loss_normalizer``. An aggregation name
        (``"token-mean"``, ``"token-sum"``, ``"seq-mean-token-mean"``,
        ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``): the term is aggregated
        apart by it and added to the aggregated loss,
        ``loss = agg(pg) + kl_coef * kl_agg(kl) - entropy_coef * entropy_agg(H)``
        (OpenRLHF's KL and entropy are token means whatever its policy aggregation; TRL's
        entropy bonus is a token mean whatever its ``loss_type``). Not with
        ``loss_agg="none"``. Such a call takes the two-pass route on every backend (the
        backend's log-probs and entropies, then the objective's framework ops), as GSPO does.
      kl_entropy_normalizer: the denominator of the terms ``kl_agg`` / ``entropy_agg``
        aggregate apart (a positive number or a 0-d float, e.g. OpenRLHF's
        ``batch_num_tokens / dp_size``); None: their aggregation's own count on this call's
        tokens. Only with ``kl_agg`` or ``entropy_agg`` (a ``ValueError`` otherwise).
      kl_clamp: ``c > 0`` clamps the KL estimator's value to ``[-c, c]`` (verl's
        ``low_var_kl`` and OpenRLHF's estimators clamp at 10): the gradient is 0 beyond
        ``c`` and kept at ``|kl| = c`` (``torch.clamp``'s); ``"k1+"`` / ``"k3+"`` clamp
        their value only (their gradient stays k2's). None: no clamp. Takes the two-pass
        route, as ``kl_agg`` does.
      segment_ids: integer ``[...]``; sequences of packed rows (a new one starts
        where the id of consecutive active tokens changes). None: one per row.
      importance_weights: floating ``[...]`` (e.g. truncated IS from the rollout
        engine), multiplied into the policy term, detached.
      rollout_logps: floating ``[...]``, the sampled tokens' log-probs under the inference
        engine that generated them (anything on inactive tokens, NaN included: never
        read). Given, the metrics gain ``rollout_weight_mean``, ``rollout_masked_fraction``
        and ``rollout_k3`` (the k3 estimate of KL(engine || old) over active tokens).
      rollout_correction: ``None`` (no weight: the metrics only), ``"token-truncate"``,
        ``"token-mask"``, ``"sequence-truncate"``, ``"sequence-mask"``, ``"token-clip"``
        (``clip(e, lo, hi)``: TIS with a floor, OpenRLHF's ``is_correction_mode="clip"``) or
        ``"sequence-geomean-mask"`` (OpenRLHF's sequence gate: the sequence's weights are 0
        where the geometric mean of its token ratios lies outside ``[lo, hi]``, else each
        token's own ``e``): the level of
        ``lw`` (a sequence is what ``loss_agg`` calls one: a row, or a segment of
        ``segment_ids``) and what the bounds do. Needs ``rollout_logps``. The weight is
        detached, multiplies the policy term only (with ``importance_weights``), and a
        token of weight 0 stays in the aggregation's denominator.
      rollout_bounds: ``(lo, hi)`` Python numbers, ``0 <= lo <= hi``: truncate caps ``e`` at
        ``hi`` (finite; clip also raises it to ``lo``); mask zeroes the weight outside
        ``[lo, hi]`` (``hi`` may be inf).
        IcePop is ``"token-mask"`` with ``(0.5, 5.0)``; docs/policy_loss.md maps verl's and
        TRL's options.
      log_ratio_bound: bound on ``|log ratio|`` (and on ``|d|`` before k3's exp)
        applied before ``exp``, zero gradient beyond it; None: no bound.
      inplace_grad: opt-in, fused path in eager mode only (elsewhere, where the
        two-pass route writes a new gradient, a ``ValueError`` says where it works):
        the forward writes ``d loss / d policy_logits`` into ``policy_logits``'
        own (contiguous) buffer, so a step needs no ``[N, V]`` gradient
        allocation. The logits are consumed: afterwards they hold the gradient
        (scaled by the upstream value at ``backward``), another autograd node
        that saved them fails loudly, and the loss backpropagates once.

    Returns:
      ``(loss, metrics)``: a float32 0-d tensor (``loss_agg="none"``: float32 ``[...]``,
      exactly ``+0.0`` on inactive tokens, each token's gradient scaled by its own upstream
      value; a NaN upstream on an inactive token stays out), and detached float32 0-d tensors
      ``clip_fraction`` (= ``_low`` + ``_high``), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``kl_mean``
      ``approx_kl`` (mean of ``old_logp - logp``) and ``entropy_mean`` (mean ``H``),
      means over active tokens; with ``rollout_logps``, also the three rollout metrics
      above.
      Inactive tokens contribute nothing and get exactly zero gradient whatever
      they hold; no active token gives loss 0 and zero metrics, never NaN.
      The loss backpropagates once per call on every backend (the one-kernel path
      scales its stored gradient in place): a second backward through it
      (``retain_graph=True``) raises ``RuntimeError``; call ``policy_loss`` again.

    References:
      Schulman et al. (2017) PPO, arXiv:1707.06347; Ye et al. (2019) dual-clip,
      arXiv:1912.09729; Yu et al. (2025) DAPO, arXiv:2503.14476; Liu et al.
      (2025) Dr. GRPO, arXiv:2503.20783; Zheng et al. (2025) GSPO,
      arXiv:2507.18071; Prime Intellect (2025) INTELLECT-2, arXiv:2505.07291; Yao et al.
      (2025) truncated importance sampling for the rollout mismatch (TIS); Ling Team (2025)
      IcePop (Ring-1T).
    """
    return _route.policy_loss(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        ref_logps=ref_logps, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        dual_clip=dual_clip, ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator,
        loss_agg=loss_agg, loss_normalizer=loss_normalizer, ratio_level=ratio_level,
        objective=objective, entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
        kl_entropy_normalizer=kl_entropy_normalizer, kl_clamp=kl_clamp,
        segment_ids=segment_ids, importance_weights=importance_weights,
        log_ratio_bound=log_ratio_bound, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_group=vocab_group, inplace_grad=inplace_grad,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


def policy_objective(
    logps: torch.Tensor,
    old_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    mask: torch.Tensor,
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
    segment_ids: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    rollout_logps: Optional[torch.Tensor] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    r""":func:`policy_loss` on per-token log-probs the trainer already holds (and their
    entropies), for a model whose forward returns them.

    The same objective, aggregation, rollout correction and metrics as :func:`policy_loss`,
    on the same code (``ratiokl._core.objective``): per active token

    .. math::

        r = \exp\big(\mathrm{clip}(\log p - \log p_\mathrm{old}, -b, b)\big), \qquad
        L = w \cdot \mathrm{iw} \cdot \mathrm{pg}(r, A)
            + c_\mathrm{KL}\, \mathrm{kl}(\log p_\mathrm{ref} - \log p) - c_H H

    then ``loss = sum_t a_t L_t / D`` by ``loss_agg`` (docs/policy_loss.md has every term).
    Given the ``logp`` and entropy of :func:`policy_loss`'s logits, it returns
    :func:`policy_loss`'s loss and metrics, and its gradient w.r.t. ``logps`` is the one
    :func:`policy_loss` carries to the logits through ``d logp / d logits``. It runs
    framework ops on ``[...]``-sized tensors (no kernel, so no ``backend`` or
    ``temperature``: the log-probs carry the temperature they were computed with), under
    autograd and ``torch.compile``; being plain autograd, its loss may be backpropagated
    more than once (``retain_graph=True``).

    Args:
      logps: ``[...]`` floating (float32, bfloat16, ...) log-probs of the sampled tokens
        under the policy being trained, with autograd; computed in float32.
      old_logps: ``[...]`` floating behaviour log-probs, or None (on-policy:
        ``old_logp = sg(logp)``, as in :func:`policy_loss`).
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens.
      ref_logps: ``[...]`` floating reference log-probs (detached); needed when
        ``kl_coef != 0`` (a ``ValueError`` naming it otherwise), else only logged
        (``kl_mean``).
      entropy: ``[...]`` floating per-token entropies of the policy, with autograd, or None.
        Needed when ``entropy_coef != 0`` (a ``ValueError`` naming ``entropy`` otherwise);
        given, ``metrics["entropy_mean"]`` reports its mean.
      clip_eps ... log_ratio_bound: as in :func:`policy_loss`, ``loss_agg="none"`` included.

    Returns:
      ``(loss, metrics)``: the float32 0-d loss (``loss_agg="none"``: the per-token loss,
      float32 ``[...]``, exactly 0 on inactive tokens), and detached float32 0-d metrics as
      :func:`policy_loss`'s (``entropy_mean`` only when ``entropy`` is given). The gradient
      reaches ``logps`` and, where the entropy bonus weighs in, ``entropy``, in their
      dtypes; never ``old_logps``, ``ref_logps``, ``advantages``, ``rollout_logps`` or
      ``importance_weights``. Inactive tokens: whatever any input holds there (NaN, inf),
      it reaches neither the loss, the metrics nor a gradient (those tokens' gradients are
      exactly 0): every input is selected with ``where`` before any arithmetic. A NaN in an
      active token stays visible (a NaN loss).
    """
    return _objective.policy_objective(
        logps, old_logps, advantages, mask, ref_logps=ref_logps, entropy=entropy,
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
        ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
        loss_normalizer=loss_normalizer, ratio_level=ratio_level, objective=objective,
        entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
        kl_entropy_normalizer=kl_entropy_normalizer, kl_clamp=kl_clamp, segment_ids=segment_ids,
        importance_weights=importance_weights, rollout_logps=rollout_logps,
        rollout_correction=rollout_correction, rollout_bounds=rollout_bounds,
        log_ratio_bound=log_ratio_bound,
    )


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
    return_entropy: bool = False,
    chunk_rows: int = 2048,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    r""":func:`selected_logprobs` (and the entropy) of the lm_head's logits, never holding them
    for all rows.

    The logits, in TRL's order (scale :math:`s`, softcap :math:`c`, then the temperature
    :math:`T`; the bias 0 when None, :math:`x = s u` without a softcap):

    .. math::

        u = h W^\top + b, \qquad x = c \tanh(s u / c), \qquad
        \log p_a = \frac{x_a}{T} - \operatorname{logsumexp}(x / T), \qquad
        H = -\sum_v p_v \log p_v, \quad p = \operatorname{softmax}(x / T)

    and the gradients, the entropy's own included (:math:`g_{\log p}`, :math:`g_H`: the
    upstream values; :math:`\bar h` the hidden states with inactive rows zeroed):

    .. math::

        dx = \frac{g_{\log p} (e_a - p) - g_H\, p (\log p + H)}{T}, \qquad
        du = dx \cdot s \left(1 - (x / c)^2\right), \qquad
        d h = du\, W, \quad d W = du^\top \bar h, \quad d b = \textstyle\sum du

    The rows go through ``chunk_rows`` at a time: per chunk one GEMM into a reusable
    ``[chunk_rows, V]`` buffer in the weight's dtype (the bias and scale in the GEMM, the
    softcap in place), then the row kernels of :func:`selected_logprobs` on it, keeping
    ``logp``, the entropy and the log-sum-exp (O(N)). The backward recomputes each chunk's
    logits (the same GEMM, the same bits), writes ``dx`` over them with the row kernels
    and adds the chunk's share to the three gradients: four GEMMs per chunk in all.

    Args:
      hidden: ``[..., H]`` last hidden states (float32, float16 or bfloat16, any strides).
      weight: ``[V, H]`` lm_head weight, ``hidden``'s dtype and device (a tied embedding
        works: it is the same ``[V, H]``).
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      bias: ``[V]`` lm_head bias in the weight's dtype, or None. A ``-inf`` entry masks its
        token (finite values and gradients; ``x = -softcap`` with a softcap).
      temperature: a positive Python float or a floating ``[...]`` (or 0-d) tensor, per
        row, as in :func:`selected_logprobs`.
      logit_scale: a positive Python number multiplying the logits (Cohere's
        ``logit_scale``; Granite's ``1 / logits_scaling``).
      logit_softcap: a positive Python number (Gemma 2's ``final_logit_softcapping``) or
        None (no softcap).
      return_entropy: also return the entropy of each row's distribution.
      chunk_rows: rows per chunk: memory beyond the inputs and gradients is one
        ``[chunk_rows, V]`` buffer in the weight's dtype (two in the backward with a
        softcap) plus O(N).
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``. ``"triton"`` (what
        ``"auto"`` picks for CUDA tensors) and ``"interpret"`` run the row kernels of
        :func:`selected_logprobs` on each chunk, eagerly (under ``torch.compile`` a
        ``ValueError``); ``"native"`` (CPU tensors' ``"auto"``) runs framework ops on the
        same chunks.
      check_ids: as in :func:`selected_logprobs` (ids checked against ``V = weight.shape[0]``,
        with ``vocab_group`` the global ``V``).
      vocab_group: a ``torch.distributed`` process group over which the lm_head is sharded
        by rows (tensor parallelism, Megatron's ``ColumnParallelLinear`` layout; see
        docs/vocab_parallel.md): rank ``r`` passes its contiguous block of the vocabulary,
        ``weight [V_r, H]`` and ``bias [V_r]``, in group-rank order (blocks may be uneven,
        each at least one row; ``V = sum V_r``). ``hidden``, ``action_ids`` (global ids in
        ``[0, V)``), ``mask`` and ``temperature`` are the same on every rank. Per chunk the
        ranks combine ``[chunk_rows]``-sized row statistics (one MAX and one SUM
        all-reduce: the row max, the sums of exponentials, the selected logit and the
        entropy's term); no ``[N, V]`` array is gathered. With ``check_ids`` the ranks
        first agree on their shapes: a rank whose inputs differ in shape makes every rank
        raise the same ``ValueError`` (naming it) instead of hanging. Runs eagerly (under
        ``torch.compile`` a ``ValueError``).

    Returns:
      ``logp`` float32 ``[...]``, or with ``return_entropy`` ``(logp, entropy)``, float32
      ``[...]`` each; 0 on inactive rows. Differentiable w.r.t. ``hidden``, ``weight`` and
      ``bias`` through both outputs. With ``vocab_group``: the outputs are the unsharded
      call's, bitwise the same on every rank; ``weight``'s and ``bias``'s gradients are
      this rank's rows of the unsharded ones; ``hidden``'s is the whole gradient on every
      rank, :math:`\sum_r du_r W_r` summed by one SUM all-reduce of ``[N, H]`` in the
      hidden states' dtype in the backward (so pass the hidden states as they are, not
      through Megatron's ``copy_to_tensor_model_parallel_region``, which would sum it
      again). Inactive rows keep every guarantee below on every rank. Inactive rows: whatever their hidden states hold (NaN,
      inf) and whatever their id, they enter no GEMM (``where(mask, hidden, 0)`` first),
      their ``d hidden`` is exactly 0 and they add nothing to ``d weight`` or ``d bias``.
      ``d weight`` accumulates over the chunks in the weight's dtype, ``d bias`` in
      float32. On the Triton backends a row's values are those of
      :func:`selected_logprobs` on its logits: deterministic and independent of the other
      rows, given the GEMM's bits (which are the BLAS library's, chosen per chunk shape).

    Precision: the GEMMs of float32 inputs run in float32 (IEEE), whatever
    ``torch.backends.cuda.matmul.allow_tf32`` / ``fp32_precision`` or
    ``torch.set_float32_matmul_precision`` say (set for the call only, on the host), as
    the JAX op runs ``Precision.HIGHEST``; the two frameworks agree.
    """
    return _linear_route.linear_selected_logprobs(
        hidden, weight, action_ids, mask, bias=bias, temperature=temperature,
        logit_scale=logit_scale, logit_softcap=logit_softcap, return_entropy=return_entropy,
        chunk_rows=chunk_rows, backend=backend, check_ids=check_ids, vocab_group=vocab_group,
    )


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    action_ids: torch.Tensor,
    mask: torch.Tensor,
    old_logps: Optional[torch.Tensor],
    advantages: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    chunk_rows: int = 2048,
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
    r""":func:`policy_loss` of the lm_head's logits, never holding them for all rows.

    The logits are those of :func:`linear_selected_logprobs`,
    :math:`x = c \tanh\left((h W^\top + b)\, s / c\right)` (:math:`(h W^\top + b)\, s`
    without a softcap), divided by the
    temperature in the loss. The rows go through ``chunk_rows`` at a time: a GEMM writes a
    chunk's logits into one reusable ``[chunk_rows, V]`` buffer, the fused policy-loss
    kernel turns them into ``g = d loss / d x`` in place, and two GEMMs give the chunk's
    rows of ``d loss / d hidden = du @ weight`` and add ``du.T @ hidden`` to ``d loss / d
    weight`` (``du = g * logit_scale * (1 - (x / softcap)^2)``; its column sums go to ``d
    loss / d bias``). The loss and the metrics are those of :func:`policy_loss` on the same
    logits (one metrics pass over all rows after the chunks).

    Args:
      hidden: ``[..., H]`` last hidden states (float32, float16 or bfloat16, any strides).
      weight: ``[V, H]`` lm_head weight, ``hidden``'s dtype and device (a tied embedding
        works: it is the same ``[V, H]``).
      bias, logit_scale, logit_softcap: the head's bias ``[V]`` and logit options, as in
        :func:`linear_selected_logprobs`.
      action_ids, mask, old_logps, advantages, ref_logps: as in :func:`policy_loss`, of the
        leading shape ``[...]``; the reference enters as log-probs only (reference logits
        would need the reference model's own hidden states).
      chunk_rows: rows per chunk. Memory beyond the gradients is one
        ``[chunk_rows, V]`` buffer in ``weight``'s dtype plus O(N): 0.58 GiB at the default
        2048 rows for V = 151,936 in bf16. Smaller saves memory; the fused kernel's time
        per row is flat from about 1024 rows up (H200 measurements: docs/performance.md).
      clip_eps ... rollout_bounds, log_ratio_bound, temperature, check_ids: as in
        :func:`policy_loss` (``ratio_level="token"`` only: GSPO's sequence ratio needs
        every row's log-prob before any gradient).
      backend: ``"auto"`` / ``"triton"`` on CUDA tensors, ``"interpret"`` on CPU tensors
        (Triton's interpreter): the chunks. ``"native"`` (what ``"auto"`` picks for CPU
        tensors) computes every row's logits at once (inactive rows' hidden states zeroed
        first) and runs :func:`policy_loss` on them: the same results, no memory saved.
      vocab_group: the lm_head sharded by rows over this process group, as in
        :func:`linear_selected_logprobs` (each rank its ``weight [V_r, H]`` / ``bias
        [V_r]``; everything else global). The loss takes :func:`policy_loss`'s two-pass
        route: :func:`linear_selected_logprobs` with the entropy in row chunks (on every
        backend; the entropy's gradient only with ``entropy_coef``), then the objective on
        the ``[N]`` log-probs; the gradients come in the backward, which recomputes each
        chunk's logits (four GEMMs per chunk).

    Returns:
      ``(loss, metrics)`` as :func:`policy_loss`; with ``vocab_group`` the same values on
      every rank, ``weight``'s and ``bias``'s gradients this rank's rows of the unsharded
      ones and ``hidden``'s the whole gradient on every rank (summed over the group, as in
      :func:`linear_selected_logprobs`). Differentiable w.r.t. ``hidden``,
      ``weight`` and ``bias`` (whichever requires a gradient): the gradients are computed
      in the forward and scaled by the upstream value in the backward, so the loss
      backpropagates once, on every backend (a second backward raises ``RuntimeError``).
      With ``loss_agg="none"`` (the per-token loss ``[...]``, whose upstream scales each
      row: a weight gradient sums every row's share, so it cannot be scaled afterwards) the
      chunks run :func:`linear_selected_logprobs` and the objective instead: two passes,
      the same gradients.
      ``d weight`` accumulates over chunks in ``weight``'s dtype (one
      rounding per chunk in bf16, as the materialised step rounds its one GEMM once),
      ``d bias`` in float32. Inactive rows get exactly zero ``d hidden`` and add nothing to
      ``d weight`` or ``d bias``, whatever their hidden states hold (NaN included). The
      GEMMs of float32 inputs run in float32 whatever the TF32 settings (as
      :func:`linear_selected_logprobs`). Runs eagerly: under ``torch.compile`` it is a
      ``ValueError`` on the Triton backends.
    """
    return _linear_route.linear_policy_loss(
        hidden, weight, action_ids, mask, old_logps, advantages, ref_logps=ref_logps,
        bias=bias, logit_scale=logit_scale, logit_softcap=logit_softcap,
        chunk_rows=chunk_rows, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
        dual_clip=dual_clip, ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator,
        loss_agg=loss_agg, loss_normalizer=loss_normalizer, objective=objective,
        entropy_coef=entropy_coef, kl_agg=kl_agg, entropy_agg=entropy_agg,
        kl_entropy_normalizer=kl_entropy_normalizer, kl_clamp=kl_clamp, segment_ids=segment_ids,
        importance_weights=importance_weights, log_ratio_bound=log_ratio_bound,
        temperature=temperature, backend=backend, check_ids=check_ids,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds, vocab_group=vocab_group,
    )
