"""OpenRLHF's ``PolicyLoss`` constructor arguments as ratiokl's options, resolved once.

Pure Python (no framework import): :func:`loss_options` reads the arguments
``ActorPPOTrainer.__init__`` passes (``--actor.*``, ``--algo.advantage.is_correction_*``)
and returns the :func:`ratiokl.torch.loss.policy_objective` options fixed for the run, or
raises the adapters' ``ValueError`` naming the OpenRLHF argument whose semantics ratiokl
does not compute (docs/trainers.md, "OpenRLHF", says why for each). The per-step
denominators (``get_loss_batch_info``'s ``batch_num_tokens``, ``global_batch_size`` and
``dp_size``) are the forward's: :func:`loss_normalizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, NoReturn, Optional, Sequence, Union

from ratiokl.adapters import refuse

__all__ = ["CorrectionGating", "CorrectionLevel", "CorrectionMode", "LossOptions",
           "PolicyLossType", "loss_normalizer", "loss_options"]

#: OpenRLHF 0.11's ``--actor.policy_loss_type``.
PolicyLossType = Literal["ppo", "gspo"]
#: OpenRLHF 0.11's ``--algo.advantage.is_correction_{level,mode,gating}``.
CorrectionLevel = Literal["off", "token", "seq"]
CorrectionMode = Literal["mask", "clip"]
CorrectionGating = Literal["ratio", "binary_kl", "tv"]

_ADAPTER = "ratiokl.adapters.openrlhf.PolicyLoss"
_FALLBACK = "openrlhf.models.PolicyLoss"


def _refuse(field: str, value: Any, why: str) -> NoReturn:
    refuse(_ADAPTER, _FALLBACK, field, value, why)


@dataclass(frozen=True)
class LossOptions:
    """What the drop-in computes with: ``options`` for ``policy_objective`` (without the
    denominator), and how the forward reads its inputs.

    ``token_level``: OpenRLHF's ``token_level_loss`` (the denominator is
    ``batch_num_tokens`` rather than ``global_batch_size``). ``ratio_to_rollout``: GSPO
    with a correction level on takes its ratio against ``rollout_log_probs``.
    ``corrects``: the rollout correction is on (``vllm_kl`` and ``is_filter_ratio`` are
    returned); ``sequence_gate``: at the sequence level. ``bounds``: its ``(low, high)``.
    ``divergence``: the PPO correction's gate, ``"binary_kl"`` or ``"tv"`` (the forward
    computes its weight and passes it as ``importance_weights``), else None.
    """

    options: Dict[str, Any]
    token_level: bool
    ratio_to_rollout: bool
    corrects: bool
    sequence_gate: bool
    bounds: tuple
    divergence: Optional[str] = None


def _refuse_as_openrlhf(dual_clip: Optional[float], level: str, mode: str, gating: str,
                        threshold: Sequence[float]) -> None:
    """What OpenRLHF 0.11's ``PolicyLoss.__init__`` itself refuses, whatever the
    ``policy_loss_type``: a ``dual_clip`` not above 1, ``is_correction_mode="clip"``
    beside the sequence level or a divergence gate, and a divergence gate (``binary_kl``,
    ``tv``; a level on) with a lower bound above 0 (the default ``(0.5, 5.0)``)."""
    if dual_clip is not None and not float(dual_clip) > 1.0:
        _refuse("dual_clip", dual_clip, "OpenRLHF's PolicyLoss asserts dual_clip > 1.0 too")
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        _refuse("is_correction_mode", "clip", "OpenRLHF's PolicyLoss refuses it too: its "
                "clip needs is_correction_level='token' and is_correction_gating='ratio'")
    if gating != "ratio" and level != "off" and float(threshold[0]) > 0:
        _refuse("is_correction_gating", gating, f"OpenRLHF's PolicyLoss refuses it too "
                f"with is_correction_threshold={tuple(threshold)}: a divergence gate takes an "
                "upper bound only (a lower bound of 0, e.g. (0.0, 0.01))")


def loss_options(clip_eps_low: float = 0.2, clip_eps_high: float = 0.2,
                 dual_clip: Optional[float] = None, token_level_loss: bool = True,
                 policy_loss_type: PolicyLossType = "ppo",
                 is_correction_level: CorrectionLevel = "off",
                 is_correction_mode: CorrectionMode = "mask",
                 is_correction_gating: CorrectionGating = "ratio",
                 is_correction_threshold: Sequence[float] = (0.5, 5.0)) -> LossOptions:
    """The options of OpenRLHF 0.11's ``PolicyLoss(...)`` arguments (same names and
    defaults); ``ValueError`` naming the argument for what ratiokl computes otherwise."""
    if policy_loss_type not in ("ppo", "gspo"):
        _refuse("policy_loss_type", policy_loss_type, "OpenRLHF 0.11 has 'ppo' and 'gspo'")
    if is_correction_level not in ("off", "token", "seq"):
        _refuse("is_correction_level", is_correction_level, "OpenRLHF 0.11 has off/token/seq")
    if is_correction_mode not in ("mask", "clip"):
        _refuse("is_correction_mode", is_correction_mode, "OpenRLHF 0.11 has mask/clip")
    if is_correction_gating not in ("ratio", "binary_kl", "tv"):
        _refuse("is_correction_gating", is_correction_gating,
                "OpenRLHF 0.11 has ratio/binary_kl/tv")
    _refuse_as_openrlhf(dual_clip, is_correction_level, is_correction_mode,
                        is_correction_gating, is_correction_threshold)
    gspo = policy_loss_type == "gspo"
    options: Dict[str, Any] = dict(
        clip_eps=float(clip_eps_low), clip_eps_high=float(clip_eps_high), dual_clip=dual_clip,
        loss_agg="seq-mean-token-mean" if gspo or not token_level_loss else "token-mean",
        ratio_level="sequence" if gspo else "token",
        # OpenRLHF clamps the PPO log-ratio to [-20, 20] (zero gradient beyond: ratiokl's
        # bound) and leaves GSPO's sequence log-ratio unbounded.
        log_ratio_bound=None if gspo else 20.0)
    low, high = (float(x) for x in is_correction_threshold)
    on = is_correction_level != "off"
    divergence = None
    if on and not gspo:  # GSPO applies no correction weight, only the ratio's reference
        if is_correction_gating != "ratio":
            # ratiokl's rollout corrections gate on the ratio; a divergence gate's weight is
            # the forward's (_policy_loss._divergence_weights), given as importance_weights.
            divergence = is_correction_gating
        else:
            options["rollout_correction"] = (
                "sequence-geomean-mask" if is_correction_level == "seq"
                else "token-clip" if is_correction_mode == "clip" else "token-mask")
            options["rollout_bounds"] = (low, high)
    return LossOptions(options=options, token_level=options["loss_agg"] == "token-mean",
                       ratio_to_rollout=on and gspo, corrects=on and not gspo,
                       sequence_gate=is_correction_level == "seq", bounds=(low, high),
                       divergence=divergence)


def loss_normalizer(opts: LossOptions, dp_size: int, batch_num_tokens: Union[None, float, Any],
                    global_batch_size: Union[None, float, Any]):
    """``aggregate_loss``'s denominator: ``batch_num_tokens / dp_size`` (token level) or
    ``global_batch_size / dp_size`` (sequence level); None when OpenRLHF's count is None
    (then the local active tokens / non-empty sequences, as its ``masked_mean``)."""
    count = batch_num_tokens if opts.token_level else global_batch_size
    return None if count is None else count / dp_size
