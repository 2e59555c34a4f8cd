"""The docstrings of ``selected_logprobs`` and ``ratio_kl`` (see ``ratiokl._docs``)."""

SELECTED_LOGPROBS = r"""
    Log-probability of the sampled action per token: ``logp = z[a] - logsumexp(z)``.

    With :math:`z = \mathrm{logits} / T` (row by row), computed in float32 for float32,
    float16 and bfloat16 logits, whatever the other inputs' dtypes:

    .. math::

        \log p_a = z_a - \log \sum_v e^{z_v}

    and, with ``return_entropy``, the entropy of the same distribution ``p = softmax(z)``
    from the same read of the logits (a running ``sum exp(z - m) * z`` beside the
    log-sum-exp):

    .. math::

        H = -\sum_v p_v \log p_v = \log \sum_v e^{z_v} - \sum_v p_v z_v, \qquad
        \frac{\partial H}{\partial\, \mathrm{logits}_v} = -\frac{p_v (\log p_v + H)}{T}

    Float64 logits are computed in float64 on the native backend$wide_backend:
    every output and the gradient are then float64, and the other floating inputs are read
    in float64. ``"triton"`` and ``"interpret"`` (float32 kernels) and ``$group`` refuse
    them with a ``TypeError`` naming the argument.

    Args:
      logits: ``[..., V]`` float32, float16 or bfloat16$strides; float64 on the native
        backend.
      action_ids: ``[...]`` int64 or int32 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      temperature: a positive Python float, or a floating ``[...]`` (or 0-d) $array,
        per row; an entry that is not positive and finite on an active row is
        rejected like a bad id (``check_ids``) and otherwise makes its row NaN.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``$backend
      check_ids: $check_ids
      $group: $vocab
      return_entropy: also return the entropy (with ``$group`` too).

    Returns:
      ``logp``: float32 ``[...]`` (float64 for float64 logits); exactly 0 on inactive
      rows. The gradient
      ``g * (onehot(a) - softmax(z)) / T`` reaches ``logits`` in its dtype, and
      is exactly 0 on inactive rows whatever they hold (NaN, inf, any id).
      A NaN logit on an active row makes that row NaN only; ``-inf`` logits at
      other tokens (vocabulary masking) are valid.

      With ``return_entropy``: ``(logp, entropy)``, ``entropy`` as ``logp``, 0 on
      inactive rows (its gradient there exactly 0 too); a ``-inf`` logit contributes 0
      to it and to its gradient (never ``0 * -inf``); a NaN logit makes the row NaN.

    See :func:`ratio_kl` for the references.
    """

RATIO_KL = r"""
    Per-token importance ratio and KL penalty of the policy against a reference.

    With ``logp`` from :func:`selected_logprobs` (float32 math; float64 for float64
    ``policy_logits``, on the native backend only, as there) and ``logp_ref`` the same on
    ``ref_logits`` (or the given ``ref_logps``):

    .. math::

        \mathrm{ratio} = e^{\log p - \log p_\mathrm{old}}, \qquad
        d = \log p_\mathrm{ref} - \log p, \qquad
        \mathrm{kl} = \begin{cases} -d & \text{k1} \\ d^2 / 2 & \text{k2} \\
                      e^{d} - d - 1 & \text{k3 (the default)} \end{cases}

    Args:
      policy_logits: ``[..., V]`` float32, float16 or bfloat16$strides; float64 on the
        native backend.
      ref_logits: reference-model logits of the same shape (any of those dtypes),
        or None when ``ref_logps`` is given. Evaluated $no_grad.
      action_ids: ``[...]`` int64 or int32 sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      old_logps: ``[...]`` floating log-probs of the behaviour policy.
      ref_logps: ``[...]`` floating reference log-probs, instead of ``ref_logits``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``$static.
      temperature: a positive Python float, or a floating ``[...]`` $array (per
        row); it scales the policy and the reference logits alike.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``$backend_as
      check_ids: as in :func:`selected_logprobs`.
      $group: as in :func:`selected_logprobs`; ``policy_logits`` and
        ``ref_logits`` are both sharded that way.

    Returns:
      ``(ratio, kl)``, float32 ``[...]`` each (float64 for float64 ``policy_logits``).
      Inactive rows give ``ratio = 1`` and ``kl = 0`` whatever they hold (NaN/inf
      logits, NaN ``old_logps``, any id). The gradient reaches ``policy_logits`` only, in
      its dtype (per row ``c * (onehot(a) - softmax(z)) / T`` with
      ``c = g_ratio * ratio + g_kl * dkl/dlogp``), exactly 0 on inactive rows;
      $no_grad_inputs get none.

    References:
      J. Schulman et al., "Proximal Policy Optimization Algorithms" (2017),
      arXiv:1707.06347 -- the importance ratio.
      J. Schulman, "Approximating KL Divergence" (2020),
      http://joschu.net/blog/kl-approx.html -- the k1/k2/k3 estimators.
    """

TEXT = {"selected_logprobs": SELECTED_LOGPROBS, "ratio_kl": RATIO_KL}

PIECES = {
    "torch": {
        "backend": ".",
        "check_ids": """check active ids (and a per-row temperature) and raise
        ``ValueError`` naming the first bad position. The check is queued before
        the kernels and read after them, so the GPU never waits for the host; the
        call returns once the GPU has reached it. Under ``torch.compile`` it is an op
        of the compiled graph, run before the kernels (on a GPU one host sync there).
        False (required inside a CUDA graph capture, and under ``torch.compile`` with
        ``vocab_group``, where True raises a ``ValueError`` saying so): no host read,
        and a row with a bad active id or temperature gives NaN (and NaN gradient), as
        it does whether checked or not.""",
        "vocab": """a ``torch.distributed`` process group over which ``logits``
        is sharded along the vocabulary (rank r holds a contiguous column
        block, in rank order; see docs/vocab_parallel.md). ``action_ids`` are
        global and every input but the logits is identical on every rank.""",
        "no_grad": "without autograd",
        "backend_as": ".",
        "no_grad_inputs": "``ref_logits``, ``ref_logps`` and ``old_logps``",
    },
    "jax": {
        "backend": """ (static).
        ``"interpret"`` is the ``"triton"`` backend with each kernel run by Triton's
        CPU interpreter (behind ``jax.pure_callback``; it needs torch and triton):
        for testing on a CPU, slow. It takes the same shapes, dtypes, options and
        transforms (``jit``, ``grad``, ``vmap``, ``vocab_axis``); ``"auto"`` never
        picks it.""",
        "check_ids": """with concrete inputs, check active ids (and a per-row
        temperature) on the host (read after the kernels are queued: the device
        does not wait) and raise ``ValueError`` naming the
        first bad position. Traced inputs (``jit``, ``vmap``) are never
        synchronised: a row with a bad active id or temperature gives NaN (and
        NaN gradient), and a call wrapped in ``jax.experimental.checkify.checkify``
        raises. False skips the host
        check for concrete inputs too (the NaN rows stay).""",
        "vocab": """inside ``jax.shard_map``, the mesh axis (static string) that
        ``logits``' vocabulary dimension is mapped to: each device holds a
        contiguous equal block and ``action_ids`` are global (see
        docs/vocab_parallel.md). The result is replicated along that axis.""",
        "no_grad": "under ``lax.stop_gradient``",
        "backend_as": """ (static; as in
        :func:`selected_logprobs`).""",
        "no_grad_inputs": "``ref_logits``, ``ref_logps``, ``old_logps`` and ``temperature``",
    },
}
