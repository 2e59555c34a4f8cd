"""JAX entry points: per-token log-probs, importance ratio, KL penalty, policy loss.

Each public function runs the same steps, kept in small private helpers:
validate (``_checks``) -> check active ids (a host check on concrete
inputs, a ``checkify`` check under tracing) -> flatten ``[..., V] -> [N, V]``
-> dispatch to a backend (``_dispatch``) -> reshape back to ``[...]``.

Options that select code paths (``kl_estimator``, ``backend``,
``check_ids``) and a Python-float ``temperature`` are static Python values:
close over them (``jax.jit(lambda *a: loss.ratio_kl(*a, kl_estimator="k2"))``)
or mark them static. Arrays may be traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl.jax import _checks, _dispatch, _objective, _vocab_parallel
from ratiokl.jax._checks import Temperature
from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND, kl_estimator_code, policy_loss_options

__all__ = ["policy_loss", "ratio_kl", "selected_logprobs"]


@dataclass(frozen=True)
class _Rows:
    """Validated inputs with the leading shape flattened to ``N`` rows."""

    lead: Tuple[int, ...]  # the caller's leading shape [...]
    logits: jax.Array  # [N, V] policy logits
    ids: jax.Array  # [N] integer
    mask: jax.Array  # [N] bool
    temperature: Temperature  # Python float, or float32 [N]
    ids_verified: bool  # the host check proved every active id in [0, V)


def _flat_rows(values: Optional[jax.Array]) -> Optional[jax.Array]:
    """A float32 ``[N]`` copy of a per-token array (None passes through)."""
    return None if values is None else values.reshape(-1).astype(jnp.float32)


def _prepare(
    logits: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array],
    temperature: Temperature,
    check_ids: bool,
    vocab_axis: Optional[str] = None,
) -> _Rows:
    """Validate, range-check (see ``_checks.check_active_ids``) and flatten the shared inputs."""
    logits = _checks.check_logits("policy_logits", logits)
    lead = tuple(logits.shape[:-1])
    ids = _checks.check_ids(action_ids, lead)
    mask = jnp.ones(lead, dtype=bool) if mask is None else _checks.check_mask(mask, lead)
    temperature = _checks.check_temperature(temperature, lead)
    check_ids = _checks.check_bool_option("check_ids", check_ids)
    vocab = _vocab_parallel.global_vocab(logits.shape[-1], vocab_axis)
    verified = _checks.check_active_ids(ids, mask, vocab, check_ids, temperature)
    if not isinstance(temperature, float):
        temperature = _checks.poison_bad_temperature(_flat_rows(temperature))
    return _Rows(
        lead=lead,
        logits=logits.reshape(-1, logits.shape[-1]),
        ids=ids.reshape(-1),
        mask=mask.reshape(-1),
        temperature=temperature,
        ids_verified=verified,
    )


def _backend(backend: str, vocab_axis: Optional[str] = None) -> ModuleType:
    if vocab_axis is not None:
        return _vocab_parallel.bind(backend, vocab_axis)
    return _dispatch.resolve(backend)


def _fused(run: ModuleType, opts) -> Optional[ModuleType]:
    """The fused policy-loss module when ``run`` is the Triton backend and ``opts`` fuse."""
    if getattr(run, "__name__", None) != "ratiokl.jax._triton":  # vocab-parallel: an object
        return None
    from ratiokl.jax import _fused_loss

    return _fused_loss if _fused_loss.fuses(run, opts) else None


def selected_logprobs(
    logits: jax.Array,
    action_ids: jax.Array,
    mask: Optional[jax.Array] = None,
    *,
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> jax.Array:
    """Log-probability of the sampled action per token: ``logp = z[a] - logsumexp(z)``.

    With ``z = logits / T``, computed in float32 whatever the logits' dtype::

        logp = logits[..., a] / T - logsumexp(logits / T, axis=-1)

    Args:
      logits: ``[..., V]`` float32, float16 or bfloat16.
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens; None: all active.
      temperature: a positive Python float, or a floating ``[...]`` (or 0-d) array,
        per row; an entry that is not positive and finite on an active row is
        rejected like a bad id (``check_ids``) and otherwise makes its row NaN.
      backend: ``"auto"``, ``"native"`` or ``"triton"`` (static).
      check_ids: with concrete inputs, check active ids (and a per-row
        temperature) on the host (one sync) and raise ``ValueError`` naming the
        first bad position. Traced inputs (``jit``, ``vmap``) are never
        synchronised: a row with a bad active id or temperature gives NaN (and
        NaN gradient), and a call wrapped in ``jax.experimental.checkify.checkify``
        raises. False skips the host
        check for concrete inputs too (the NaN rows stay).
      vocab_axis: inside ``jax.shard_map``, the mesh axis (static string) that
        ``logits``' vocabulary dimension is mapped to: each device holds a
        contiguous equal block and ``action_ids`` are global (see
        docs/vocab_parallel.md). The result is replicated along that axis.

    Returns:
      ``logp``: float32 ``[...]``; exactly 0 on inactive rows. The gradient
      ``g * (onehot(a) - softmax(z)) / T`` reaches ``logits`` in its dtype, and
      is exactly 0 on inactive rows whatever they hold (NaN, inf, any id).
      A NaN logit on an active row makes that row NaN only; ``-inf`` logits at
      other tokens (vocabulary masking) are valid.

    See :func:`ratio_kl` for the references.
    """
    rows = _prepare(logits, action_ids, mask, temperature, check_ids, vocab_axis)
    logp = _backend(backend, vocab_axis).selected_logprobs(
        rows.logits, rows.ids, rows.mask, rows.temperature, rows.ids_verified
    )
    return logp.reshape(rows.lead)


def ratio_kl(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    kl_estimator: str = "k3",
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
) -> Tuple[jax.Array, jax.Array]:
    """Per-token importance ratio and KL penalty of the policy against a reference.

    With ``logp`` from :func:`selected_logprobs` (float32 math)::

        logp_ref = the same on ref_logits (or the given ref_logps)
        ratio    = exp(logp - old_logp)
        d        = logp_ref - logp
        kl       = k1: -d  |  k2: d*d/2  |  k3: exp(d) - d - 1   (default "k3")

    Args:
      policy_logits: ``[..., V]`` float32, float16 or bfloat16.
      ref_logits: reference-model logits of the same shape (any of those dtypes),
        or None when ``ref_logps`` is given. Evaluated under ``lax.stop_gradient``.
      action_ids: ``[...]`` integer sampled token ids, in ``[0, V)`` on active rows.
      mask: ``[...]`` bool (or integer 0/1), True for active tokens.
      old_logps: ``[...]`` floating log-probs of the behaviour policy.
      ref_logps: ``[...]`` floating reference log-probs, instead of ``ref_logits``.
      kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (static).
      temperature: a positive Python float, or a floating ``[...]`` array (per
        row); it scales the policy and the reference logits alike.
      backend: ``"auto"``, ``"native"`` or ``"triton"`` (static).
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
    policy_logits = _checks.check_logits("policy_logits", policy_logits)
    lead = tuple(policy_logits.shape[:-1])
    _checks.check_ids(action_ids, lead)  # first: a flattened [N, V] names the ids
    ref_logits, ref_logps = _checks.check_ref(ref_logits, ref_logps, tuple(policy_logits.shape))
    old_logps = _checks.check_row_values("old_logps", old_logps, lead)
    kl_code = kl_estimator_code(kl_estimator)
    rows = _prepare(policy_logits, action_ids, mask, temperature, check_ids, vocab_axis)
    ref = None if ref_logits is None else ref_logits.reshape(rows.logits.shape)
    ratio, kl = _backend(backend, vocab_axis).ratio_kl(
        rows.logits, ref, rows.ids, rows.mask, _flat_rows(old_logps),
        _flat_rows(ref_logps), kl_code, rows.temperature, rows.ids_verified,
    )
    return ratio.reshape(rows.lead), kl.reshape(rows.lead)


