"""The ``"triton"`` and ``"interpret"`` JAX backends on flattened rows: the kernels'
launches with derivatives.

The functions ``ratiokl.jax._route`` calls with validated ``[N, V]`` logits
and ``[N]`` per-row arrays, on the very kernels ``ratiokl.torch`` launches
(``ratiokl.jax._launch`` holds the launches and their ``vmap`` rules). Each takes
``call`` first, the launch function (:data:`ratiokl.jax._launch.TritonCall`), and
:func:`backend` binds them to one: ``jax_triton.triton_call`` for ``"triton"``, the
interpreter's stand-in (``ratiokl.jax._interpret``) for ``"interpret"``. The rest is
one code path for both:

* ``selected_logprobs`` / ``ratio_kl``: one ``jax.custom_vjp`` whose forward
  runs the row forward (per row ``logp``, ``ratio``, ``kl``, ``dkl/dlogp``,
  ``lse``; few rows: partials + combine, the same bits) and whose backward runs
  ``logp_backward_kernel``, which forms ``c = g_logp + g_ratio * ratio + g_kl *
  dkl`` per row itself (0 on inactive rows), in the logits' dtype;
* ``policy_loss``: the fused kernel writes per row ``w * loss_t``, the
  metrics' values and the policy-logit gradient of ``sum_t w_t * loss_t`` in
  one program; a ``jax.custom_vjp`` keeps that gradient as its residual and
  its backward scales it by the cotangent (``scale_rows_kernel``, aliased in
  place, skipped on the device where the cotangent is 1). The primal (no
  derivative taken) skips the gradient sweep: one read of each row. The
  coefficients (``kl_coef``, the clip bounds, ``entropy_coef``) are a run-time
  ``[5]`` array;
* ``shard_logps`` (``vocab_axis=``, inside ``shard_map``): a block's
  statistics from ``shard_stats_kernel``, one ``pmax`` and one ``psum``, and
  the block's gradient from ``logp_backward_kernel`` with the global ``lse``.

The kernels clamp ids and poison bad active rows with NaN; nothing
synchronises with the host.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from ratiokl._backend import Backend
from ratiokl._codes import KL
from ratiokl._kernels.loss_rows import METRIC_NAMES
from ratiokl.jax import _launch, _native
from ratiokl.jax._checks import Temperature, kernel_rows
from ratiokl.jax._launch import Static, TritonCall
from ratiokl.jax._vocab_parallel import varies_over, varying_axes
from ratiokl.spec import PolicyLossOptions

__all__ = ["backend", "fused_static", "kernel_coefficients", "logprobs_entropy",
           "policy_loss", "ratio_kl", "selected_logprobs", "shard_logps", "shard_stats",
           "token_weights"]


@functools.lru_cache(maxsize=None)
def _typed(call: TritonCall) -> TritonCall:
    """``call`` with its results typed as varying over every ``shard_map`` axis one of its
    arrays varies over. jax-triton's and the interpreter's launches type their results
    invariant; inside ``shard_map`` over rows (data parallelism) a loss typed invariant
    made ``pmean`` a no-op whose transpose multiplied the gradients by the axis size, and a
    ``custom_vjp`` whose backward returned invariant gradients for varying inputs failed to
    trace."""

    @functools.wraps(call)
    def typed(*args, **keywords):
        axes = frozenset().union(*(varying_axes(a) for a in args if isinstance(a, jax.Array)))
        out = call(*args, **keywords)
        if not axes:
            return out
        return jax.tree.map(lambda x: x if axes <= varying_axes(x) else lax.pcast(
            x, tuple(sorted(axes - varying_axes(x))), to="varying"), out)

    return typed


def backend(call: TritonCall) -> Backend:
    """The backend whose kernels launch through ``call`` (every function below, bound;
    results typed as :func:`_typed` says)."""
    call = _typed(call)
    bind = functools.partial
    from ratiokl.jax import _linear, _linear_logprobs, _vocab_linear

    return Backend(bind(selected_logprobs, call), bind(ratio_kl, call),
                   bind(logprobs_entropy, call), bind(policy_loss, call),
                   bind(token_weights, call), shard_logps=bind(shard_logps, call),
                   shard_rows=bind(_vocab_linear.kernel_rows, call),
                   linear_policy_loss=bind(_linear.policy_loss, call),
                   linear_selected_logprobs=bind(_linear_logprobs.selected_logprobs,
                                                 _linear_logprobs.triton_rows(call)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 9))
def _op(call, policy, ref, ids, mask, old, ref_logps, temp, kl_code: int, has_ref: bool):
    logp, ratio, kl, _, _ = _launch.forward_op(call, kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return logp, ratio, kl


def _op_fwd(call, policy, ref, ids, mask, old, ref_logps, temp, kl_code, has_ref):
    logp, ratio, kl, dkl, lse = _launch.forward_op(call, kl_code, has_ref)(
        policy, ref, ids, mask, old, ref_logps, temp
    )
    return (logp, ratio, kl), (policy, ids, mask, temp, lse, ratio, dkl)


def _op_bwd(call, kl_code, has_ref, residuals, cotangents):
    del kl_code, has_ref  # the forward's ratio and dkl carry what the estimator needs
    policy, ids, mask, temp, lse, ratio, dkl = residuals
    g_logp, g_ratio, g_kl = (g.astype(jnp.float32) for g in cotangents)
    # The kernel forms c = g_logp + g_ratio * ratio + g_kl * dkl, selecting 0 on inactive
    # rows (never multiplying: a NaN cotangent there stays out).
    grad = _launch.backward_op(call, (True, True, True))(policy, ids, mask, temp, lse, g_logp,
                                                         g_ratio, ratio, g_kl, dkl)
    # custom_vjp does not force the cotangent's dtype: keep the logits' dtype.
    return grad.astype(policy.dtype), None, None, None, None, None, None


_op.defvjp(_op_fwd, _op_bwd)


def selected_logprobs(
    call: TritonCall, logits: jax.Array, ids: jax.Array, mask: jax.Array,
    temperature: Temperature,
) -> jax.Array:
    """Float32 ``logp[N]`` of ``logits[N, V]``; 0 on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``logits`` (gradient in its dtype).
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    # Placeholders, never read (KL_CODE = 0): an existing array, so nothing is computed.
    logp, _, _ = _op(call, logits, logits, ids, mask_k, temp, temp, temp, KL.NONE.value, False)
    return logp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _entropy_op(call, policy, ids, mask, temp):
    logp, _, ent, _, _ = _launch.forward_op(call, KL.NONE.value, False, True)(
        policy, policy, ids, mask, temp, temp, temp)
    return logp, ent


