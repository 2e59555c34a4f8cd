"""The one-pass fused ``policy_loss`` on the JAX ``"triton"`` backend (jax-triton).

Mirrors ``ratiokl.torch._fused_loss`` with the same kernels:
``policy_loss_kernel`` writes per row ``w * loss_t``, the metrics pieces and
the policy-logit gradient of ``sum_t w_t * loss_t`` (in the logits' dtype)
in one program; a ``jax.custom_vjp`` keeps that gradient as its residual and
its backward is ``scale_rows_kernel``: the residual scaled by each row's
cotangent through ``input_output_aliases`` (XLA reuses the residual's
buffer when nothing else holds it), skipped on the device for rows whose
cotangent is exactly 1 and for inactive rows. Both calls fold ``vmap``
batch dimensions into rows (``ratiokl.jax._triton._row_op``). The
aggregation weights before the kernel, and the metrics and the loss's sum
after it, are one launch each (``ratiokl.jax._loss_rows``), as in PyTorch.

Which options fuse (:func:`fuses`): all but ``ratio_level="sequence"``
(GSPO) and vocabulary-sharded logits (``vocab_axis``), which take the
two-pass path. Float options are compile-time constants of the kernel;
``V`` and the strides too (jax-triton gives runtime integers no alignment
facts, see ``ratiokl.jax._triton``). The primal (no derivative taken) runs
the kernel without its gradient sweep: one read of each row, O(N) memory;
the custom_vjp forward writes the ``[N, V]`` gradient in the logits' dtype.
"""

from __future__ import annotations

import functools
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from ratiokl._kernels.fused_loss import launch_plan, policy_loss_kernel, scale_rows_kernel
from ratiokl.jax import _loss_rows, _objective, _triton
from ratiokl.spec import PolicyLossOptions

__all__ = ["fuses", "policy_loss"]

#: Tile of the in-place scale (a plain streaming read-modify-write).
_SCALE_BLOCK = 4096

#: (has_ref, has_iw, kl_code, kl_coef, ratio_low, ratio_high, neg_cap, bound): static.
Static = Tuple[bool, bool, int, float, float, float, float, float]


def fuses(backend_module: object, opts: PolicyLossOptions) -> bool:
    """Whether ``policy_loss`` with these options on this backend takes the fused kernel."""
    return backend_module is _triton and not opts.sequence_ratio


def _fused_call(static: Static, write_grad: bool, inplace: bool, policy, ref, ids, mask, old,
                ref_lp, temp, adv, iw, w):
    """``(loss_rows, logp, ratio, kl, clip_bits, grad)`` from one launch.

    Without ``write_grad`` (the primal, no derivative taken) the kernel reads
    each row once and ``grad`` is an unwritten ``[N, 1]`` placeholder.
    ``inplace``: ``grad`` aliases ``policy``'s buffer (``input_output_aliases``;
    the kernel reads each tile before overwriting it). XLA honours it without a
    copy only where ``policy`` is not needed afterwards, e.g. donated to ``jit``.
    """
    n_rows, vocab = policy.shape
    row = jax.ShapeDtypeStruct((n_rows,), jnp.float32)
    shapes = [row] * 4 + [
        jax.ShapeDtypeStruct((n_rows,), jnp.int32),
        jax.ShapeDtypeStruct((n_rows, vocab if write_grad else 1), policy.dtype),
    ]
    if n_rows == 0:
        return tuple(jnp.zeros(s.shape, s.dtype) for s in shapes)
    has_ref, has_iw, kl_code, kl_coef, ratio_low, ratio_high, neg_cap, bound = static
    plan = launch_plan(vocab, policy.dtype.itemsize, n_rows, write_grad)
    n_counters = plan.counters(n_rows)  # 0: none used, none zeroed (any buffer will do)
    scratch = [jax.ShapeDtypeStruct((n_rows, plan.spans.splits, 4), jnp.float32),
               jax.ShapeDtypeStruct((n_counters or 1,), jnp.int32)]  # partials; counters
    aliases = {"input_output_aliases": {0: 5}} if inplace and write_grad else {}
    outs = _triton._triton_call(
        policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w,
        kernel=policy_loss_kernel, out_shape=shapes + scratch,
        zeroed_outputs=(7,) if n_counters else (),
        grid=(plan.programs(n_rows),), num_warps=plan.config.num_warps,
        N=n_rows, V=vocab, stride_pn=vocab, stride_pv=1, stride_rn=vocab, stride_rv=1,
        stride_t=0 if temp.shape[0] == 1 else 1,
        HAS_REF=has_ref, HAS_IW=has_iw, KL_CODE=kl_code, KL_COEF=kl_coef,
        RATIO_LOW=ratio_low, RATIO_HIGH=ratio_high, NEG_CAP=neg_cap, BOUND=bound,
        WRITE_GRAD=write_grad, SPLITS=plan.spans.splits,
        TILES_PER_SPLIT=plan.spans.tiles_per_split, SPANS=plan.spans_per_program,
        BLOCK_V=plan.config.block_v, **aliases,
    )
    return tuple(outs[:6])


