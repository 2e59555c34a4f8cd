"""The docstrings of ``policy_loss`` and ``policy_objective`` (see ``ratiokl._docs``)."""

POLICY_LOSS = r"""
    PPO/GRPO clipped policy loss with a KL penalty, aggregated to one number.

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
    ``ratio_level="sequence"`` and ``$group``, which take the two-pass path
    (log-probs forward, gradient in the backward), as the native backends do.

    Args:
      policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps: as in
        :func:`ratio_kl` (``mask`` None: all active); ``ref_logits`` and ``ref_logps`` may
        both be None when ``kl_coef == 0``. ``old_logps`` None: on-policy, ``old_logp = sg(logp)`` (one
        optimisation step per rollout: ``r = 1`` in value, ``dr/dlogp = 1``; the ratio
        is never clipped and ``approx_kl`` is 0), as TRL and Liger do when the behaviour
        policy's log-probs were not computed; not with ``rollout_logps``.
      temperature, backend, check_ids, $group: as in :func:`ratio_kl`.$static_options
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      clip_eps: ratio floor ``1 - clip_eps``.
      clip_eps_high: ceiling ``1 + clip_eps_high`` (DAPO clip-higher; default ``clip_eps``).
        ``clip_eps``, ``clip_eps_high``, ``kl_coef`` and ``entropy_coef`` may be 0-d float
        $coefficients
      dual_clip: ``c > 1`` caps the loss of ``A < 0`` tokens at ``-A*c``; None: off.
      ratio_cap: INTELLECT-2's ``delta > 1``, an upper cap on the ratio; with
        ``objective="cispo"`` the weight's ceiling, any number > 0 (TRL's ``epsilon_high``,
        which may be below 1); None: off.
      kl_coef, kl_estimator: KL weight and variant: ``"k1"``, ``"k2"``, ``"k3"``,
        ``"k1+"``/``"k3+"`` (value of k1/k3, gradient of k2), ``"k3-is"`` (k3 times r).
      loss_agg: ``"token-mean"``, ``"token-sum"``, ``"seq-mean-token-mean"``,
        ``"seq-mean-token-sum"``, ``"seq-mean-token-sum-norm"``, or ``"none"``: no
        aggregation, the per-token loss ``[...]`` (the term each mode weighs, GSPO's with the
        sequence ratio; not with ``loss_normalizer``), for a trainer's own reduction.
      loss_normalizer: replaces the aggregation's denominator (a global token or
        sequence count, or a constant): a positive number or a 0-d $array.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
      objective: ``"ppo"`` (the clipped surrogate above), ``"cispo"`` (clipped
        importance-sampling weight on the log-prob) or ``"sapo"`` (SAPO's soft gate in
        place of the clip: ``pg = -A * 4 / tau * sigmoid(tau * (r - 1))``, whose slope in
        ``r`` is 1 at ``r = 1``; the clip options, but for ``dual_clip`` / ``ratio_cap``,
        which it rejects, are unused and its clip fractions 0; takes the two-pass route);
        composes with every ``loss_agg``, KL variant and ``ratio_level`` (``"sequence"``:
        the weight clips, or the gate reads, ``s``).
      sapo_temperatures: ``objective="sapo"``'s ``(tau for A > 0, tau for A <= 0)``, two
        numbers > 0 (TRL's ``sapo_temperature_pos`` / ``_neg``); None: ``(1.0, 1.05)``,
        the paper's. A ``ValueError`` with another objective.
      entropy_coef: weight of the entropy bonus ``-entropy_coef * H`` in each token's
        loss, aggregated by the same ``loss_agg`` (verl's ``entropy_coeff``): any finite
        number (> 0 rewards entropy, < 0 penalises it) or a 0-d float $array (a schedule:
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
        and ``rollout_k3`` (the k3 estimate of KL(engine || old) over active tokens), and the
        trainer/sampler parity ``rollout_logp_off_1pct_fraction`` /
        ``rollout_logp_off_5pct_fraction``: the fraction of active tokens whose
        ``exp(logp - rollout_logp)`` (this call's log-prob against the engine's) lies
        outside ``[0.99, 1.01]`` / ``[0.95, 1.05]``, NaN counting as outside.
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
      inplace_grad: $inplace_grad

    Returns:
      ``(loss, metrics)``: a float32 0-d $array (``loss_agg="none"``: float32 ``[...]``;
      float64 loss and metrics for float64 ``policy_logits``, on the native backend only,
      every other floating input then read in float64), exactly ``+0.0`` on inactive
      tokens, each token's gradient scaled by its own upstream
      value; a NaN upstream on an inactive token stays out), and $metrics
      ``clip_fraction`` (= ``_low`` + ``_high``), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``kl_mean``
      ``approx_kl`` (mean of ``old_logp - logp``) and ``entropy_mean`` (mean ``H``),
      means over active tokens; with ``rollout_logps``, also the five rollout metrics
      above.
      Inactive tokens contribute nothing and get exactly zero gradient whatever
      they hold; no active token gives loss 0 and zero metrics, never NaN.$backprop_once

    References:
      Schulman et al. (2017) PPO, arXiv:1707.06347; Ye et al. (2019) dual-clip,
      arXiv:1912.09729; Yu et al. (2025) DAPO, arXiv:2503.14476; Liu et al.
      (2025) Dr. GRPO, arXiv:2503.20783; Zheng et al. (2025) GSPO,
      arXiv:2507.18071; Prime Intellect (2025) INTELLECT-2, arXiv:2505.07291; Yao et al.
      (2025) truncated importance sampling for the rollout mismatch (TIS); Ling Team (2025)
      IcePop (Ring-1T).
    """

