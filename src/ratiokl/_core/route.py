"""The policy-loss routes' framework-neutral tail, written once for PyTorch and JAX.

A route validates its arguments, builds the option objects and flattens the leading shape
``[...]`` to ``N`` rows (``ratiokl.<framework>._route``), then hands them here
(:func:`loss_step`): the rollout correction, the backend's one-kernel loss or its
log-probs, and the objective of :mod:`ratiokl._core.objective` on their ``[R, T]``
layout (``sequences.as_rows``), the loss as the caller gets it (``loss_agg="none"``: per
token in the leading shape, else 0-d).

``xp`` is the framework's array adapter (see :mod:`ratiokl._core`); for the route it also
offers ``flat(x)`` (an ``[N]`` copy in the compute dtype outside the gradient, None passing
through),
``no_grad()`` (a context), ``compiling()``, ``compiled_backward(logits)`` (whether to
leave the fused kernel to the two passes), ``check_before_inplace`` and ``once(loss, op)``
(the framework's guard against a second backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

from ratiokl._backend import Backend, inplace_grad_error
from ratiokl._core import checks as _checks
from ratiokl._core.objective import kernel_weights, objective_rows
from ratiokl._core.rollout import parity as rollout_parity
from ratiokl._core.rollout import weights as rollout_weights
from ratiokl._core.sequences import as_rows, log_weights
from ratiokl.spec import (ROLLOUT_PARITY_NAMES, PolicyLossOptions, RolloutOptions,
                          check_loss_normalizer, check_term_normalizer)

__all__ = ["Rows", "fused_advantages", "linear_logprobs_step", "linear_loss_step",
           "logprobs_step", "loss_inputs", "loss_step", "ratio_kl_step", "rollout_step",
           "uniform_weights", "with_rollout"]


class Rows(NamedTuple):
    """Validated inputs with the leading shape flattened to ``N`` rows (a route's ``_rows``)."""

    lead: Tuple[int, ...]  # the caller's leading shape [...]
    logits: Any  # [N, V] policy logits (hidden states [N, H] on the linear routes)
    ids: Any  # [N] integer
    mask: Any  # [N] bool
    temperature: Any  # Python float, or float32 [N] (bad entries NaN)
    run: Backend
    check: Any  # the framework's ActiveCheck (or None: no host check), read after launches

    def checked(self, result):
        """``result`` once the host check (if any) passed: raises ``ValueError`` otherwise."""
        if self.check is not None:
            self.check.raise_if_bad()
        return result


def loss_inputs(xp, opts: PolicyLossOptions, lead: Tuple[int, ...], old_logps, advantages,
                segment_ids, importance_weights, loss_normalizer, kl_entropy_normalizer,
                rollout_logps=None):
    """The normalisers checked against ``opts``, then the per-token inputs validated
    (:func:`ratiokl._core.checks.token_inputs`, in ``xp``'s compute dtype)."""
    check_loss_normalizer(opts.loss_agg, loss_normalizer)
    check_term_normalizer(opts, kl_entropy_normalizer)
    return _checks.token_inputs(xp, lead, old_logps, advantages, segment_ids,
                                importance_weights, loss_normalizer, kl_entropy_normalizer,
                                rollout_logps)


def rollout_step(xp, mask, lead: Tuple[int, ...], inputs, opts: RolloutOptions,
                 bound: Optional[float], launch: Optional[Callable] = None):
    """``(inputs, metrics)``: ``inputs`` (``TokenInputs`` with ``rollout_logps`` and
    ``old_logps``) with the rollout weight folded into ``importance_weights`` where ``opts``
    corrects, and the rollout metrics (``ratiokl._core.rollout``).

    ``mask``: the flattened bool ``[N]`` mask; ``launch``: a backend's one-launch
    ``rollout_weights(mask, old, rollout, seq, iw, opts, bound)`` on ``[N]`` arrays, or None
    (the framework ops of ``rollout.weights``; also for the modes the kernel lacks,
    ``"token-clip"`` and ``"sequence-geomean-mask"``).
    """
    mask, old, rollout = as_rows(mask, lead), inputs.old_logps, inputs.rollout_logps
    in_kernel = launch is not None and opts.in_kernel
    lw, seq = (None, None) if in_kernel and not opts.sequence else log_weights(
        xp, mask, old, rollout, inputs.segment_ids, opts.sequence, opts.geomean)
    if in_kernel:
        flat = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
        w, metrics = launch(flat(mask), flat(old), flat(rollout), seq,
                            flat(inputs.importance_weights), opts, bound)
        w = w.reshape(mask.shape)
    else:
        w, metrics = rollout_weights(xp, mask, lw, seq, inputs.importance_weights, opts, bound)
    if opts.corrects:
        inputs = dataclasses.replace(inputs, importance_weights=w)
    return inputs, metrics


def with_rollout(metrics: Dict[str, Any], rollout_metrics: Dict[str, Any],
                 parity: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The metrics in the spec's order: the policy's, the rollout weight's, then the
    trainer/sampler parity (``parity``, or those a fused kernel put in ``metrics``)."""
    if parity is None:
        parity = {name: metrics.pop(name) for name in ROLLOUT_PARITY_NAMES if name in metrics}
    return {**metrics, **rollout_metrics, **parity}


def logprobs_step(rows: Rows, return_entropy: bool):
    """``selected_logprobs`` on validated ``rows``: ``logp`` (with ``return_entropy``,
    ``(logp, entropy)``) in the leading shape, once the host check passed."""
    lead = rows.lead
    if return_entropy:
        logp, ent = rows.run.logprobs_entropy(rows.logits, rows.ids, rows.mask,
                                              rows.temperature)
        return rows.checked((logp.reshape(lead), ent.reshape(lead)))
    logp = rows.run.selected_logprobs(rows.logits, rows.ids, rows.mask, rows.temperature)
    return rows.checked(logp.reshape(lead))


def linear_logprobs_step(rows: Rows, weight, bias, transform, chunk_rows: int,
                         return_entropy: bool):
    """``linear_selected_logprobs`` on validated ``rows`` of hidden states ``[N, H]``: the
    backend's chunks over the lm_head ``weight [V, H]`` / ``bias``, ``logp`` (with
    ``return_entropy``, ``(logp, entropy)``) in the leading shape, once the host check passed."""
    out = rows.run.linear_selected_logprobs(rows.logits, weight, bias, rows.ids, rows.mask,
                                            rows.temperature, transform, chunk_rows,
                                            bool(return_entropy))
    if return_entropy:
        return rows.checked((out[0].reshape(rows.lead), out[1].reshape(rows.lead)))
    return rows.checked(out.reshape(rows.lead))


def ratio_kl_step(xp, rows: Rows, ref, old_logps, ref_logps, kl_code: int):
    """``ratio_kl`` on validated ``rows`` (``ref``: reference logits ``[N, V]`` outside the
    gradient, or None): ``(ratio, kl)`` in the leading shape."""
    ratio, kl = rows.run.ratio_kl(rows.logits, ref, rows.ids, rows.mask, xp.flat(old_logps),
                                  xp.flat(ref_logps), kl_code, rows.temperature)
    return rows.checked((ratio.reshape(rows.lead), kl.reshape(rows.lead)))


def uniform_weights(opts: PolicyLossOptions, normalizer: object, width: int,
                    by_count: Callable[[], Any], by_number: Callable[[float], Any]):
    """A Triton backend's ``token_weights``: the aggregation weights ``w = where(mask, 1 / D,
    0)`` (float32 ``[N]``) in one launch where every active token weighs the same (``D`` the
    active count: ``by_count()``, the weights kernel; a number: ``by_number(D)``, one
    ``where``); None where they do not (sequence lengths or counts, an array normaliser: the
    caller takes the framework's ops, :func:`ratiokl._core.objective.kernel_weights`).

    ``normalizer``: ``loss_normalizer``; ``width``: tokens per sequence ``T``.
    """
    args = opts.uniform_weight(normalizer, width)
    if args is None:
        return None
    denom, count = args
    return by_count() if count else by_number(denom)


def fused_advantages(xp, inputs) -> Tuple[Any, int]:
    """``(adv, adv_rows)`` as the fused kernel reads them from ``inputs`` (``TokenInputs``,
    ``[R, T]``): float32 ``[R]`` with ``adv_rows = T`` where they were given per sequence,
    else ``[N]`` with ``adv_rows = 1``. Per-sequence advantages are thus never expanded into
    an ``[N]`` copy (in PyTorch that copy was the costliest host step of a call on the H200).
    """
    if inputs.sequence_advantages is None:
        return xp.flat(inputs.advantages), 1
    return xp.flat(inputs.sequence_advantages), inputs.advantages.shape[-1]


def loss_step(xp, rows, ref, ref_logps, inputs, opts: PolicyLossOptions, rollout,
              inplace_grad: bool, op: str) -> Tuple[Any, Dict[str, Any]]:
    """``policy_loss`` on validated ``rows`` (the route's flattened rows: ``lead``,
    ``logits [N, V]``, ``ids``, ``mask``, ``temperature``, the backend ``run`` and
    ``checked(result)``, which reads the host check) and options: the rollout correction
    (with ``rollout``, the options of ``inputs.rollout_logps``), then the one-kernel loss
    or the two passes.

    ``ref``: the reference logits ``[N, V]`` or None; ``ref_logps`` the caller's ``[...]``
    (validated) or None; ``op``: the public call a second backward's error names. Also the
    native route of ``linear_policy_loss``, on the lm_head's logits.
    """
    lead, run = rows.lead, rows.run
    rollout_metrics, engine = {}, None
    if rollout is not None:
        inputs, rollout_metrics = rollout_step(xp, rows.mask, lead, inputs, rollout,
                                               opts.log_ratio_bound, run.rollout_weights)
        engine = xp.flat(inputs.rollout_logps)  # [N], for the parity metrics
    if run.policy_loss is not None and opts.fuses and not opts.sequence_ratio \
            and not xp.compiled_backward(rows.logits):
        # One kernel: the loss, the metrics' row values and the gradient.
        weights = kernel_weights(xp, run.token_weights, rows.mask, lead, inputs, opts)
        if inplace_grad and xp.check_before_inplace:  # the launch consumes the logits
            rows.checked(None)
        adv, adv_rows = fused_advantages(xp, inputs)
        loss, metrics = run.policy_loss(
            rows.logits, ref, rows.ids, rows.mask, xp.flat(inputs.old_logps),
            xp.flat(ref_logps), adv, xp.flat(inputs.importance_weights), weights,
            rows.temperature, opts, inplace_grad, adv_rows=adv_rows, rollout=engine,
        )
        loss = loss.reshape(lead) if opts.loss_agg == "none" else loss
        return rows.checked((loss, with_rollout(metrics, rollout_metrics)))
    if inplace_grad:  # the two-pass route writes a new gradient: the opt-in cannot apply
        raise inplace_grad_error(opts.sequence_ratio, xp.compiling(), fuses=opts.fuses)
    # The entropy from the same read of the logits (entropy_mean always; in the loss with
    # entropy_coef): without a coefficient nothing differentiates it.
    logp, entropy = run.logprobs_entropy(rows.logits, rows.ids, rows.mask, rows.temperature)
    logp_ref = xp.flat(ref_logps)
    if ref is not None:
        with xp.no_grad():
            logp_ref = run.selected_logprobs(xp.stop_gradient(ref), rows.ids, rows.mask,
                                             rows.temperature)
    logp_ref = None if logp_ref is None else xp.stop_gradient(logp_ref)
    loss, metrics = objective_rows(xp, logp, logp_ref, rows.mask, lead, inputs, opts, entropy)
    parity = None if engine is None else rollout_parity(xp, rows.mask, logp, engine)
    return rows.checked((xp.once(loss, op), with_rollout(metrics, rollout_metrics, parity)))


def linear_loss_step(xp, rows, weight, bias, transform, chunk_rows: int, ref_logps, inputs,
                     opts: PolicyLossOptions, rollout,
                     sharded: bool) -> Tuple[Any, Dict[str, Any]]:
    """``linear_policy_loss`` on validated ``rows`` of hidden states (``rows.logits`` is
    ``hidden [N, H]``), the lm_head ``weight [V, H]`` / ``bias [V]`` and ``transform``.

    Three routes: the backend without a fused linear loss (``"native"``) materialises every
    row's logits (``xp.head_logits``, inactive rows' hidden states zeroed) and takes
    :func:`loss_step`; ``sharded`` (vocab-parallel), ``loss_agg="none"`` and the options
    the fused chunks lack (``kl_agg``, ``entropy_agg``, ``kl_clamp``, SAPO) take two passes:
    the backend's chunked log-probs and entropies, then ``objective.objective_rows`` (with
    ``"none"`` the per-token loss's upstream gradient is ``[...]`` and ``d weight`` sums
    every row's share, so it cannot be scaled after the fact as the fused chunks' scalar
    one is); else the backend's fused chunks.
    """
    lead, run = rows.lead, rows.run
    if not sharded and run.linear_policy_loss is None:
        logits = xp.head_logits(rows.logits, rows.mask, weight, bias, transform)
        return loss_step(xp, rows._replace(logits=logits), None, ref_logps, inputs, opts,
                         rollout, False, "linear_policy_loss")
    rollout_metrics, engine = {}, None
    if rollout is not None:
        inputs, rollout_metrics = rollout_step(xp, rows.mask, lead, inputs, rollout,
                                               opts.log_ratio_bound, run.rollout_weights)
        engine = xp.flat(inputs.rollout_logps)  # [N], for the parity metrics
    if sharded or opts.loss_agg == "none" or not opts.fuses:
        logp, ent = run.linear_selected_logprobs(rows.logits, weight, bias, rows.ids,
                                                 rows.mask, rows.temperature, transform,
                                                 chunk_rows, True)
        ref = None if ref_logps is None else xp.stop_gradient(xp.flat(ref_logps))
        loss, metrics = objective_rows(xp, logp, ref, rows.mask, lead, inputs, opts, ent)
        if sharded:  # the vocab-parallel loss refuses a second backward, as policy_loss
            loss = xp.once(loss, "linear_policy_loss")
        parity = None if engine is None else rollout_parity(xp, rows.mask, logp, engine)
        return rows.checked((loss, with_rollout(metrics, rollout_metrics, parity)))
    weights = kernel_weights(xp, run.token_weights, rows.mask, lead, inputs, opts)
    loss, metrics = run.linear_policy_loss(
        rows.logits, weight, bias, transform, rows.ids, rows.mask, xp.flat(inputs.old_logps),
        xp.flat(ref_logps), xp.flat(inputs.advantages), xp.flat(inputs.importance_weights),
        weights, rows.temperature, opts, chunk_rows, rollout=engine,
    )
    return rows.checked((loss, with_rollout(metrics, rollout_metrics)))
