"""OpenRLHF 0.11.2 on the CPU: its modules imported with the CUDA-only packages stubbed,
and its actor trainer built without DeepSpeed, Ray or vLLM.

OpenRLHF's wheel needs CUDA-only packages this machine cannot install; they are stubbed
while OpenRLHF is imported (:func:`import_openrlhf`), and only where absent:
``flash_attn`` (``bert_padding``, ``utils.distributed``: the sample-packing path, which
:func:`packing_functions` makes runnable) and ``vllm`` (``SamplingParams``, ``inputs.TokensPrompt``, ``utils.random_uuid``: the
rollout engines); each stub raises if called. While the trainer is built
(:func:`build_trainer`), its two CUDA calls are replaced: ``torch_dist_barrier_and_cuda_sync``
(a barrier and ``torch.cuda.synchronize``) by a no-op and ``torch.cuda.current_device``
(the replay buffer's device, unused here) by 0. Used by ``tests/adapters/
test_openrlhf_parity.py`` and ``test_openrlhf_adapter.py`` (``.ci/run`` block (d)).
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace as NS
from unittest import mock

import torch

from ratiokl.harness.targets.openrlhf import FLASH_ATTN_STUBS, stubbed_if_absent

STUBS = {
    **FLASH_ATTN_STUBS,
    "vllm": ("SamplingParams",), "vllm.inputs": ("TokensPrompt",), "vllm.utils": ("random_uuid",),
}


def import_openrlhf():
    """``openrlhf.trainer.ray.ppo_actor`` with the absent CUDA-only packages stubbed during
    the import (and removed after it: nothing else sees them)."""
    with stubbed_if_absent(STUBS):
        from openrlhf.trainer.ray import ppo_actor
    return ppo_actor


def _unpad_input(hidden, attention_mask, unused_mask=None):
    """flash-attn's ``bert_padding.unpad_input`` (2.7): the rows ``[B, S, ...]`` where the
    mask is non-zero, flattened row-major, with their flat indices, the cumulative
    sequence lengths, the longest and the lengths."""
    lengths = attention_mask.sum(-1, dtype=torch.int32)
    indices = attention_mask.flatten().nonzero().flatten()
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return (hidden.flatten(0, 1)[indices], indices, cu_seqlens, int(lengths.max()), lengths)


def _pad_input(hidden, indices, batch, seqlen):
    """flash-attn's ``bert_padding.pad_input``: ``hidden [N, ...]`` scattered to the flat
    ``indices`` of zeros ``[batch, seqlen, ...]``."""
    out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:]).index_put((indices,), hidden)
    return out.view(batch, seqlen, *hidden.shape[1:])


@contextlib.contextmanager
def packing_functions():
    """Inside, OpenRLHF's sample packing (``openrlhf.models.ring_attn_utils``, without ring
    attention) runs on the CPU: where ``flash_attn`` is absent, the ``bert_padding``
    functions it bound are replaced by their documented semantics (``index_first_axis``,
    ``pad_input``, ``unpad_input``; ``rearrange`` is einops')."""
    from openrlhf.models import ring_attn_utils

    if importlib.util.find_spec("flash_attn") is not None:
        yield
        return
    import einops

    with mock.patch.multiple(ring_attn_utils, unpad_input=_unpad_input, pad_input=_pad_input,
                             index_first_axis=lambda x, indices: x[indices],
                             rearrange=einops.rearrange):
        yield


class Strategy:
    """The DeepSpeed strategy's part ``training_step`` uses: a plain backward (keeping the
    loss it was given), no optimizer step."""

    ring_attn_group = None

    def __init__(self, args):
        self.args, self.loss = args, None

    def backward(self, value, model, optimizer):
        self.loss = value.detach()
        value.backward()

    def optimizer_step(self, *_, **__):
        pass

    def get_grad_norm(self, model):
        return 0.0


def trainer_args(actor=None, advantage=None, kl=None):
    """The CLI's arguments that the actor trainer reads: its defaults, but clip-higher."""
    return NS(
        actor=NS(**{"eps_clip_low_high": (0.2, 0.28), "dual_clip": None,
                    "loss_agg_mode": "token-mean", "policy_loss_type": "ppo",
                    "entropy_coef": None, "aux_loss_coef": 0.0, **(actor or {})}),
        algo=NS(advantage=NS(**{"is_correction_level": "off", "is_correction_mode": "mask",
                                "is_correction_gating": "ratio",
                                "is_correction_threshold": [0.5, 5.0], **(advantage or {})}),
                kl=NS(**{"use_loss": False, "init_coef": 0.0, "estimator": "k1",
                         "unbiased_gradient": False, **(kl or {})})),
        train=NS(max_epochs=1, dynamic_batch_enable=False, colocate_all=False,
                 async_enable=False),
        ds=NS(packing_samples=False), vllm=NS(sync_backend="gloo"))


def build_trainer(ppo_actor, args, actor, micro_batch: int):
    """OpenRLHF's ``ActorPPOTrainer`` around ``actor`` (its ``__init__`` builds the
    ``PolicyLoss`` from ``args``), with :class:`Strategy`: ``(trainer, strategy)``."""
    with mock.patch.object(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None), \
            mock.patch.object(torch.cuda, "current_device", lambda: 0):  # CUDA calls of __init__
        strategy = Strategy(args)
        trainer = ppo_actor.ActorPPOTrainer(
            strategy, actor, None, None, NS(get_last_lr=lambda: [0.0]),
            micro_train_batch_size=micro_batch)
    return trainer, strategy