def _scale_call(grad, g, mask):
    """``grad[i] * g[i]`` on active rows with ``g[i] != 1``, in ``grad``'s (aliased) buffer."""
    n_rows, vocab = grad.shape
    if n_rows == 0:
        return grad
    return _triton._triton_call(
        grad, g, mask,
        kernel=scale_rows_kernel, out_shape=jax.ShapeDtypeStruct(grad.shape, grad.dtype),
        grid=(n_rows,), num_warps=8, input_output_aliases={0: 0},
        V=vocab, stride_g=1, BLOCK_V=min(_SCALE_BLOCK, max(16, 1 << (vocab - 1).bit_length())),
    )


@functools.lru_cache(maxsize=None)
def _fused_op(static: Static, write_grad: bool, inplace: bool = False):
    call = functools.partial(_fused_call, static, write_grad, inplace)
    return _triton._row_op(call, temp_index=6)


_scale_op = _triton._row_op(_scale_call, temp_index=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11))
def _fused(policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, static: Static,
           inplace: bool):
    return _fused_op(static, False)(policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w)[:5]


def _fused_fwd(policy, ref, ids, mask, old, ref_lp, temp, adv, iw, w, static, inplace):
    outs = _fused_op(static, True, inplace)(policy, ref, ids, mask, old, ref_lp, temp, adv,
                                            iw, w)
    return outs[:5], (outs[5], mask)


def _fused_bwd(static, inplace, residuals, cotangents):
    del static, inplace
    grad, mask = residuals
    g_loss = cotangents[0].astype(jnp.float32)
    return (_scale_op(grad, g_loss, mask),) + (None,) * 9


_fused.defvjp(_fused_fwd, _fused_bwd)


def _flat(x: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if x is None else lax.stop_gradient(x.reshape(-1).astype(jnp.float32))


def policy_loss(
    policy: jax.Array, ref: Optional[jax.Array], ids: jax.Array, mask: jax.Array,
    ref_logps: Optional[jax.Array], temperature: _triton.Temperature,
    inputs: _objective.TokenInputs, opts: PolicyLossOptions, lead: Tuple[int, ...],
    inplace_grad: bool = False,
) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """Fused ``(loss, metrics)`` on flattened rows (requires :func:`fuses`).

    Args:
      policy: ``[N, V]`` logits, the only differentiable input.
      ref: ``[N, V]`` reference logits or None; ref_logps: float ``[N]`` or None.
      ids, mask: ``[N]`` integer / bool. temperature: a float or float32 ``[N]``.
      inputs, opts, lead: as for ``_objective.policy_objective`` (``[R, T]`` layout
        of the leading shape ``lead``).
      inplace_grad: the gradient's buffer aliases ``policy``'s (see :func:`_fused_call`).

    Returns:
      The float32 0-d loss (its gradient reaches ``policy`` only, in its dtype)
      and the metrics of ``_objective.token_metrics`` (stop-gradient).
    """
    w = _loss_rows.aggregation_weights(_objective.as_rows(mask, lead), inputs, opts).reshape(-1)
    ids, mask_k, temp = _triton._rows(ids, mask, temperature)
    old, adv = _flat(inputs.old_logps), _flat(inputs.advantages)
    iw = _flat(inputs.importance_weights)
    has_ref = ref is not None or ref_logps is not None
    static: Static = (
        ref is not None, iw is not None, opts.kl_code if has_ref else 0, opts.kl_coef,
        opts.ratio_low, opts.ratio_high, opts.neg_cap or 0.0, opts.log_ratio_bound or 0.0,
    )
    ref_in = policy if ref is None else lax.stop_gradient(ref)  # placeholder, never read
    ref_lp = w if ref_logps is None else _flat(ref_logps)
    loss_rows, logp, ratio, kl, bits = _fused(
        policy, ref_in, ids, mask_k, old, ref_lp, temp, adv, w if iw is None else iw,
        lax.stop_gradient(w), static, inplace_grad,
    )
    return _loss_rows.loss_and_metrics(loss_rows, mask_k, logp, ratio, kl, bits, old)
