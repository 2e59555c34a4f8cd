"""TRL's ``GRPOConfig`` as ratiokl's loss options, resolved once when the trainer is built.

:func:`loss_options` maps it to the options of :func:`ratiokl.torch.loss.policy_objective`
(and, at the token level, of :func:`~ratiokl.torch.loss.linear_policy_loss`). Whatever
ratiokl would compute differently is refused with a ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any, Dict, NoReturn

from ratiokl.adapters import refuse

__all__ = ["LOSS_AGG", "PPO_TYPES", "loss_options", "refuse_trl"]

#: TRL ``loss_type`` -> ratiokl ``loss_agg`` (the denominators: ``GRPOTrainer._normalizer``).
LOSS_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "token-mean",
            "dapo": "token-mean", "cispo": "token-mean", "luspo": "seq-mean-token-sum",
            "sapo": "seq-mean-token-mean", "vespo": "token-mean"}
#: The loss types whose clipped ratio TRL logs as ``clip_ratio/*``.
PPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def refuse_trl(field: str, value: Any, why: str) -> NoReturn:
    """The adapter's ``ValueError`` for ``field=value``, pointing at ``trl.GRPOTrainer``."""
    refuse("ratiokl.adapters.trl.GRPOTrainer", "trl.GRPOTrainer", field, value, why)


def _entropy_options(args: Any, loss_type: str, quantile: float) -> Dict[str, Any]:
    """TRL's entropy bonus ``- c * mean(H) / GA``, a mean over the active tokens whatever
    the ``loss_type`` (``c`` is ``entropy_coef``, or, with ``use_adaptive_entropy``, the
    controller's value for the step: ``ratiokl.adapters._trl_bonus``): ratiokl's
    ``entropy_coef`` with ``entropy_agg="token-mean"`` over ``kl_entropy_normalizer =
    max(active tokens, 1) * GA`` (per step); for ``bnpo``, whose loss is that same token
    mean, ``entropy_coef`` alone (the one-pass route). With ``top_entropy_quantile < 1``
    TRL averages the bonus over the high-entropy tokens only: the adapter passes the
    entropy times that mask and their count as the normaliser (every ``loss_type``)."""
    coef = float(getattr(args, "entropy_coef", 0.0))
    adaptive = bool(getattr(args, "use_adaptive_entropy", False))
    if coef == 0.0 and not adaptive:
        return {"entropy_coef": 0.0}
    if loss_type == "bnpo" and quantile >= 1.0:
        return {"entropy_coef": coef}
    return {"entropy_coef": coef, "entropy_agg": "token-mean"}


def loss_options(args: Any) -> Dict[str, Any]:
    """The :func:`~ratiokl.torch.loss.policy_objective` options of a ``trl.GRPOConfig``
    (those fixed for the run; the denominator is per step, the entropy mask per batch).

    ``vespo`` maps to CISPO's form, which the adapter runs on-policy with TRL's gamma
    weight as ``importance_weights`` (``_trl_vespo``); ``sapo`` to ``objective="sapo"``.
    ``ratio_level`` is ``"token"`` or ``"sequence"`` (GSPO: TRL's
    ``exp(masked mean of the log-ratio)`` per sequence; ratiokl's GSPO-token form has its
    value and, with per-sequence advantages, its gradient). ``ValueError`` naming the field
    for whatever ratiokl does not compute as TRL does.
    """
    loss_type = args.loss_type
    if loss_type not in LOSS_AGG:
        refuse_trl("loss_type", loss_type, f"ratiokl implements {sorted(LOSS_AGG)}")
    level = args.importance_sampling_level
    if level not in ("token", "sequence"):
        refuse_trl("importance_sampling_level", level, "TRL has 'token' and 'sequence'")
    quantile = float(getattr(args, "top_entropy_quantile", 1.0))
    bias_corrected = bool(getattr(args, "use_bias_correction_kl", False))
    eps_low = args.epsilon
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high
    options: Dict[str, Any] = {
        "loss_agg": LOSS_AGG[loss_type],
        "kl_coef": float(args.beta),
        "kl_estimator": "k3-is" if bias_corrected else "k3",
        "ratio_level": level,
        **_entropy_options(args, loss_type, quantile),
    }
    if loss_type == "cispo":  # TRL: min(r, epsilon_high), detached, on logp; no floor
        if not eps_high > 0.0:
            refuse_trl("epsilon_high", eps_high, "CISPO's epsilon_high is the cap of the "
                       "ratio, a weight (e.g. 5.0), and ratiokl's ceiling is positive")
        options.update(objective="cispo", clip_eps=1.0, clip_eps_high=eps_high - 1.0)
        if eps_high <= 1.0:  # a ceiling at or below 1 (e.g. TRL's default epsilon 0.2)
            options.update(clip_eps_high=0.0, ratio_cap=eps_high)
    elif loss_type == "vespo":  # TRL: -sg(phi) * A * logp; the adapter adds phi (trl.py)
        options.update(objective="cispo", clip_eps=1.0, clip_eps_high=0.0)
    elif loss_type == "sapo":  # TRL: -A * 4 / tau * sigmoid(tau * (r - 1)); no clip, no delta
        options.update(objective="sapo", sapo_temperatures=(
            float(args.sapo_temperature_pos), float(args.sapo_temperature_neg)))
    else:
        options.update(_clip_options(eps_low, eps_high, args.delta))
    return options


def _clip_options(eps_low: float, eps_high: float, delta: Any) -> Dict[str, Any]:
    """TRL's PPO clip with ``delta``: ``-min(min(r, delta) A, clip(r, 1 - epsilon, 1 +
    epsilon_high) A)``, whose ratio is capped at ``min(delta, 1 + epsilon_high)`` beside a
    positive advantage and at ``max(delta, 1 + epsilon_high)`` beside a negative one.
    ``delta > 1 + epsilon_high``: ratiokl's ``ratio_cap`` (the second cap); else the
    first cap is the clip ``1 + clip_eps_high = delta`` and the second the dual clip
    ``1 + epsilon_high``. Refused below 1 (ratiokl's ceiling is at least 1)."""
    if delta is None or delta > 1.0 + eps_high:
        return {"clip_eps": eps_low, "clip_eps_high": eps_high, "ratio_cap": delta}
    if not delta >= 1.0 or eps_high == 0.0:
        refuse_trl("delta", delta, "TRL then caps the ratio of positive advantages at "
                   f"min(delta, 1 + epsilon_high) = {min(delta, 1.0 + eps_high)}, and "
                   "ratiokl's clip ceiling 1 + clip_eps_high is above 1 (or equal to it with "
                   "a dual clip above 1). Set delta >= 1 with epsilon_high > 0, or delta "
                   "above 1 + epsilon_high (INTELLECT-2's delta, e.g. 4.0)")
    return {"clip_eps": eps_low, "clip_eps_high": delta - 1.0, "dual_clip": 1.0 + eps_high}
