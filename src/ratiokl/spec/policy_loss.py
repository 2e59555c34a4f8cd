r"""Float64 NumPy reference of the PPO/GRPO policy loss: the numeric spec.

Built on the per-token log-probs of :mod:`ratiokl.spec.reference`. Per active
token :math:`t` (inactive tokens contribute nothing and get a zero gradient), with
:math:`\ell` the log-ratio ``logp - old_logp`` (``ratio_level="token"``; without
``old_logps``, on-policy: ``old_logp = sg(logp)``, so :math:`r = 1`,
:math:`dr/d\log p = 1`), or its mean over :math:`t`'s sequence
(``ratio_level="sequence"``, GSPO), :math:`b` = ``log_ratio_bound`` (None: no bound),
:math:`w` = ``importance_weights`` (default 1), :math:`\mathrm{kl}` one of
``POLICY_KL_ESTIMATORS`` on :math:`d = \log p_\mathrm{ref} - \log p`:

.. math::

    r = \exp\big(\mathrm{clip}(\ell, -b, b)\big), \qquad
    q = \begin{cases} \min(r, r_\mathrm{high}) & A \ge 0 \\
        \min\big(\max(r, 1 - \epsilon), c_\mathrm{neg}\big) & A < 0 \end{cases}

    \mathrm{pg} = -A\, q\, w, \qquad
    \mathrm{loss} = \mathrm{pg} + c_\mathrm{KL}\, \mathrm{kl}

with :math:`r_\mathrm{high} = \min(1 + \epsilon_h, \mathrm{ratio\_cap})`,
:math:`c_\mathrm{neg} = \min(\mathrm{dual\_clip}, \mathrm{ratio\_cap})`,
:math:`\epsilon, \epsilon_h, c_\mathrm{KL}` = ``clip_eps``, ``clip_eps_high``,
``kl_coef``.

With ``rollout_logps`` the rollout correction's detached weight
(:mod:`ratiokl.spec.rollout`) multiplies ``w``.

With ``objective="cispo"`` (MiniMax-M1's CISPO) the policy term is instead, with the
weight :math:`w_c` detached, for every advantage:

.. math::

    w_c = \mathrm{clip}(r, 1 - \epsilon, r_\mathrm{high}), \qquad
    \mathrm{pg} = -A\, w_c\, w \log p, \qquad
    \frac{d\, \mathrm{pg}}{d \log p} = -A\, w_c\, w

so every active token carries a gradient, its size set by the clipped weight;
``clip_fraction_low`` / ``_high`` count ``r < 1 - clip_eps`` / ``r > ratio_high``
whatever the sign of ``A``. ``r_high = min(1 + clip_eps_high, ratio_cap)``, where
``ratio_cap`` may be any positive number (below 1: TRL's ``epsilon_high <= 1``).
``dual_clip`` is rejected (the weight is bounded already); with ``ratio_level="sequence"``
``r`` is the sequence ratio ``s_i`` (a sequence-level truncated importance weight on each
token's log-prob).

The PPO term equals ``max(-A*r, -A*clip(r, 1-eps, 1+eps_high))`` with the dual clip
``min(., -A*c)`` for ``A < 0`` (PPO, DAPO clip-higher, dual-clip PPO,
INTELLECT-2's delta). Gradient with respect to ``logp`` (a clipped or capped
branch, and a log-ratio outside the bound, carry none; GSPO: through the token's own
``logp`` only, i.e. ``sg(s_i) * pi_t / sg(pi_t)`` as in verl; a NaN log-ratio is not
beyond the bound, so its gradient stays NaN; a clipped token's gradient is selected, exactly
0 whatever ``A``, ``w`` and ``dr`` hold):

.. math::

    \frac{dr}{d \log p} = \begin{cases} r & |\ell| \le b \\ 0 & \text{otherwise}
                          \end{cases}, \qquad
    \frac{dq}{dr} = \begin{cases} 1 & \text{on the unclipped branch} \\
                    0 & \text{otherwise} \end{cases}

With ``entropy_coef`` (:math:`c_H`, verl's ``entropy_coeff``) the per-token loss gains
an entropy bonus aggregated with the very weights of the policy term
(:func:`ratiokl.spec.entropy`; :math:`z` the logits, a ``-inf`` logit has
:math:`p_v = 0` and adds 0):

.. math::

    H_t = -\sum_v p_v \log p_v, \quad p = \mathrm{softmax}(z_t / T), \qquad
    \mathrm{loss}_t = \mathrm{pg} + c_\mathrm{KL}\, \mathrm{kl} - c_H H_t, \qquad
    \frac{\partial H_t}{\partial z_v} = -\frac{p_v (\log p_v + H_t)}{T}

i.e. ``agg(pg + kl_coef * kl) - c_H * agg(H)``.

(``c_H > 0`` rewards entropy, ``c_H < 0`` penalises it). ``entropy_mean``, the mean of
``H_t`` over active tokens, is always reported, whatever ``c_H``.

The aggregation is ``sum_t a_t * loss_t / D`` (``a_t = 1`` except
``seq-mean-token-mean``: ``1 / |active tokens of t's sequence|``; ``D``: active
tokens, 1, sequences with an active token, or the padded length ``T`` for
``seq-mean-token-sum-norm``; ``loss_normalizer`` replaces ``D``). A count of 0
gives loss 0, never NaN. ``loss_agg="none"`` aggregates nothing: the loss is the
per-token :math:`\mathrm{loss}_t` ``[...]`` above (0 on inactive tokens; GSPO: with the
sequence ratio, the very term the other modes weigh), so that every mode's loss is
``sum(loss_none * w)`` with its weights ``w_t = a_t / D``, and its gradient is per
token (an upstream ``g_t`` scales token :math:`t`'s own gradient only: GSPO's value
``sg(s_i)`` carries no gradient across tokens). ``loss_normalizer`` is refused with it.
``kl_agg`` / ``entropy_agg`` (None: the term joins ``loss_t`` above) aggregate the KL /
entropy term apart, by their own ``(a', D')`` (``D'`` = ``kl_entropy_normalizer`` when
given), so that ``loss = sum_t a_t w pg_t / D + c_KL sum_t a'_t kl_t / D'_KL - c_H sum_t
a''_t H_t / D'_H`` (OpenRLHF's token-mean KL and entropy under a sequence-level policy
loss; TRL's token-mean entropy bonus); refused with ``loss_agg="none"``. ``kl_clamp``
(:math:`c`) replaces the KL value by :math:`\mathrm{clip}(\mathrm{kl}, -c, c)`, its gradient
by 0 where :math:`|\mathrm{kl}| > c` (kept at :math:`|\mathrm{kl}| = c`, as ``torch.clamp``),
except for ``k1+`` / ``k3+``, whose gradient stays k2's (the clamp acts on the detached value).
Sequences are the rows of the leading shape
``[..., T]``; with ``segment_ids`` a new sequence starts at every active token
whose id differs from the previous active token's in the same row.

References:
    Schulman et al., "Proximal Policy Optimization Algorithms" (2017); Ye et al.,
    "Mastering Complex Control in MOBA Games" (2019, dual-clip); Yu et al., "DAPO"
    (2025, clip-higher, token-mean); Liu et al., "Understanding R1-Zero-Like
    Training" (2025, Dr. GRPO); Zheng et al., "Group Sequence Policy Optimization"
    (2025); Prime Intellect, "INTELLECT-2" (2025, delta); Schulman, "Approximating
    KL Divergence" (2020); DeepSeek-AI, "DeepSeek-V3.2" (2025, ratio-weighted KL).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from ratiokl.spec.policy_terms import policy_loss_terms
from ratiokl.spec.reference import (
    ArrayLike,
    entropy,
    entropy_grad,
    selected_logprobs,
    selected_logprobs_grad,
)

__all__ = ["policy_loss", "policy_loss_grad"]


def _reference_logps(ref_logits, ref_logps, action_ids, mask, temperature):
    if ref_logps is not None:
        return np.where(mask, np.asarray(ref_logps, dtype=np.float64), 0.0)
    if ref_logits is None:
        return None
    return selected_logprobs(ref_logits, action_ids, mask, temperature=temperature)


def _from_logits(policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
                 ref_logps, temperature, options):
    """``policy_loss_terms`` of logits: the log-probs and entropies of ``policy_logits``."""
    mask = np.asarray(mask, dtype=bool)
    logp = selected_logprobs(policy_logits, action_ids, mask, temperature=temperature)
    logp_ref = _reference_logps(ref_logits, ref_logps, action_ids, mask, temperature)
    ent = entropy(policy_logits, mask, temperature=temperature)
    arrays = {k: options.pop(k, None)
              for k in ("loss_normalizer", "segment_ids", "importance_weights",
                        "kl_entropy_normalizer")}
    return policy_loss_terms(logp, logp_ref, old_logps, advantages, mask, ent, **arrays,
                             **options)


def policy_loss(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike, *,
    ref_logps: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0, **options,
) -> Tuple[float, Dict[str, float]]:
    """Float64 ``(loss, metrics)`` of ``policy_loss`` (same arguments as the frameworks').

    ``metrics`` has ``entropy_mean`` besides :func:`policy_loss_from_logps`'s.
    """
    loss, _, _, metrics = _from_logits(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        ref_logps, temperature, dict(options),
    )
    return loss, metrics


def policy_loss_grad(
    policy_logits: np.ndarray, ref_logits: Optional[np.ndarray], action_ids: np.ndarray,
    mask: np.ndarray, old_logps: Optional[np.ndarray], advantages: ArrayLike, *,
    ref_logps: Optional[np.ndarray] = None, temperature: ArrayLike = 1.0,
    loss_cotangent: Optional[np.ndarray] = None, **options,
) -> np.ndarray:
    """Gradient of the loss w.r.t. ``policy_logits``: float64 ``[..., V]``, 0 on inactive rows.

    Through ``logp`` (``selected_logprobs_grad``) and, with ``entropy_coef``, through the
    entropy (``entropy_grad``: ``-c_H a_t / D`` times ``dH_t/dz``). ``loss_cotangent``: the
    upstream gradient of a ``loss_agg="none"`` loss, ``[...]`` (None: 1; never read on
    inactive rows).
    """
    _, dlogp, dent, _ = _from_logits(
        policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
        ref_logps, temperature, dict(options),
    )
    if loss_cotangent is not None:
        dlogp, dent = (_scaled(x, loss_cotangent, mask) for x in (dlogp, dent))
    grad = selected_logprobs_grad(policy_logits, action_ids, mask, dlogp,
                                  temperature=temperature)
    if np.any(dent != 0.0):
        grad = grad + entropy_grad(policy_logits, mask, dent, temperature=temperature)
    return grad


def _scaled(per_token: np.ndarray, cotangent: ArrayLike, mask: np.ndarray) -> np.ndarray:
    """``per_token * cotangent`` on active tokens, 0 on the others (whatever the cotangent
    holds there)."""
    mask = np.asarray(mask, dtype=bool)
    cot = np.where(mask, np.broadcast_to(np.asarray(cotangent, np.float64), mask.shape), 0.0)
    return np.where(mask, per_token * cot, 0.0)