POLICY_OBJECTIVE = r"""
    :func:`policy_loss` on per-token log-probs the trainer already holds (and their
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
    $runs

    Args:
      logps: ``[...]`` floating (float32, bfloat16, ...) log-probs of the sampled tokens
        under the policy being trained$differentiated; computed in float32, or in float64
        for float64 ``logps`` (every other floating input then read in float64).
      old_logps: ``[...]`` floating behaviour log-probs, or None (on-policy:
        ``old_logp = sg(logp)``, as in :func:`policy_loss`).
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      ref_logps: ``[...]`` floating reference log-probs ($detached); needed when
        ``kl_coef != 0`` (a ``ValueError`` naming it otherwise), else only logged
        (``kl_mean``).
      entropy: ``[...]`` floating per-token entropies of the policy$differentiable, or None.
        Needed when ``entropy_coef != 0`` (a ``ValueError`` naming ``entropy`` otherwise);
        given, ``metrics["entropy_mean"]`` reports its mean.
      clip_eps ... log_ratio_bound: as in :func:`policy_loss`, ``loss_agg="none"`` included.

    Returns:
      ``(loss, metrics)``: the float32 0-d loss (``loss_agg="none"``: the per-token loss,
      float32 ``[...]``, exactly 0 on inactive tokens; float64 loss and metrics for
      float64 ``logps``), and $objective_metrics
      (``entropy_mean`` only when ``entropy`` is given). The gradient
      reaches ``logps`` and, where the entropy bonus weighs in, ``entropy``, in their
      dtypes; never ``old_logps``, ``ref_logps``, ``advantages``, ``rollout_logps`` or
      ``importance_weights``. Inactive tokens: whatever any input holds there (NaN, inf),
      it reaches neither the loss, the metrics nor a gradient (those tokens' gradients are
      exactly 0): every input is selected with ``where`` before any arithmetic. A NaN in an
      active token stays visible (a NaN loss).
    """

TEXT = {"policy_loss": POLICY_LOSS, "policy_objective": POLICY_OBJECTIVE}

PIECES = {
    "torch": {
        "static_options": "",
        "coefficients": """tensors on the logits' device (a schedule or an adaptive KL
        controller: traced by ``torch.compile``, no recompile per value; not
        range-checked, as reading them would synchronise).""",
        "inplace_grad": """opt-in, fused path in eager mode only (elsewhere, where the
        two-pass route writes a new gradient, a ``ValueError`` says where it works):
        the forward writes ``d loss / d policy_logits`` into ``policy_logits``'
        own (contiguous) buffer, so a step needs no ``[N, V]`` gradient
        allocation. The logits are consumed: afterwards they hold the gradient
        (scaled by the upstream value at ``backward``), another autograd node
        that saved them fails loudly, and the loss backpropagates once.""",
        "metrics": "detached float32 0-d tensors",
        "backprop_once": """
      The loss backpropagates once per call on every backend (the one-kernel path
      scales its stored gradient in place): a second backward through it
      (``retain_graph=True``) raises ``RuntimeError``; call ``policy_loss`` again. Float64
      logits, which run on the native backend only, are the exception: their loss
      backpropagates any number of times, as ``torch.autograd.gradcheck`` needs.""",
        "runs": """framework ops on ``[...]``-sized tensors (no kernel, so no ``backend`` or
    ``temperature``: the log-probs carry the temperature they were computed with), under
    autograd and ``torch.compile``; being plain autograd, its loss may be backpropagated
    more than once (``retain_graph=True``).""",
        "differentiated": ", with autograd",
        "detached": "detached",
        "differentiable": ", with autograd",
        "objective_metrics": "detached float32 0-d metrics as :func:`policy_loss`'s",
    },
    "jax": {
        "static_options": """ Every option
        but ``loss_normalizer`` is a static Python value; arrays may be traced.""",
        "coefficients": """arrays, traced under ``jit`` (a schedule or an adaptive KL controller: no
        recompile per value; not range-checked, as reading them would synchronise).""",
        "inplace_grad": """opt-in, fused (Triton) path only (elsewhere a ``ValueError``
        says where it works): the
        gradient's buffer aliases ``policy_logits``' (``input_output_aliases``),
        so a step needs no ``[N, V]`` gradient allocation -- where XLA can
        reuse the logits' buffer: donate them (``jax.jit(...,
        donate_argnums=...)``) or produce them inside the same ``jit`` and use
        them nowhere else; otherwise XLA copies them first (same values).""",
        "metrics": "float32 0-d arrays (stop-gradient)",
        "backprop_once": "",
        "runs": """``jnp`` ops on ``[...]``-sized arrays (no kernel, so no ``backend`` or
    ``temperature``: the log-probs carry the temperature they were computed with) and
    works under ``jit``, ``grad``, ``vjp``, ``vmap`` and ``shard_map``. The string
    options are static.""",
        "differentiated": " (the differentiated input)",
        "detached": "under ``stop_gradient``",
        "differentiable": " (differentiable)",
        "objective_metrics":
            "float32 0-d metrics as :func:`policy_loss`'s, under ``stop_gradient``",
    },
}
