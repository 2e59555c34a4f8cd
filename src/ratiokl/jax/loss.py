"""JAX entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Signatures and documentation; each function is one call into
``ratiokl.jax._route`` (``_linear_route`` for the two ops from hidden states), which validates the inputs once, queues the check of
active ids (a host check on concrete inputs, a ``checkify`` check under
tracing), runs the backend and reads the check.

Options that select code paths (``kl_estimator``, ``backend``,
``check_ids``) and a Python-float ``temperature`` are static Python values:
close over them (``jax.jit(lambda *a: loss.ratio_kl(*a, kl_estimator="k2"))``)
or mark them static. Arrays may be traced.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple, Union

import jax

from ratiokl.jax import _linear_route, _objective, _route
from ratiokl.jax._checks import Temperature
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

#: A coefficient a trainer may change every step: a Python number or a 0-d float array.
Coefficient = Union[float, jax.Array]

__all__ = ["linear_policy_loss", "linear_selected_logprobs", "policy_loss", "policy_objective",
           "ratio_kl", "selected_logprobs"]


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
      logits: ``[..., V]`` float32, float16 or bfloat16.
      action_ids: ``[...]`` int32 or int64 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      temperature: a positive Python float, or a floating ``[...]`` (or 0-d) array,
        per row; an entry that is not positive and finite on an active row is
        rejected like a bad id (``check_ids``) and otherwise makes its row NaN.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"`` (static).
        ``"interpret"`` is the ``"triton"`` backend with each kernel run by Triton's
        CPU interpreter (behind ``jax.pure_callback``; it needs torch and triton):
        for testing on a CPU, slow. It takes the same shapes, dtypes, options and
        transforms (``jit``, ``grad``, ``vmap``, ``vocab_axis``); ``"auto"`` never
        picks it.
      check_ids: with concrete inputs, check active ids (and a per-row
        temperature) on the host (read after the kernels are queued: the device
        does not wait) and raise ``ValueError`` naming the
        first bad position. Traced inputs (``jit``, ``vmap``) are never
        synchronised: a row with a bad active id or temperature gives NaN (and
        NaN gradient), and a call wrapped in ``jax.experimental.checkify.checkify``
        raises. False skips the host
        check for concrete inputs too (the NaN rows stay).
      vocab_axis: inside ``jax.shard_map``, the mesh axis (static string) that
        ``logits``' vocabulary dimension is mapped to: each device holds a
        contiguous equal block and ``action_ids`` are global (see
        docs/vocab_parallel.md). The result is replicated along that axis.

      return_entropy: also return the entropy (with ``vocab_axis`` too).

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
        check_ids=check_ids, vocab_axis=vocab_axis,
        return_entropy=return_entropy,
    )


def ratio_kl(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    kl_estimator: KLEstimator = "k3",
    temperature: Temperature = 1.0,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Tuple[jax.Array, jax.Array]:
    r"""Per-token importance ratio and KL penalty of the policy against a reference.

    With ``logp`` from :func:`selected_logprobs` (float32 math) and ``logp_ref`` the same
    on ``ref_logits`` (or the given ``ref_logps``):

    .. math::

        \mathrm{ratio} = e^{\log p - \log p_\mathrm{old}}, \qquad
        d = \log p_\mathrm{ref} - \log p, \qquad
        \mathrm{kl} = \begin{cases} -d & \text{k1} \\ d^2 / 2 & \text{k2} \\
                      e^{d} - d - 1 & \text{k3 (the default)} \end{cases}

    Args:
      policy_logits: ``[..., V]`` float32, float16 or bfloat16.
      ref_logits: reference-model logits of the same shape (any of those dtypes),
        or None when ``ref_logps`` is given. Evaluated under ``lax.stop_gradient``.
      action_ids: ``[...]`` int32 or int64 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens.
      old_logps: ``[...]`` floating log-probs of the behaviour policy.
      ref_logps: ``[...]`` floating reference log-probs, instead of ``ref_logits``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (static).
      temperature: a positive Python float, or a floating ``[...]`` array (per
        row); it scales the policy and the reference logits alike.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"`` (static; as in
        :func:`selected_logprobs`).
      check_ids: as in :func:`selected_logprobs`.
      vocab_axis: as in :func:`selected_logprobs`; ``policy_logits`` and
        ``ref_logits`` are both sharded that way.

    Returns:
      ``(ratio, kl)``, float32 ``[...]`` each. Inactive rows give ``ratio = 1``
      and ``kl = 0`` whatever they hold (NaN/inf logits, NaN ``old_logps``, any
      id). The gradient reaches ``policy_logits`` only, in its dtype
      (per row ``c * (onehot(a) - softmax(z)) / T`` with
      ``c = g_ratio * ratio + g_kl * dkl/dlogp``), exactly 0 on inactive rows;
      ``ref_logits``, ``ref_logps``, ``old_logps`` and ``temperature`` get none.

    References:
      J. Schulman et al., "Proximal Policy Optimization Algorithms" (2017),
      arXiv:1707.06347 -- the importance ratio.
      J. Schulman, "Approximating KL Divergence" (2020),
      http://joschu.net/blog/kl-approx.html -- the k1/k2/k3 estimators.
    """
    return _route.ratio_kl(
        policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps=ref_logps,
        kl_estimator=kl_estimator, temperature=temperature, backend=backend,
        check_ids=check_ids, vocab_axis=vocab_axis,
    )


def policy_loss(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: jax.Array,
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
    ``ratio_level="sequence"`` and ``vocab_axis``, which take the two-pass path
    (log-probs forward, gradient in the backward), as the native backends do.

    Args:
      policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps: as in
        :func:`ratio_kl`; ``ref_logits`` and ``ref_logps`` may both be None when
        ``kl_coef == 0``. ``old_logps`` None: on-policy, ``old_logp = sg(logp)`` (one
        optimisation step per rollout: ``r = 1`` in value, ``dr/dlogp = 1``; the ratio
        is never clipped and ``approx_kl`` is 0), as TRL and Liger do when the behaviour
        policy's log-probs were not computed; not with ``rollout_logps``.
      temperature, backend, check_ids, vocab_axis: as in :func:`ratio_kl`. Every option
        but ``loss_normalizer`` is a static Python value; arrays may be traced.
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      clip_eps: ratio floor ``1 - clip_eps``; clip_eps_high: ceiling
        ``1 + clip_eps_high`` (DAPO clip-higher; default ``clip_eps``).
        ``clip_eps``, ``clip_eps_high``, ``kl_coef`` and ``entropy_coef`` may be 0-d float arrays,
        traced under ``jit`` (a schedule or an adaptive KL controller: no
        recompile per value; not range-checked, as reading them would synchronise).
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
        number (> 0 rewards entropy, < 0 penalises it) or a 0-d float array (a schedule:
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
      inplace_grad: opt-in, fused (Triton) path only (elsewhere a ``ValueError``
        says where it works): the
        gradient's buffer aliases ``policy_logits``' (``input_output_aliases``),
        so a step needs no ``[N, V]`` gradient allocation -- where XLA can
        reuse the logits' buffer: donate them (``jax.jit(...,
        donate_argnums=...)``) or produce them inside the same ``jit`` and use
        them nowhere else; otherwise XLA copies them first (same values).

    Returns:
      ``(loss, metrics)``: a float32 0-d array (``loss_agg="none"``: float32 ``[...]``,
      exactly ``+0.0`` on inactive tokens, each token's gradient scaled by its own upstream
      value; a NaN upstream on an inactive token stays out), and float32 0-d arrays (stop-gradient)
      ``clip_fraction`` (= ``_low`` + ``_high``), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``kl_mean``
      ``approx_kl`` (mean of ``old_logp - logp``) and ``entropy_mean`` (mean ``H``),
      means over active tokens; with ``rollout_logps``, also the three rollout metrics
      above.
      Inactive tokens contribute nothing and get exactly zero gradient whatever
      they hold; no active token gives loss 0 and zero metrics, never NaN.

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
        check_ids=check_ids, vocab_axis=vocab_axis, inplace_grad=inplace_grad,
        rollout_logps=rollout_logps, rollout_correction=rollout_correction,
        rollout_bounds=rollout_bounds,
    )


def policy_objective(
    logps: jax.Array,
    old_logps: Optional[jax.Array],
    advantages: jax.Array,
    mask: jax.Array,
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
    segment_ids: Optional[jax.Array] = None,
    importance_weights: Optional[jax.Array] = None,
    rollout_logps: Optional[jax.Array] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
    rollout_bounds: Tuple[float, float] = DEFAULT_ROLLOUT_BOUNDS,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
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
    :func:`policy_loss` carries to the logits through ``d logp / d logits``. It runs ``jnp``
    ops on ``[...]``-sized arrays (no kernel, so no ``backend`` or ``temperature``: the
    log-probs carry the temperature they were computed with) and works under ``jit``,
    ``grad``, ``vjp``, ``vmap`` and ``shard_map``. The string options are static.

    Args:
      logps: ``[...]`` floating (float32, bfloat16, ...) log-probs of the sampled tokens
        under the policy being trained (the differentiated input); computed in float32.
      old_logps: ``[...]`` floating behaviour log-probs, or None (on-policy:
        ``old_logp = sg(logp)``, as in :func:`policy_loss`).
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens.
      ref_logps: ``[...]`` floating reference log-probs (under ``stop_gradient``); needed
        when ``kl_coef != 0`` (a ``ValueError`` naming it otherwise), else only logged
        (``kl_mean``).
      entropy: ``[...]`` floating per-token entropies of the policy (differentiable), or
        None. Needed when ``entropy_coef != 0`` (a ``ValueError`` naming ``entropy``
        otherwise); given, ``metrics["entropy_mean"]`` reports its mean.
      clip_eps ... log_ratio_bound: as in :func:`policy_loss`, ``loss_agg="none"`` included.

    Returns:
      ``(loss, metrics)``: the float32 0-d loss (``loss_agg="none"``: the per-token loss,
      float32 ``[...]``, exactly 0 on inactive tokens), and float32 0-d metrics as
      :func:`policy_loss`'s, under ``stop_gradient`` (``entropy_mean`` only when ``entropy``
      is given). The gradient reaches ``logps`` and, where the entropy bonus weighs in,
      ``entropy``, in their dtypes; never ``old_logps``, ``ref_logps``, ``advantages``,
      ``rollout_logps`` or ``importance_weights``. Inactive tokens: whatever any input
      holds there (NaN, inf), it reaches neither the loss, the metrics nor a gradient
      (those tokens' gradients are exactly 0): every input is selected with ``where``
      before any arithmetic. A NaN in an active token stays visible (a NaN loss).
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
    hidden: jax.Array,
    weight: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array] = None,
    *,
    bias: Optional[jax.Array] = None,
    temperature: Temperature = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_entropy: bool = False,
    chunk_rows: int = 2048,
    backend: BackendName = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Union[jax.Array, Tuple[jax.Array, jax.Array]]:
    r""":func:`selected_logprobs` (and the entropy) of the lm_head's logits, never holding them
    for all rows.

    ``ratiokl.torch.loss.linear_selected_logprobs`` in JAX: the same arguments, math and
    results (its docstring has them):

    .. math::

        x = c \tanh\left((h W^\top + b)\, s / c\right), \qquad
        \log p_a = \frac{x_a}{T} - \operatorname{logsumexp}(x / T), \qquad
        H = -\sum_v p_v \log p_v

    ``hidden [..., H]``, ``weight [V, H]`` and ``bias [V]`` (or None) share a float dtype;
    ``logit_scale`` (positive), ``logit_softcap`` (positive or None), ``return_entropy``,
    ``chunk_rows``, ``backend`` and ``check_ids`` are static. A ``jax.custom_vjp`` keeps
    ``logp``, the entropy and the log-sum-exp (O(N)); the full chunks of ``chunk_rows`` rows
    run in a ``lax.fori_loop`` (one ``[chunk_rows, V]`` logits array at a time) in the
    forward and again in the backward, which recomputes each chunk's logits and adds its
    share of ``d hidden``, ``d weight`` and ``d bias`` (the entropy's own gradient included;
    a cotangent nothing produced drops its term). Works under ``jit``, ``grad``, ``vjp``
    and ``vmap``. Backends: ``"triton"`` (``"auto"`` on a GPU) and ``"interpret"`` run the
    row kernels of :func:`selected_logprobs` on each chunk, ``"native"`` (``"auto"`` without
    a GPU) XLA's ops on the same chunks.

    Returns ``logp`` float32 ``[...]``, or ``(logp, entropy)``: 0 on inactive rows, whose
    hidden states enter no GEMM (``where(mask, hidden, 0)`` first: NaN and inf stay out),
    whose ``d hidden`` is exactly 0 and which add nothing to ``d weight`` / ``d bias``. A
    ``-inf`` bias entry masks its token (finite values and gradients).

    Precision: every GEMM of the op runs at ``Precision.HIGHEST`` with float32 accumulation,
    whatever ``jax_default_matmul_precision`` says (TF32-class by default on GPUs), so float32
    inputs get float32 GEMMs as in PyTorch.

    ``vocab_axis``: inside ``jax.shard_map``, the mesh axis (a static string) over which the
    lm_head is sharded by rows (tensor parallelism; see docs/vocab_parallel.md): device
    ``k`` of the axis holds ``weight [V / n, H]`` (``in_specs P(axis, None)``) and ``bias
    [V / n]`` (``P(axis)``), rows ``[k V / n, (k + 1) V / n)`` (``shard_map`` splits evenly:
    ``V`` a multiple of the axis size ``n``); ``hidden``, ``action_ids`` (global ids),
    ``mask`` and ``temperature`` are replicated along it. Per chunk one ``pmax`` and one
    ``psum`` of ``[chunk_rows]``-sized row statistics combine the blocks (no ``[N, V]``
    array is gathered). The outputs are the unsharded call's, the same on every device;
    ``weight``'s and ``bias``'s gradients are the device's rows of the unsharded ones;
    ``hidden``'s is the whole gradient on every device (the blocks' partial ``du_k W_k``
    summed by one ``psum`` of ``[N, H]``, which JAX places as the transpose of the
    ``pcast`` the op applies to the replicated hidden states; hidden states typed as
    varying over the axis get their device's partial, as JAX's typing asks). Needs
    ``check_vma=True`` (``shard_map``'s default) and ``weight`` / ``bias`` typed as varying
    over the axis; otherwise ``ValueError``. Inactive rows keep every guarantee above on
    every device; under ``jit`` an out-of-range active id (against the global ``V``) makes
    its row NaN, and a ``checkify``-wrapped call raises.
    """
    return _linear_route.linear_selected_logprobs(
        hidden, weight, action_ids, mask, bias=bias, temperature=temperature,
        logit_scale=logit_scale, logit_softcap=logit_softcap, return_entropy=return_entropy,
        chunk_rows=chunk_rows, backend=backend, check_ids=check_ids, vocab_axis=vocab_axis,
    )


def linear_policy_loss(
    hidden: jax.Array,
    weight: jax.Array,
    action_ids: jax.Array,
    mask: jax.Array,
    old_logps: Optional[jax.Array],
    advantages: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    bias: Optional[jax.Array] = None,
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
    loss_normalizer: Union[None, float, jax.Array] = None,
    objective: Objective = "ppo",
    entropy_coef: Coefficient = 0.0,
    kl_agg: Optional[TermAgg] = None,
    entropy_agg: Optional[TermAgg] = None,
    kl_entropy_normalizer: Union[None, float, jax.Array] = None,
    kl_clamp: Optional[float] = None,
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
    """:func:`policy_loss` of the lm_head's logits, never holding them for all rows.

    ``ratiokl.torch.loss.linear_policy_loss`` in JAX: the same arguments, math and results
    (its docstring has them), the logits those of :func:`linear_selected_logprobs`
    (``bias``, ``logit_scale``, ``logit_softcap`` static Python numbers but the bias). The full chunks of ``chunk_rows`` rows run in a
    ``lax.fori_loop``, so one ``[chunk_rows, V]`` logits buffer lives at a time, and the
    call traces under ``jit`` (``chunk_rows`` is static). ``hidden [..., H]`` and ``weight
    [V, H]`` share a float dtype; the reference enters as ``ref_logps`` only;
    ``ratio_level="token"`` only. Backends: ``"auto"`` / ``"triton"`` on a GPU,
    ``"interpret"`` (Triton's interpreter) anywhere: the chunks; ``"native"`` (what
    ``"auto"`` picks without a GPU) computes every row's logits at once (inactive rows'
    hidden states zeroed first) and runs :func:`policy_loss` on them: the same results, no
    memory saved.
    Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``: the gradients come from the
    forward (``d weight`` accumulated over chunks in ``weight``'s dtype) and the backward
    scales them by the upstream value; with ``loss_agg="none"`` (the per-token loss
    ``[...]``, whose cotangent scales each row) the chunks run
    :func:`linear_selected_logprobs` and the objective instead, two passes. Inactive rows
    get exactly zero ``d hidden`` and add nothing to ``d weight`` or ``d bias``, whatever
    their hidden states hold. The GEMMs run at ``Precision.HIGHEST`` (float32 inputs:
    float32 GEMMs, as in PyTorch).

    ``vocab_axis``: the lm_head sharded by rows over this mesh axis inside ``shard_map``, as
    in :func:`linear_selected_logprobs` (its layout, its ``check_vma=True``, its
    gradients: the device's rows of ``d weight`` / ``d bias``, the whole ``d hidden``). The
    loss takes :func:`policy_loss`'s two-pass route: :func:`linear_selected_logprobs` with
    the entropy in row chunks (on every backend; the entropy's gradient only with
    ``entropy_coef``), then the objective on the ``[N]`` log-probs, replicated along the
    axis; the gradients come in the backward, which recomputes each chunk's logits.
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
        rollout_bounds=rollout_bounds, vocab_axis=vocab_axis,
    )
