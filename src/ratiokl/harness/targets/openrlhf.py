"""OpenRLHF's own policy loss as a check target (OpenRLHF 0.11.2; ``ratiokl[openrlhf]``).

``ratiokl check --target ratiokl.harness.targets.openrlhf:TARGET`` runs the fixtures'
``policy_loss`` and ``policy_objective`` cases through ``openrlhf.models``: ``PolicyLoss``
(clip, dual clip, token- or sequence-level loss, GSPO), then ``+ kl_coef *
aggregate_loss(compute_approx_kl(...))`` and ``- entropy_coef * aggregate_loss(entropy)``
as ``PPOActor.training_step`` adds them (always token-level: OpenRLHF's documented
difference, reported on the other modes). From logits: ``log_probs_from_logits`` and
``compute_entropy`` on float32 logits (alone: the ``selected_logprobs`` cases; with
``compute_approx_kl``: the ``ratio_kl`` ones).

OpenRLHF's model package imports ``flash_attn`` (CUDA only); where it is absent, its four
modules are stubbed during the import (functions raising ``NotImplementedError``, used only
by sample packing, never here) and removed after it.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import sys
import types
from typing import Iterator, Mapping, Optional, Sequence

from ratiokl.harness._protocol import TargetCall, TargetResult
from ratiokl.harness.targets import _torch
from ratiokl.spec import DEFAULT_LOG_RATIO_BOUND

__all__ = ["FLASH_ATTN_STUBS", "NAN_PADDED", "OPTIONS", "OpenRLHFTarget", "TARGET",
           "stubbed_if_absent"]

#: ratiokl option -> OpenRLHF's argument (the rest: :func:`_refusal`).
OPTIONS = {
    "clip_eps / clip_eps_high": "actor.eps_clip_low_high (None: clip_eps)",
    "dual_clip": "actor.dual_clip",
    "loss_agg": "actor.loss_agg_mode: token-mean (token_level_loss) or seq-mean-token-mean",
    "loss_normalizer": "batch_num_tokens (token-mean) or global_batch_size (seq-mean-token-mean)",
    "ratio_level": "actor.policy_loss_type = 'gspo' for 'sequence'",
    "kl_coef / kl_estimator": "algo.kl.use_loss, init_coef, estimator (k1, k2, k3)",
    "entropy_coef": "actor.entropy_coef",
}

#: The fixture ops this target runs: the loss, the actor's per-token values, the KL.
_OPS = _torch.POLICY_OPS + _torch.TOKEN_OPS

#: The modules of ``flash_attn`` OpenRLHF's model package imports, and their names it uses.
FLASH_ATTN_STUBS = {
    "flash_attn": (), "flash_attn.utils": (),
    "flash_attn.bert_padding": ("index_first_axis", "pad_input", "rearrange", "unpad_input"),
    "flash_attn.utils.distributed": ("all_gather",),
}


def _stub(name: str):
    def call(*_, **__):
        raise NotImplementedError(f"{name} is stubbed (a CUDA-only package, not installed)")
    return call


@contextlib.contextmanager
def stubbed_if_absent(stubs: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """Inside, each module of ``stubs`` (name -> the names it defines, functions raising
    ``NotImplementedError``) whose top-level package is neither imported nor installed is
    a stub in ``sys.modules``; after, the stubs are gone (nothing else sees them)."""
    absent = {name for name in stubs if "." not in name and name not in sys.modules
              and importlib.util.find_spec(name) is None}
    added = []
    for name, attrs in stubs.items():
        if name.split(".")[0] not in absent:
            continue
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        for attr in attrs:
            setattr(module, attr, _stub(f"{name}.{attr}"))
        sys.modules[name] = module
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            del sys.modules[name]


def _openrlhf():
    """``(loss, utils)`` modules of ``openrlhf.models``, ``flash_attn`` stubbed if absent."""
    with stubbed_if_absent(FLASH_ATTN_STUBS):
        from openrlhf.models import loss, utils
    return loss, utils


def _refusal(call: TargetCall) -> Optional[str]:
    """Why OpenRLHF cannot express ``call``'s options, or None."""
    reason = _torch.refusal(call, "OpenRLHF", _OPS)
    if reason is not None or call.op in _torch.TOKEN_OPS:
        return reason
    mode = call.option("loss_agg", "token-mean")
    if mode not in ("token-mean", "seq-mean-token-mean"):
        return f"OpenRLHF has token-mean and seq-mean-token-mean only (loss_agg={mode!r})"
    for name in ("ratio_cap", "importance_weights"):
        if call.option(name) is not None:
            return f"OpenRLHF's PolicyLoss has no {name}"
    if call.option("objective", "ppo") != "ppo":
        return "OpenRLHF has no CISPO or SAPO objective"
    if call.option("kl_coef", 0.0) and call.option("kl_estimator", "k3") not in ("k1", "k2", "k3"):
        return f"OpenRLHF has no kl_estimator={call.option('kl_estimator')!r}"
    if call.option("log_ratio_bound", DEFAULT_LOG_RATIO_BOUND) != DEFAULT_LOG_RATIO_BOUND:
        return "OpenRLHF's log-ratio clamp is fixed at 20 (log_ratio_bound)"
    if call.option("old_logps") is None and call.op.startswith("policy_objective"):
        return "OpenRLHF's PolicyLoss needs old log-probs"
    return None


