"""PyTorch entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Each public function runs the same steps, kept in small private helpers:
validate (``_checks``) -> flatten ``[..., V] -> [N, V]`` -> queue the check of
active ids (skipped by ``check_ids=False``) -> dispatch to a backend
(``_dispatch``), which queues the kernels -> read the check's result (the one
host sync; the GPU keeps running what was queued) -> reshape back to ``[...]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Optional, Tuple, Union

import torch

from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND, kl_estimator_code, policy_loss_options
from ratiokl.torch import _checks, _dispatch, _objective, _vocab_parallel

__all__ = ["policy_loss", "ratio_kl", "selected_logprobs"]

Temperature = Union[float, torch.Tensor]


@dataclass(frozen=True)
class _Rows:
    """Validated inputs with the leading shape flattened to ``N`` rows."""

    lead: Tuple[int, ...]  # the caller's leading shape [...]
    logits: torch.Tensor  # [N, V] policy logits (a view where possible)
    ids: torch.Tensor  # [N] integer
    mask: torch.Tensor  # [N] bool
    temperature: Temperature  # Python float, or float32 [N] detached
    device: torch.device
    check: Optional[_checks.ActiveCheck]  # the host check, read after the launches

    def checked(self, result):
        """``result`` once the host check (if any) passed: raises ``ValueError`` otherwise."""
        if self.check is not None:
            self.check.raise_if_bad()
        return result


def _flat_rows(values: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A detached float32 ``[N]`` view/copy of a per-token tensor (None passes through)."""
    return None if values is None else values.detach().reshape(-1).float()


def _prepare(
    logits: torch.Tensor,
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor],
    temperature: Temperature,
    check_ids: bool,
    sharded: bool = False,
    **per_token: Optional[torch.Tensor],
) -> _Rows:
    """Validate, flatten and (if ``check_ids``) range-check the shared inputs.

    ``per_token`` holds the other tensors of the call (by argument name) so that
    their device is checked too; their own validation is the caller's.
    """
    logits = _checks.check_logits("policy_logits", logits)
    lead = tuple(logits.shape[:-1])
    ids = _checks.check_ids(action_ids, lead)
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=logits.device)
    mask = _checks.check_mask(mask, lead)
    temperature = _checks.check_temperature(temperature, lead)
    device = _checks.check_same_device(
        policy_logits=logits,
        action_ids=ids,
        mask=mask,
        temperature=temperature if isinstance(temperature, torch.Tensor) else None,
        **per_token,
    )
    check = None
    if check_ids:  # sharded logits: the ids are checked against the global V later
        check = _checks.ActiveCheck(ids, mask, None if sharded else logits.shape[-1],
                                    temperature)
    if isinstance(temperature, torch.Tensor):
        temperature = _checks.poison_bad_temperature(_flat_rows(temperature))
    return _Rows(
        lead=lead,
        logits=logits.reshape(-1, logits.shape[-1]),
        ids=ids.reshape(-1),
        mask=mask.reshape(-1),
        temperature=temperature,
        device=device,
        check=check,
    )


def _check_reference(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    ref_logps: Optional[torch.Tensor],
) -> None:
    """Exactly one of ``ref_logits`` (policy's shape) and ``ref_logps`` (leading shape)."""
    if (ref_logits is None) == (ref_logps is None):
        raise ValueError(
            "pass exactly one of `ref_logits` (reference-model logits [..., V]) and "
            "`ref_logps` (reference log-probs [...]); set the other to None"
        )
    lead = tuple(policy_logits.shape[:-1])
    if ref_logps is not None:
        _checks.check_row_values("ref_logps", ref_logps, lead)
        return
    _checks.check_logits("ref_logits", ref_logits)
    if ref_logits.shape != policy_logits.shape:
        raise ValueError(
            f"`ref_logits` must have the shape of `policy_logits` {list(policy_logits.shape)}; "
            f"got {list(ref_logits.shape)}"
        )


def _backend(
    backend: str, rows: _Rows, vocab_group: Optional[torch.distributed.ProcessGroup] = None
) -> ModuleType:
    if vocab_group is not None:
        return _vocab_parallel.bind(backend, vocab_group, rows.lead)
    return _dispatch.resolve(backend, rows.device)


def _fused(run: ModuleType, opts) -> Optional[ModuleType]:
    """The fused policy-loss module when ``run`` is the Triton backend and ``opts`` fuse."""
    if getattr(run, "__name__", None) != "ratiokl.torch._triton":  # vocab-parallel: an object
        return None
    from ratiokl.torch import _fused_loss

    return _fused_loss if _fused_loss.fuses(run, opts) else None