def _entropy_op_fwd(call, *primals):
    # symbolic_zeros: each array comes as a CustomVJPPrimal (its value, whether perturbed).
    policy, ids, mask, temp = (p.value for p in primals)
    logp, _, ent, _, lse = _launch.forward_op(call, KL.NONE.value, False, True)(
        policy, policy, ids, mask, temp, temp, temp)
    return (logp, ent), (policy, ids, mask, temp, lse, ent)


def _entropy_op_bwd(call, residuals, cotangents):
    policy, ids, mask, temp, lse, ent = residuals
    # A symbolic-zero cotangent (an output nothing differentiates: the entropy of
    # policy_loss with entropy_coef=0) is a term the kernel leaves out.
    g_logp, g_ent = (None if isinstance(g, SymbolicZero) else g.astype(jnp.float32)
                     for g in cotangents)
    if g_logp is None and g_ent is None:
        return jnp.zeros_like(policy), None, None, None
    # The entropy's term rides in the kernel's KL slots (ENTROPY): -g_ent p (log p + H) / T.
    grad = _launch.backward_op(call, (g_logp is not None, False, g_ent is not None),
                               g_ent is not None)(
        policy, ids, mask, temp, lse, lse if g_logp is None else g_logp, lse, lse,
        lse if g_ent is None else g_ent, ent)
    return grad.astype(policy.dtype), None, None, None


_entropy_op.defvjp(_entropy_op_fwd, _entropy_op_bwd, symbolic_zeros=True)


def logprobs_entropy(
    call: TritonCall, logits: jax.Array, ids: jax.Array, mask: jax.Array,
    temperature: Temperature,
) -> Tuple[jax.Array, jax.Array]:
    """Float32 ``(logp[N], entropy[N])`` from one read of ``logits[N, V]``; 0 on inactive
    rows, NaN on bad-id rows. Differentiable w.r.t. ``logits`` through both."""
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    return _entropy_op(call, logits, ids, mask_k, temp)