def policy_loss(
    policy_logits: jax.Array,
    ref_logits: Optional[jax.Array],
    action_ids: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array,
    advantages: jax.Array,
    *,
    ref_logps: Optional[jax.Array] = None,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
    ratio_cap: Optional[float] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    loss_agg: str = "token-mean",
    loss_normalizer: Union[None, float, jax.Array] = None,
    ratio_level: str = "token",
    segment_ids: Optional[jax.Array] = None,
    importance_weights: Optional[jax.Array] = None,
    log_ratio_bound: Optional[float] = DEFAULT_LOG_RATIO_BOUND,
    temperature: Temperature = 1.0,
    backend: str = "auto",
    check_ids: bool = True,
    vocab_axis: Optional[str] = None,
    inplace_grad: bool = False,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
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
    ``ratio_level="sequence"`` and ``vocab_axis``, which take the two-pass path
    (log-probs forward, gradient in the backward), as the native backends do.

    Args:
      policy_logits, ref_logits, action_ids, mask, old_logps, ref_logps,
        temperature, backend, check_ids, vocab_axis: as in :func:`ratio_kl`; ``ref_logits``
        and ``ref_logps`` may both be None when ``kl_coef == 0``. Every option
        but ``loss_normalizer`` is a static Python value; arrays may be traced.
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
      inplace_grad: opt-in, fused (Triton) path only, elsewhere no effect: the
        gradient's buffer aliases ``policy_logits``' (``input_output_aliases``),
        so a step needs no ``[N, V]`` gradient allocation -- where XLA can
        reuse the logits' buffer: donate them (``jax.jit(...,
        donate_argnums=...)``) or produce them inside the same ``jit`` and use
        them nowhere else; otherwise XLA copies them first (same values).

    Returns:
      ``(loss, metrics)``: a float32 0-d array, and float32 0-d arrays (stop-gradient)
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
    policy_logits = _checks.check_logits("policy_logits", policy_logits)
    lead = tuple(policy_logits.shape[:-1])
    _checks.check_ids(action_ids, lead)  # first: a flattened [N, V] names the ids
    if ref_logits is not None or ref_logps is not None or opts.kl_coef != 0.0:
        ref_logits, ref_logps = _checks.check_ref(ref_logits, ref_logps, policy_logits.shape)
    inputs = _objective.token_inputs(
        lead, old_logps, advantages, segment_ids, importance_weights, loss_normalizer
    )
    rows = _prepare(policy_logits, action_ids, mask, temperature, check_ids, vocab_axis)
    run = _backend(backend, vocab_axis)
    one_pass = _fused(run, opts)
    if one_pass is not None:  # one kernel: loss, metrics and gradient together
        ref = None if ref_logits is None else ref_logits.reshape(rows.logits.shape)
        return one_pass.policy_loss(
            rows.logits, ref, rows.ids, rows.mask, _flat_rows(ref_logps), rows.temperature,
            inputs, opts, lead, inplace_grad=inplace_grad,
        )
    logp = run.selected_logprobs(
        rows.logits, rows.ids, rows.mask, rows.temperature, rows.ids_verified
    )
    logp_ref = _flat_rows(ref_logps)
    if ref_logits is not None:
        ref = lax.stop_gradient(ref_logits.reshape(rows.logits.shape))
        logp_ref = run.selected_logprobs(
            ref, rows.ids, rows.mask, rows.temperature, rows.ids_verified
        )
    logp_ref = None if logp_ref is None else lax.stop_gradient(logp_ref)
    as_rows = _objective.as_rows
    return _objective.policy_objective(
        as_rows(logp, lead), None if logp_ref is None else as_rows(logp_ref, lead),
        as_rows(rows.mask, lead), inputs, opts,
    )