class OpenRLHFTarget(_torch.TrainerTarget):
    """OpenRLHF 0.11.2's ``PolicyLoss``, KL loss and entropy bonus."""

    key, label = "openrlhf", "OpenRLHF"
    load = staticmethod(_openrlhf)
    refusal = staticmethod(_refusal)

    def __call__(self, call: TargetCall) -> TargetResult:
        loss_module, utils = _openrlhf()
        entropy_coef = float(call.option("entropy_coef", 0.0))
        entropy = getattr(utils.compute_entropy, "_torchdynamo_orig_callable",
                          utils.compute_entropy)  # eager: no compiler on a CPU machine
        batch = _torch.token_batch(call, utils.log_probs_from_logits, entropy,
                                   need_entropy=_torch.needs_entropy(call),
                                   nan_padding=self.nan_padding)
        if call.op in _torch.TOKEN_OPS:
            return _torch.result(call, batch, _torch.per_token_outputs(
                call, batch, lambda logp, ref, kind: utils.compute_approx_kl(
                    logp, ref, kl_estimator=kind)))
        eps = float(call.option("clip_eps", 0.2))
        high = call.option("clip_eps_high")
        token_level = call.option("loss_agg", "token-mean") == "token-mean"
        policy_loss = loss_module.PolicyLoss(
            clip_eps_low=eps, clip_eps_high=eps if high is None else float(high),
            dual_clip=call.option("dual_clip"), token_level_loss=token_level,
            policy_loss_type="gspo" if call.option("ratio_level") == "sequence" else "ppo")
        normalizer = call.option("loss_normalizer")
        info = {"batch_num_tokens": normalizer} if token_level else {
            "global_batch_size": normalizer}
        old = batch.logps.detach() if batch.old_logps is None else batch.old_logps
        loss = policy_loss(batch.logps, old, batch.advantages, action_mask=batch.mask,
                           **info)[0]
        mask = batch.mask.float()
        if call.option("kl_coef", 0.0):
            kl = utils.compute_approx_kl(batch.logps, batch.ref_logps, log_probs_old=old,
                                         kl_estimator=call.option("kl_estimator", "k3"))
            loss = loss + loss_module.aggregate_loss(kl, mask) * float(call.option("kl_coef"))
        if batch.entropy is not None:
            loss = loss - loss_module.aggregate_loss(batch.entropy, mask) * entropy_coef
        return _torch.result(call, batch, {"loss": loss})


#: OpenRLHF on finite padding (what its actor feeds it), and on the fixtures' NaN padding.
TARGET = OpenRLHFTarget()
NAN_PADDED = OpenRLHFTarget(nan_padding=True)
