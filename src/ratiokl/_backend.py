"""The backend interface both frameworks' routes dispatch to (framework-neutral).

A :class:`Backend` runs on flattened, validated inputs::

    selected_logprobs(logits, ids, mask, temperature) -> logp
    logprobs_entropy(logits, ids, mask, temperature) -> (logp, entropy)   [one pass]
    ratio_kl(policy, ref, ids, mask, old_logps, ref_logps, kl_code, temperature)
        -> (ratio, kl)
    policy_loss(policy, ref, ids, mask, old, ref_logps, adv, iw, weights,
                temperature, opts, inplace_grad, adv_rows=1) -> (loss, metrics)
                                                                  [fused; or None]
    token_weights(mask, opts, normalizer, width) -> weights | None     [or None]
    linear_policy_loss(hidden, weight, bias, transform, ids, mask, old, ref_logps, adv, iw,
                       weights, temperature, opts, chunk_rows) -> (loss, metrics)  [or None]
    linear_selected_logprobs(hidden, weight, bias, ids, mask, temperature, transform,
                             chunk_rows, entropy) -> logp | (logp, entropy)  [or None]
    rollout_weights(mask, old, rollout, seq, iw, rollout_opts, bound)
        -> (weights, metrics)                                          [or None]
    shard_logps(shards, ids, mask, temperature, axis, entropy)
        -> ([logp per block], entropy | None)                          [JAX; or None]
    shard_rows(axis) -> the linear ops' row operations of one block    [JAX; or None]

with ``logits``/``policy``/``ref`` ``[N, V]`` float32 / float16 / bfloat16 (``ref``
without gradient, or None), ``ids`` ``[N]`` integer (not range-checked: clamped
before any read), ``mask`` ``[N]`` bool, the per-row values float32 ``[N]``
without gradient (``adv`` of ``policy_loss``: ``[N // adv_rows]``, one per ``adv_rows``
rows, so per-sequence advantages come as given), ``kl_code`` a Python int, ``opts`` the validated
``ratiokl.spec.PolicyLossOptions`` and ``temperature`` a positive Python float or
float32 ``[N]`` with bad entries NaN. Outputs are float32 ``[N]`` (the loss and
the metrics 0-d), differentiable w.r.t. the policy logits only, in their dtype;
inactive rows are neutral (``logp = 0``, ``ratio = 1``, ``kl = 0``, gradient
exactly 0) whatever they hold; an active row with a bad id or temperature is
NaN; nothing synchronises with the host. A backend without a fused
``policy_loss`` (and GSPO's ``ratio_level="sequence"``, which needs a cross-row
mean of the log-ratio before the objective) takes the two-pass route:
``logprobs_entropy`` (the entropy for ``entropy_mean`` and ``entropy_coef`` from the
same read of the logits), then the objective of ``ratiokl._core.objective`` (written once,
on the framework's array adapter). ``rollout_weights`` (the rollout correction's weights
and metrics in one launch; ``seq`` the sequence log-weights ``[R, 1]`` or ``[R, T]``, or
None) is optional: without it ``ratiokl._core.rollout``'s ops compute the same. The two ops
from hidden states take
``hidden [N, H]``, the lm_head ``weight [V, H]`` and ``bias [V]`` (or None) of one dtype and
``transform``, the validated logit options (``ratiokl.spec.LogitTransform``); they are
differentiable w.r.t. all three; ``linear_policy_loss`` None: the route materialises the
logits and runs ``policy_loss``. ``shard_logps`` (JAX's ``vocab_axis``: one
vocabulary block's log-probs with the kernels, inside ``shard_map``) is optional: without
it the vocabulary-parallel route runs the native math; so does ``shard_rows`` (the linear
ops with ``vocab_axis``: ``ratiokl.jax._linear_logprobs.RowOps`` of one vocabulary block of
the chunk's logits, with the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


__all__ = ["Backend", "inplace_grad_error"]


@dataclass(frozen=True)
class Backend:
    """The functions one backend runs on flattened rows (the interface above)."""

    selected_logprobs: Callable
    ratio_kl: Callable
    logprobs_entropy: Callable  # (logp, entropy) in one pass
    policy_loss: Optional[Callable] = None  # fused; None: two passes
    token_weights: Optional[Callable] = None  # one-launch aggregation weights; None: ops
    rollout_weights: Optional[Callable] = None  # one-launch rollout correction; None: ops
    linear_policy_loss: Optional[Callable] = None  # from hidden states in row chunks; None: no
    shard_logps: Optional[Callable] = None  # JAX vocab_axis block with kernels; None: ops
    linear_selected_logprobs: Optional[Callable] = None  # from hidden states in row chunks
    shard_rows: Optional[Callable] = None  # JAX vocab_axis linear block with kernels; None: ops


def inplace_grad_error(sequence_ratio: bool, compiling: bool = False,
                       fuses: bool = True) -> ValueError:
    """The error for ``policy_loss(inplace_grad=True)`` where the two-pass route runs: it
    writes the gradient as a new array, so the opt-in cannot apply; says where it works.
    ``fuses``: the options' ``PolicyLossOptions.fuses`` (False: ``kl_agg`` / ``entropy_agg``
    / ``kl_clamp`` / ``objective="sapo"`` took the two-pass route)."""
    why = ('`ratio_level="sequence"` (GSPO) takes the two-pass route' if sequence_ratio
           else "`kl_agg` / `entropy_agg` / `kl_clamp` / objective='sapo' take the two-pass "
                "route" if not fuses
           else "torch.compile plans the gradient's buffer itself" if compiling
           else "this backend has no one-kernel policy loss (backend 'native', or "
                "vocabulary-sharded logits)")
    return ValueError(
        f"`inplace_grad=True` cannot apply here: {why}. It writes the gradient into the "
        "logits' buffer on the one-kernel policy loss only: backend 'triton' (or 'auto' on "
        "a GPU, or 'interpret'), ratio_level='token', no kl_agg / entropy_agg / kl_clamp, "
        "objective 'ppo' or 'cispo', "
        "logits not vocabulary-sharded, and in "
        "PyTorch outside torch.compile; pass inplace_grad=False here")