def ratio_kl(
    call: TritonCall, policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array,
    mask: jax.Array,
    old_logps: jax.Array, ref_logps: Optional[jax.Array], kl_code: int,
    temperature: Temperature,
) -> Tuple[jax.Array, jax.Array]:
    """Float32 ``(ratio[N], kl[N])``: ``(1, 0)`` on inactive rows, NaN on bad-id rows.

    Differentiable w.r.t. ``policy`` only.
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    old = jax.lax.stop_gradient(old_logps.astype(jnp.float32))
    if ref is None:
        ref_in, has_ref = policy, False  # placeholder, never read (HAS_REF = False)
        ref_lp = jax.lax.stop_gradient(ref_logps.astype(jnp.float32))
    else:
        ref_in, has_ref = jax.lax.stop_gradient(ref), True
        ref_lp = old  # placeholder, never read (HAS_REF: the kernel computes it)
    _, ratio, kl = _op(call, policy, ref_in, ids, mask_k, old, ref_lp, temp, kl_code, has_ref)
    return ratio, kl


# --- the fused policy loss ----------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 12, 13))
def _fused(call, policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs, static: Static,
           inplace: bool):
    return _launch.fused_op(call, static, False)(policy, ref, ids, mask, old, ref_lp, temp,
                                                 adv, iw, w, coefs)[:-1]


def _fused_fwd(call, policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, coefs, static,
               inplace):
    outs = _launch.fused_op(call, static, True, inplace)(policy, ref, ids, mask, old, ref_lp,
                                                         temp, adv, iw, w, coefs)
    return outs[:-1], (outs[-1], mask)


def _fused_bwd(call, static, inplace, residuals, cotangents):
    del static, inplace
    grad, mask = residuals
    g_loss = cotangents[0].astype(jnp.float32)
    return (_launch.scale_op(call)(grad, g_loss, mask),) + (None,) * 10


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_static(opts: PolicyLossOptions, ref_logits: bool, ref_logps: bool,
                 iw: bool, old: bool) -> Static:
    """The fused kernel's compile-time options for ``opts``: whether reference logits,
    reference log-probs (either gives the KL), importance weights and old log-probs (else
    on-policy) are given."""
    has_ref = ref_logits or ref_logps
    return (ref_logits, iw, opts.kl_code if has_ref else KL.NONE.value,
            opts.neg_cap is not None, opts.log_ratio_bound or 0.0, opts.objective_code,
            opts.uses_entropy, not old)


def kernel_coefficients(opts: PolicyLossOptions) -> jax.Array:
    """Float32 ``[5]`` the fused kernel reads at run time (no derivative): ``(kl_coef, ratio
    floor, ratio ceiling, negative-advantage cap, entropy_coef)``; traced values pass through."""
    return lax.stop_gradient(jnp.stack([
        jnp.asarray(c, jnp.float32) for c in (
            opts.kl_coef, opts.ratio_low, opts.ratio_high,
            jnp.inf if opts.neg_cap is None else opts.neg_cap, opts.entropy_coef)
    ]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rows_total(rows: int, loss_rows: jax.Array, total: jax.Array) -> jax.Array:
    """``sum(loss_rows)``, given already summed (``total``): the sum's gradient, no reduction.

    The backward hands every row the upstream value (a broadcast).
    """
    del rows, loss_rows
    return total


def _rows_total_fwd(rows, loss_rows, total):
    del rows, loss_rows
    return total, None


def _rows_total_bwd(rows, _, g):
    return jnp.broadcast_to(g, (rows,)), jnp.zeros_like(g)


_rows_total.defvjp(_rows_total_fwd, _rows_total_bwd)


def token_weights(call: TritonCall, mask: jax.Array, opts: PolicyLossOptions,
                  normalizer: object, width: int) -> Optional[jax.Array]:
    """The aggregation weights ``w = where(mask, 1 / D, 0)`` (float32 ``[N]``) in one launch,
    where every active token weighs the same (``D`` the active count: the weights kernel;
    a number: one ``where``); None where they do not (sequence lengths or counts, an array
    normaliser: the caller takes the framework's ops).

    ``normalizer``: ``loss_normalizer``; ``width``: tokens per sequence ``T``.
    """
    args = opts.uniform_weight(normalizer, width)
    if args is None:
        return None
    denom, count = args
    mask = mask.astype(jnp.bool_)
    return _launch.weights_op(call)(mask) if count else _launch.native_weights(denom, False, mask)


def policy_loss(
    call: TritonCall, policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array,
    mask: jax.Array,
    old: Optional[jax.Array], ref_logps: Optional[jax.Array], adv: jax.Array,
    iw: Optional[jax.Array], weights: jax.Array, temperature: Temperature,
    opts: PolicyLossOptions, inplace_grad: bool,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """The fused ``(loss, metrics)`` of flattened rows: one kernel for the loss, the
    metrics' row values and the policy-logit gradient, one for the means.

    ``old``, ``adv``, ``iw`` (or None), ``ref_logps`` (or None) and the
    aggregation ``weights`` are float32 ``[N]`` (``old`` None: on-policy, the kernel's
    ``ON_POLICY``); ``policy`` ``[N, V]`` is the only
    differentiable input. ``inplace_grad``: the gradient's buffer aliases
    ``policy``'s (``input_output_aliases``; without a copy where XLA may, e.g.
    ``policy`` donated to ``jit``). Returns the float32 0-d loss (``loss_agg="none"``: the
    rows' losses ``[N]``, 0 on inactive rows, each row's gradient scaled by its own
    cotangent) and the stop-gradient metrics.
    """
    ids, mask_k, temp = kernel_rows(ids, mask, temperature)
    stop = lax.stop_gradient
    adv, weights = stop(adv), stop(weights)
    static = fused_static(opts, ref is not None, ref_logps is not None, iw is not None,
                          old is not None)
    old_in = weights if old is None else stop(old)  # on-policy: a placeholder, never read
    coefs = kernel_coefficients(opts)
    # Without reference logits their slot is never read: any array but the logits, whose
    # buffer the in-place gradient takes over (an operand passed twice cannot be donated).
    ref_in = weights if ref is None else stop(ref)
    ref_lp = weights if ref_logps is None else stop(ref_logps)
    loss_rows, logp, ratio, kl, ent, bits = _fused(
        call, policy, ref_in, ids, mask_k, old_in, ref_lp, temp, adv,
        weights if iw is None else stop(iw), weights, coefs, static, inplace_grad,
    )
    rows = (mask_k, logp, ratio, kl, ent, bits, logp if old is None else old_in, loss_rows)
    means, total = _launch.metrics_op(call)(*(stop(x) for x in rows))  # no derivative: none asked
    # "none" (weights 1): the rows' losses themselves, whose [N] cotangent scales each row.
    loss = loss_rows if opts.loss_agg == "none" else _rows_total(loss_rows.shape[0], loss_rows,
                                                                 total)
    return loss, {name: means[i] for i, name in enumerate(METRIC_NAMES)}


# --- one vocabulary shard (vocab-parallel) -----------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 9))
def _attach(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis: str, entropy: bool):
    """``(logp,)``, or ``(logp, H)`` with ``entropy`` (0 on inactive rows), differentiable
    w.r.t. this block ``policy`` (``ent``: the global entropy; a placeholder without it)."""
    del call, policy, local_ids, temp, axis
    active = mask_k != 0
    logp = jnp.where(active, z_a - lse, 0.0)
    return (logp, jnp.where(active, ent, 0.0)) if entropy else (logp,)


def _attach_fwd(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis, entropy):
    return _attach(call, policy, z_a, lse, ent, local_ids, mask_k, temp, axis, entropy), (
        policy, local_ids, mask_k, temp, lse, ent
    )


def _attach_bwd(call, axis, entropy, residuals, g):
    policy, local_ids, mask_k, temp, lse, ent = residuals
    # The kernel selects 0 on inactive rows (a NaN cotangent there stays out).
    coef = g[0].astype(jnp.float32)
    if entropy:  # the entropy's term rides in the kernel's KL slots (ENTROPY)
        grad = _launch.backward_op(call, (True, False, True), True)(
            policy, local_ids, mask_k, temp, lse, coef, lse, lse, g[1].astype(jnp.float32),
            ent)
    else:
        grad = _launch.backward_op(call, (True, False, False))(
            policy, local_ids, mask_k, temp, lse, coef, lse, lse, lse, lse)
    return grad.astype(policy.dtype), None, None, None, None, None, None


_attach.defvjp(_attach_fwd, _attach_bwd)


def shard_stats(call: TritonCall, blocks: Sequence[jax.Array], ids: jax.Array, mask: jax.Array,
                temp: jax.Array, axis: str, entropy: bool):
    """The global row values of this device's blocks ``[N, V_local]`` (no derivative):
    ``(z_a [k, N], lse [k, N], entropy [N], local ids [N])`` from ``shard_stats_kernel`` and
    one ``pmax`` and one ``psum`` (the entropy ``lse[0]`` without ``entropy``; the local ids
    ``a - start``, -1 where the action lies in another block). ``ids``, ``mask`` and
    ``temp`` as :func:`kernel_rows` makes them. An active id outside the global ``[0, V)``
    makes its row's ``lse`` and entropy NaN."""
    local_vocab = blocks[0].shape[-1]
    start = lax.axis_index(axis) * local_vocab
    stats = _launch.stats_op(call, len(blocks) > 1, entropy)(
        blocks[0], blocks[-1], ids, mask, temp, jnp.full((1,), start, ids.dtype)
    )
    lse_k, ref_lse_k, z_a, ref_z_a, mu = stats
    m = jnp.stack([lse_k, ref_lse_k][: len(blocks)])
    shift = _native.finite_or_zero(lax.pmax(m, axis))
    # A block's log-sum-exp is its (m, s) = (lse_k, 1).
    weights = jnp.exp(m - shift)
    terms = (weights, jnp.stack([z_a, ref_z_a][: len(blocks)]))
    if entropy:
        terms += (weights[0] * (mu - shift[0]),)
    s, z_sel, *h = lax.psum(terms, axis)
    bad = mask & ((ids < 0) | (ids >= local_vocab * lax.axis_size(axis)))
    # An out-of-range active id poisons its row; the NaN lse makes its gradient NaN too.
    lse = jnp.where(bad[None], jnp.nan, shift + jnp.log(s))
    ent = jnp.where(bad, jnp.nan, jnp.log(s[0]) - h[0] / s[0]) if entropy else lse[0]
    local = ids - start
    owned = mask & (local >= 0) & (local < local_vocab)
    return z_sel, lse, ent, jnp.where(owned, local, -1).astype(ids.dtype)


