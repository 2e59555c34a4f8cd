"""The docstrings of the two ops from hidden states (see ``ratiokl._docs``)."""

LINEAR_SELECTED_LOGPROBS = r"""
    :func:`selected_logprobs` (and the entropy) of the lm_head's logits, never holding them
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

    $chunks

    Args:
      hidden: ``[..., H]`` last hidden states (float32, float16 or bfloat16$strides).
      weight: ``[V, H]`` lm_head weight on ``hidden``'s device, in ``hidden``'s dtype or
        float32 (a float32 head over half-precision hidden states), or half precision
        under float32 hidden states (a tied embedding works: it is the same ``[V, H]``).
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      bias: ``[V]`` lm_head bias in the weight's dtype, or None. A ``-inf`` entry masks its
        token (finite values and gradients; ``x = -softcap`` with a softcap).
      temperature: a positive Python float or a floating ``[...]`` (or 0-d) $array, per
        row, as in :func:`selected_logprobs`.
      logit_scale: a positive Python number multiplying the logits (Cohere's
        ``logit_scale``; Granite's ``1 / logits_scaling``)$static.
      logit_softcap: a positive Python number (Gemma 2's ``final_logit_softcapping``) or
        None (no softcap)$static.
      logits_dtype: ``"float32"`` (default): each chunk's logits are the GEMM's float32
        accumulator, never rounded to the inputs' dtype: the log-probs of an fp32 head on
        the inputs' own values, at the cost of the bf16 GEMMs (bf16 operands' products are
        exact in float32). ``"input"``: the logits rounded to the inputs' dtype first, as a
        bf16 ``F.linear`` / ``jnp.dot`` writes them: choose it to reproduce a bf16 head bit
        for bit (a sampler that runs one). The trainer and its sampler should run the same
        head precision: their log-probs then differ by the kernels' rounding only. Errors
        and times: docs/api.md, "The lm_head's precision"$static.
      fp32_matmul: how the GEMMs with a float32 operand (a float32 weight, as TRL's
        ``cast_lm_head_to_fp32`` keeps it, or float32 hidden states) run on a GPU:
        ``"bf16x3"`` (default) splits each float32 operand into three bfloat16 pieces and
        sums their products in float32 on the tensor cores (a float32 GEMM's precision;
        three GEMMs for bf16 hidden states and a float32 weight, six for two float32
        operands); ``"ieee"``: float32 GEMMs; ``"tf32"``: TF32 ones (10-bit mantissas). The
        gradient GEMMs take ``d loss / d logits`` in bfloat16 with the first piece, as the
        fused heads do. On a CPU every float32 GEMM is a float32 one$static.
      grad_weight_accum: how ``d weight`` sums over the row chunks. ``"float32"``
        (default): in a float32 ``[V, H]`` buffer, rounded once to the weight's dtype at
        the end (``V * H * 4`` bytes, 2.3 GiB at V = 151,936, H = 4,096: that much more at
        the peak than ``"weight"``). ``"weight"``: in the weight's dtype, each chunk's share
        added with one rounding (a bf16 weight: one bf16 rounding per chunk). Errors and
        memory: docs/api.md, "The lm_head's precision"$static.
      return_entropy: also return the entropy of each row's distribution$static.
      chunk_rows: $chunk_rows
      backend: $backend
      check_ids: as in :func:`selected_logprobs` (ids checked against ``V = weight.shape[0]``,
        with ``$group`` the global ``V``)$static.
      $group: $vocab

    Returns:
      ``logp`` float32 ``[...]``, or with ``return_entropy`` ``(logp, entropy)``, float32
      ``[...]`` each; 0 on inactive rows. Differentiable w.r.t. ``hidden``, ``weight`` and
      ``bias`` through both outputs.$vocab_returns
      Inactive rows: whatever their hidden states hold (NaN, inf) and whatever their id,
      they enter no GEMM (``where(mask, hidden, 0)`` first), their ``d hidden`` is exactly
      0 and they add nothing to ``d weight`` or ``d bias``.$accumulation

    Precision: $precision
    """