def selected_logprobs(
    logits: torch.Tensor,
    action_ids: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    *,
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Log-probability of the sampled action per token: ``logp = z[a] - logsumexp(z)``.

    With ``z = logits / T``, computed in float32 whatever the logits' dtype::

        logp = logits[..., a] / T - logsumexp(logits / T, axis=-1)

    Args:
      logits: ``[..., V]`` float32, float16 or bfloat16, any strides.
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      temperature: a positive Python float, or a floating ``[...]`` (or 0-d) tensor,
        per row; an entry that is not positive and finite on an active row is
        rejected like a bad id (``check_ids``) and otherwise makes its row NaN.
      backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"interpret"``.
      check_ids: check active ids (and a per-row temperature) on the host (one
        sync) and raise ``ValueError`` naming the first bad position. False (CUDA
        graphs, ``torch.compile``): no sync, and a row with a bad active id or
        temperature gives NaN (and NaN gradient).
      vocab_group: a ``torch.distributed`` process group over which ``logits``
        is sharded along the vocabulary (rank r holds a contiguous column
        block, in rank order; see docs/vocab_parallel.md). ``action_ids`` are
        global and every input but the logits is identical on every rank.

    Returns:
      ``logp``: float32 ``[...]``; exactly 0 on inactive rows. The gradient
      ``g * (onehot(a) - softmax(z)) / T`` reaches ``logits`` in its dtype, and
      is exactly 0 on inactive rows whatever they hold (NaN, inf, any id).
      A NaN logit on an active row makes that row NaN only; ``-inf`` logits at
      other tokens (vocabulary masking) are valid.

    See :func:`ratio_kl` for the references.
    """
    rows = _prepare(logits, action_ids, mask, temperature, check_ids, vocab_group is not None)
    logp = _backend(backend, rows, vocab_group).selected_logprobs(
        rows.logits, rows.ids, rows.mask, rows.temperature, check_ids
    )
    return rows.checked(logp.reshape(rows.lead))


def ratio_kl(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: torch.Tensor,
    old_logps: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    kl_estimator: str = "k3",
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token importance ratio and KL penalty of the policy against a reference.

    With ``logp`` from :func:`selected_logprobs` (float32 math)::

        logp_ref = the same on ref_logits (or the given ref_logps)
        ratio    = exp(logp - old_logp)
        d        = logp_ref - logp
        kl       = k1: -d  |  k2: d*d/2  |  k3: exp(d) - d - 1   (default "k3")

    Args:
      policy_logits: ``[..., V]`` float32, float16 or bfloat16, any strides.
      ref_logits: reference-model logits of the same shape (any of those dtypes),
        or None when ``ref_logps`` is given. Evaluated without autograd.
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
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
    _checks.check_logits("policy_logits", policy_logits)
    lead = tuple(policy_logits.shape[:-1])
    _checks.check_ids(action_ids, lead)  # first: a flattened [N, V] names the ids
    _check_reference(policy_logits, ref_logits, ref_logps)
    _checks.check_row_values("old_logps", old_logps, lead)
    kl_code = kl_estimator_code(kl_estimator)
    rows = _prepare(
        policy_logits, action_ids, mask, temperature, check_ids, vocab_group is not None,
        ref_logits=ref_logits, old_logps=old_logps, ref_logps=ref_logps,
    )
    ref = None if ref_logits is None else ref_logits.detach().reshape(rows.logits.shape)
    ratio, kl = _backend(backend, rows, vocab_group).ratio_kl(
        rows.logits, ref, rows.ids, rows.mask, _flat_rows(old_logps),
        _flat_rows(ref_logps), kl_code, rows.temperature, check_ids,
    )
    return rows.checked((ratio.reshape(rows.lead), kl.reshape(rows.lead)))


def policy_loss(
    policy_logits: torch.Tensor,
    ref_logits: Optional[torch.Tensor],
    action_ids: torch.Tensor,
    mask: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    ref_logps: Optional[torch.Tensor] = None,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token-mean",
    loss_normalizer: Union[None, float, torch.Tensor] = None,
    ratio_level: str = "token",
    segment_ids: Optional[torch.Tensor] = None,
    importance_weights: Optional[torch.Tensor] = None,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_group: Optional[torch.distributed.ProcessGroup] = None,
    inplace_grad: bool = False,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy loss with a KL penalty, aggregated to one number.

    With ``logp`` from :func:`selected_logprobs`, per active token::

        r    = exp(clip(logp - old_logp, -b, b))        (b = log_ratio_bound)
        pg   = max(-A*r, -A*clip(r, 1-clip_eps, 1+clip_eps_high))
               then min(pg, -A*dual_clip) for A < 0; ratio_cap caps r likewise
        loss = importance_weight * pg + kl_coef * kl(logp_ref - logp)

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
      policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps,
        temperature, backend, check_ids, vocab_group: as in :func:`ratio_kl`;
        ``ref_logits`` and ``ref_logps`` may both be None when ``kl_coef == 0``.
      advantages: floating, per token ``[..., T]`` or per sequence ``[...]`` / ``[..., 1]``.
      clip_eps: ratio floor ``1 - clip_eps``; clip_eps_high: ceiling
        ``1 + clip_eps_high`` (DAPO clip-higher; default ``clip_eps``).
      dual_clip: ``c > 1`` caps the loss of ``A < 0`` tokens at ``-A*c``; None: off.
      ratio_cap: INTELLECT-2's ``delta > 1``, an upper cap on the ratio; None: off.
      kl_coef, kl_estimator: KL weight and variant: ``"k1"``, ``"k2"``, ``"k3"``,
        ``"k1+"``/``"k3+"`` (value of k1/k3, gradient of k2), ``"k3-is"`` (k3 times r).
      loss_agg: ``"token-mean"``, ``"token-sum"``, ``"seq-mean-token-mean"``,
        ``"seq-mean-token-sum"`` or ``"seq-mean-token-sum-norm"``.
      loss_normalizer: replaces the aggregation's denominator (a global token or
        sequence count, or a constant): a positive number or a 0-d tensor.
      ratio_level: ``"token"`` or ``"sequence"`` (GSPO).
      segment_ids: integer ``[...]``; sequences of packed rows (a new one starts
        where the id of consecutive active tokens changes). None: one per row.
      importance_weights: floating ``[...]`` (e.g. truncated IS from the rollout
        engine), multiplied into the policy term, detached.
      log_ratio_bound: bound on ``|log ratio|`` (and on ``|d|`` before k3's exp)
        applied before ``exp``, zero gradient beyond it; None: no bound.
      inplace_grad: opt-in, fused path in eager mode only (elsewhere no effect):
        the forward writes ``d loss / d policy_logits`` into ``policy_logits``'
        own (contiguous) buffer, so a step needs no ``[N, V]`` gradient
        allocation. The logits are consumed: afterwards they hold the gradient
        (scaled by the upstream value at ``backward``), another autograd node
        that saved them fails loudly, and the loss backpropagates once.

    Returns:
      ``(loss, metrics)``: a float32 0-d tensor, and detached float32 0-d tensors
      ``clip_fraction`` (= ``_low`` + ``_high``), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``kl_mean``
      and ``approx_kl`` (mean of ``old_logp - logp``), means over active tokens.
      Inactive tokens contribute nothing and get exactly zero gradient whatever
      they hold; no active token gives loss 0 and zero metrics, never NaN.

    References:
      Schulman et al. (2017) PPO, arXiv:1707.06347; Ye et al. (2019) dual-clip,
      arXiv:1912.09729; Yu et al. (2025) DAPO, arXiv:2503.14476; Liu et al.
      (2025) Dr. GRPO, arXiv:2503.20783; Zheng et al. (2025) GSPO,
      arXiv:2507.18071; Prime Intellect (2025) INTELLECT-2, arXiv:2505.07291.
    """
    opts = policy_loss_options(
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
        ratio_cap=ratio_cap, kl_coef=kl_coef, kl_estimator=kl_estimator, loss_agg=loss_agg,
        ratio_level=ratio_level, log_ratio_bound=log_ratio_bound,
    )
    _checks.check_logits("policy_logits", policy_logits)
    if inplace_grad and not policy_logits.is_contiguous():
        raise ValueError(
            "`inplace_grad=True` needs contiguous `policy_logits` (the gradient is written "
            "into their buffer); pass `policy_logits.contiguous()` or `inplace_grad=False`"
        )
    lead = tuple(policy_logits.shape[:-1])
    _checks.check_ids(action_ids, lead)  # first: a flattened [N, V] names the ids
    if ref_logits is not None or ref_logps is not None or opts.kl_coef != 0.0:
        _check_reference(policy_logits, ref_logits, ref_logps)
    inputs = _objective.token_inputs(
        lead, old_logps, advantages, segment_ids, importance_weights, loss_normalizer
    )
    rows = _prepare(
        policy_logits, action_ids, mask, temperature, check_ids, vocab_group is not None,
        ref_logits=ref_logits, old_logps=old_logps, ref_logps=ref_logps,
        advantages=advantages, segment_ids=segment_ids, importance_weights=importance_weights,
    )
    run = _backend(backend, rows, vocab_group)
    one_pass = _fused(run, opts)
    if one_pass is not None:  # one kernel: loss, metrics and gradient together
        ref = None if ref_logits is None else ref_logits.reshape(rows.logits.shape)
        if inplace_grad:  # the launch consumes the logits: check before it
            rows.checked(None)
        return rows.checked(one_pass.policy_loss(
            rows.logits, ref, rows.ids, rows.mask, _flat_rows(ref_logps), rows.temperature,
            inputs, opts, lead, inplace_grad=inplace_grad,
        ))
    logp = run.selected_logprobs(rows.logits, rows.ids, rows.mask, rows.temperature, check_ids)
    logp_ref = _flat_rows(ref_logps)
    if ref_logits is not None:
        with torch.no_grad():
            ref = ref_logits.detach().reshape(rows.logits.shape)
            logp_ref = run.selected_logprobs(ref, rows.ids, rows.mask, rows.temperature, check_ids)
    as_rows = _objective.as_rows
    return rows.checked(_objective.policy_objective(
        as_rows(logp, lead), None if logp_ref is None else as_rows(logp_ref, lead),
        as_rows(rows.mask, lead), inputs, opts,
    ))