def shard_logps(
    call: TritonCall, shards: Sequence[jax.Array], ids: jax.Array, mask: jax.Array,
    temperature: Temperature, axis: str, entropy: bool = False,
) -> Tuple[List[jax.Array], Optional[jax.Array]]:
    """``logp`` float32 ``[N]`` per block in ``shards`` (policy, then optionally reference),
    and with ``entropy`` the policy's entropy ``[N]`` (else None).

    ``shards``: this device's ``[N, V_local]`` blocks; ``ids`` global, ``mask``
    bool, ``temperature`` a float or float32 ``[N]``, all replicated along
    ``axis``. The policy's ``logp`` and entropy are differentiable (the gradient is
    this block's slice of the unsharded one); the reference's is not. Inactive rows
    are 0 with a zero gradient; an active id outside the global ``[0, V)`` gives NaN
    (value and gradient). One ``pmax`` and one ``psum`` in all: the entropy adds one
    ``[N]`` term to the psum, ``W_k (mu_k - shift)`` (``W_k = exp(lse_k - shift)``,
    ``mu_k`` the block's mean ``z``), so ``H = log(S) - sum_k W_k (mu_k - shift) / S``.
    """
    if not varies_over(shards[0], axis):
        raise ValueError(
            f"backend='triton' / 'interpret' with vocab_axis={axis!r} needs the logits typed as "
            f"varying over {axis!r}: call it inside `jax.shard_map(..., check_vma=True)` (the default; with "
            "check_vma=False the gradient would be scaled by 1/axis_size), or use "
            "backend='native'"
        )
    ids_k, mask_k, temp = kernel_rows(ids, mask, temperature)
    z_sel, lse, ent, local_ids = shard_stats(
        call, [lax.stop_gradient(x) for x in shards], ids_k, mask_k, temp, axis, entropy)
    has_ref = len(shards) > 1
    policy_out = _attach(call, shards[0], z_sel[0], lse[0], ent, local_ids, mask_k, temp, axis,
                         entropy)
    out = [policy_out[0]]
    if has_ref:
        out.append(jnp.where(mask, z_sel[1] - lse[1], 0.0))
    return out, policy_out[1] if entropy else None