LINEAR_POLICY_LOSS = r"""
    :func:`policy_loss` of the lm_head's logits, never holding them for all rows.

    The logits are those of :func:`linear_selected_logprobs`,
    :math:`x = c \tanh\left((h W^\top + b)\, s / c\right)` (:math:`(h W^\top + b)\, s`
    without a softcap), divided by the
    temperature in the loss. $loss_chunks
    The loss and the metrics are those of :func:`policy_loss` on the same logits$metrics_pass.

    Args:
      hidden: ``[..., H]`` last hidden states (float32, float16 or bfloat16$strides).
      weight: ``[V, H]`` lm_head weight on ``hidden``'s device, in ``hidden``'s dtype or
        float32 (a float32 head over half-precision hidden states), or half precision
        under float32 hidden states (a tied embedding works: it is the same ``[V, H]``).
      bias, logit_scale, logit_softcap, logits_dtype, fp32_matmul, grad_weight_accum: the
        head's bias ``[V]``, logit options and precision, as in
        :func:`linear_selected_logprobs`$static_head.
      action_ids, mask, old_logps, advantages, ref_logps: as in :func:`policy_loss`, of the
        leading shape ``[...]`` (``mask`` None: all active); the reference enters as
        log-probs only (reference logits would need the reference model's own hidden
        states).
      chunk_rows: $loss_chunk_rows
      clip_eps ... rollout_bounds, log_ratio_bound, temperature, check_ids: as in
        :func:`policy_loss` (``ratio_level="token"`` only: GSPO's sequence ratio needs
        every row's log-prob before any gradient).
      backend: $loss_backend computes every row's logits at once (inactive rows'
        hidden states zeroed first) and runs :func:`policy_loss` on them: the same
        results, no memory saved.
      $group: $loss_vocab The loss takes :func:`policy_loss`'s two-pass
        route: :func:`linear_selected_logprobs` with the entropy in row chunks (on every
        backend; the entropy's gradient only with ``entropy_coef``), then the objective on
        the ``[N]`` log-probs$replicated; the gradients come in the backward, which
        recomputes each chunk's logits$four_gemms.

    Returns:
      ``(loss, metrics)`` as :func:`policy_loss`$loss_vocab_returns
      Differentiable w.r.t. ``hidden``, ``weight`` and ``bias``$which: the gradients are
      computed in the forward and scaled by the upstream value in the backward$once.
      With ``loss_agg="none"`` (the per-token loss ``[...]``, whose upstream scales each
      row: a weight gradient sums every row's share, so it cannot be scaled afterwards) the
      chunks run :func:`linear_selected_logprobs` and the objective instead: two passes,
      the same gradients.
      ``d weight`` accumulates over the chunks as ``grad_weight_accum`` says (float32 by
      default, rounded once)$loss_accumulation.
      Inactive rows get exactly zero ``d hidden`` and add nothing to ``d weight`` or
      ``d bias``, whatever their hidden states hold$nan_included. $loss_precision
    """

TEXT = {"linear_selected_logprobs": LINEAR_SELECTED_LOGPROBS,
        "linear_policy_loss": LINEAR_POLICY_LOSS}

PIECES = {
    "torch": {
        # linear_selected_logprobs
        "chunks": """The rows go through ``chunk_rows`` at a time: per chunk one GEMM into a
    reusable ``[chunk_rows, V]`` float32 buffer (``logits_dtype``; the bias, scale and
    softcap in place), then the row kernels of :func:`selected_logprobs` on it, keeping
    ``logp``, the entropy and the log-sum-exp (O(N)). The backward recomputes each chunk's
    logits (the same GEMM, the same bits), writes ``dx`` with the row kernels (in the inputs'
    half-precision dtype on a GPU) and adds the chunk's share to the three gradients: four
    GEMMs per chunk in all.""",
        "chunk_rows": """rows per chunk; None (default): as many as keep the chunk's logits
        and their gradient within 1 GiB (``ratiokl.spec.CHUNK_BYTES``; 1152 rows at V =
        151,936 with float32 logits and a bf16 gradient), a multiple of 64. Memory beyond
        the inputs and gradients is that buffer plus O(N).""",
        "backend": """``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``. ``"triton"`` (what
        ``"auto"`` picks for CUDA tensors) and ``"interpret"`` run the row kernels of
        :func:`selected_logprobs` on each chunk, eagerly (under ``torch.compile`` a
        ``ValueError``); ``"native"`` (CPU tensors' ``"auto"``) runs framework ops on the
        same chunks.""",
        "vocab": """a ``torch.distributed`` process group over which the lm_head is sharded
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
        ``torch.compile`` a ``ValueError``).""",
        "vocab_returns": r""" With ``vocab_group``: the outputs are the unsharded
      call's, bitwise the same on every rank; ``weight``'s and ``bias``'s gradients are
      this rank's rows of the unsharded ones; ``hidden``'s is the whole gradient on every
      rank, :math:`\sum_r du_r W_r` summed by one SUM all-reduce of ``[N, H]`` in the
      hidden states' dtype in the backward (so pass the hidden states as they are, not
      through Megatron's ``copy_to_tensor_model_parallel_region``, which would sum it
      again). Inactive rows keep every guarantee below on every rank.""",
        "accumulation": """
      ``d weight`` accumulates over the chunks as ``grad_weight_accum`` says, ``d bias``
      in float32. On the Triton backends a row's values are those of
      :func:`selected_logprobs` on its logits: deterministic and independent of the other
      rows, given the GEMM's bits (which are the BLAS library's, chosen per chunk shape).""",
        "precision": """the logits are float32 (``logits_dtype``); the GEMMs of float32
    operands run as ``fp32_matmul`` says, whatever ``torch.backends.cuda.matmul.allow_tf32``
    / ``fp32_precision`` or ``torch.set_float32_matmul_precision`` say (set for the call
    only, on the host), as the JAX op's; the two frameworks agree.""",
        # linear_policy_loss
        "loss_chunks": """The rows go through ``chunk_rows`` at a time: a GEMM writes a
    chunk's float32 logits into one reusable ``[chunk_rows, V]`` buffer, the fused
    policy-loss kernel turns them into ``g = d loss / d x`` (in the inputs' half-precision
    dtype, into a second buffer, on a GPU; in place otherwise), and two GEMMs give the chunk's
    rows of ``d loss / d hidden = du @ weight`` and add ``du.T @ hidden`` to ``d loss / d
    weight`` (``du = g * logit_scale * (1 - (x / softcap)^2)``; its column sums go to ``d
    loss / d bias``).""",
        "metrics_pass": " (one metrics pass over all rows after the chunks)",
        "static_head": "",
        "loss_chunk_rows": """rows per chunk; None (default): sized by bytes, as in
        :func:`linear_selected_logprobs` (the float32 logits and their gradient within 1
        GiB). Memory beyond the gradients is that buffer plus O(N).""",
        "loss_backend": """``"auto"`` / ``"triton"`` on CUDA tensors, ``"interpret"`` on CPU tensors
        (Triton's interpreter): the chunks. ``"native"`` (what ``"auto"`` picks for CPU
        tensors)""",
        "loss_vocab": """the lm_head sharded by rows over this process group, as in
        :func:`linear_selected_logprobs` (each rank its ``weight [V_r, H]`` / ``bias
        [V_r]``; everything else global).""",
        "replicated": "",
        "four_gemms": " (four GEMMs per chunk)",
        "loss_vocab_returns": """; with ``vocab_group`` the same values on
      every rank, ``weight``'s and ``bias``'s gradients this rank's rows of the unsharded
      ones and ``hidden``'s the whole gradient on every rank (summed over the group, as in
      :func:`linear_selected_logprobs`).""",
        "which": " (whichever requires a gradient)",
        "once": """, so the loss
      backpropagates once, on every backend (a second backward raises ``RuntimeError``)""",
        "loss_accumulation": """ (``"native"``'s one GEMM over every row
      rounds once either way), ``d bias`` in float32""",
        "nan_included": " (NaN included)",
        "loss_precision": """The
      logits are float32 and the float32 operands' GEMMs run as ``fp32_matmul`` says,
      whatever the TF32 settings (as :func:`linear_selected_logprobs`). Runs eagerly: under ``torch.compile`` it is a
      ``ValueError`` on the Triton backends.""",
    },
    "jax": {
        # linear_selected_logprobs
        "chunks": """A ``jax.custom_vjp`` keeps ``logp``, the entropy and the log-sum-exp
    (O(N)); the full chunks of ``chunk_rows`` rows run in a ``lax.fori_loop`` (one
    ``[chunk_rows, V]`` logits array at a time) in the forward and again in the backward,
    which recomputes each chunk's logits and adds its share of ``d hidden``, ``d weight``
    and ``d bias`` (the entropy's own gradient included; a cotangent nothing produced
    drops its term).
    Works under ``jit``, ``grad``, ``vjp`` and ``vmap``.""",
        "chunk_rows": """rows per chunk (static); None (default): sized by bytes as in
        PyTorch (``ratiokl.spec.CHUNK_BYTES``): one ``[chunk_rows, V]`` logits array at a
        time.""",
        "backend": """``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"`` (static).
        ``"triton"`` (``"auto"`` on a GPU) and ``"interpret"`` run the row kernels of
        :func:`selected_logprobs` on each chunk, ``"native"`` (``"auto"`` without a GPU)
        XLA's ops on the same chunks.""",
        "vocab": """inside ``jax.shard_map``, the mesh axis (a static string) over which
        the lm_head is sharded by rows (tensor parallelism; see docs/vocab_parallel.md):
        device ``k`` of the axis holds ``weight [V / n, H]`` (``in_specs P(axis, None)``)
        and ``bias [V / n]`` (``P(axis)``), rows ``[k V / n, (k + 1) V / n)``
        (``shard_map`` splits evenly: ``V`` a multiple of the axis size ``n``);
        ``hidden``, ``action_ids`` (global ids), ``mask`` and ``temperature`` are
        replicated along it. Per chunk one ``pmax`` and one ``psum`` of
        ``[chunk_rows]``-sized row statistics combine the blocks (no ``[N, V]`` array is
        gathered). The outputs are the unsharded call's, the same on every device;
        ``weight``'s and ``bias``'s gradients are the device's rows of the unsharded ones;
        ``hidden``'s is the whole gradient on every device (the blocks' partial ``du_k
        W_k`` summed by one ``psum`` of ``[N, H]``, which JAX places as the transpose of
        the ``pcast`` the op applies to the replicated hidden states; hidden states typed
        as varying over the axis get their device's partial, as JAX's typing asks). Needs
        ``check_vma=True`` (``shard_map``'s default) and ``weight`` / ``bias`` typed as
        varying over the axis; otherwise ``ValueError``. Inactive rows keep every
        guarantee below on every device; under ``jit`` an out-of-range active id
        (against the global ``V``) makes its row NaN, and a ``checkify``-wrapped call
        raises.""",
        "vocab_returns": "",
        "accumulation": "",
        "precision": """the logits are float32 (``logits_dtype``); every GEMM of the op
    accumulates in float32, and those of float32 operands run as ``fp32_matmul`` says
    (``"ieee"``: ``Precision.HIGHEST``), whatever ``jax_default_matmul_precision`` says
    (TF32-class by default on GPUs), as in PyTorch.""",
        # linear_policy_loss
        "loss_chunks": """The full chunks of ``chunk_rows`` rows run in a
    ``lax.fori_loop``, so one ``[chunk_rows, V]`` logits buffer lives at a time, and the
    call traces under ``jit``.""",
        "metrics_pass": "",
        "static_head": " (``logit_scale`` and ``logit_softcap`` static Python numbers)",
        "loss_chunk_rows": "rows per chunk (static); None: sized by bytes.",
        "loss_backend": """``"auto"`` / ``"triton"`` on a GPU, ``"interpret"`` (Triton's
        interpreter) anywhere: the chunks; ``"native"`` (what ``"auto"`` picks without a
        GPU)""",
        "loss_vocab": """the lm_head sharded by rows over this mesh axis inside ``shard_map``,
        as in :func:`linear_selected_logprobs` (its layout, its ``check_vma=True``, its
        gradients: the device's rows of ``d weight`` / ``d bias``, the whole ``d
        hidden``).""",
        "replicated": ", replicated along the axis",
        "four_gemms": "",
        "loss_vocab_returns": ".",
        "which": "",
        "once": "",
        "loss_accumulation": "",
        "nan_included": "",
        "loss_precision": """The logits are
      float32 and the float32 operands' GEMMs run as ``fp32_matmul`` says, as in
      PyTorch.""",
    },
}
