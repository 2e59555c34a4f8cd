"""The log-prob seam's peers (op ``lmhead-logprobs``): per-token log-probs and entropy from the
hidden states, as each trainer's own fused head computes them.

Each builder returns a ``TorchOp`` whose forward gives ``((logp, entropy), ())`` viewed
``[B, T]`` and whose gradient reaches ``(hidden, W)``; ``_measure`` times it forward and
forward + backward with the case's random upstream gradients of both outputs.

- ``trl-chunked``: TRL's ``ChunkedLogProbFunction`` (``trl.kernels``) as its GRPO trainer
  calls it: the active rows compacted, ``outputs=("entropy",)``, TRL's vocabulary chunk.
- ``verl-fused``: verl's ``linear_cross_entropy`` (``verl.utils.kernel``), its actor's
  ``use_fused_kernels`` path: ``(log_probs, entropy)`` with ``reduction="none"``.
- ``cce``: cut-cross-entropy's ``linear_cross_entropy(reduction="none")``; its negated
  loss is the log-prob; it has no entropy, so only the log-prob's upstream gradient flows.
- ``ratiokl-*``: :func:`ratiokl_linear` (the chunked op) and :func:`ratiokl_materialised`
  (one GEMM, then ``selected_logprobs(return_entropy=True)`` on the ``[N, V]`` logits).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from _cases import TorchOp

__all__ = ["cce", "ratiokl_linear", "ratiokl_materialised", "trl_chunked", "verl_fused"]


def _kw(check_ids: bool) -> dict:
    return {} if check_ids else {"check_ids": False}


def ratiokl_linear(x: Any, backend: str, check_ids: bool) -> TorchOp:
    """``linear_selected_logprobs(hidden, W, ids, mask, return_entropy=True)``, defaults."""
    from ratiokl.torch import loss

    b = x.ids.shape[0]
    hidden = x.hidden.view(b, -1, x.hidden.shape[-1])
    return TorchOp(lambda: (loss.linear_selected_logprobs(
        hidden, x.weight, x.ids, x.mask, return_entropy=True, backend=backend,
        **_kw(check_ids)), ()), (x.hidden, x.weight))


def ratiokl_materialised(x: Any, backend: str, check_ids: bool) -> TorchOp:
    """``hidden @ W.T`` viewed ``[B, T, V]``, then ``selected_logprobs(return_entropy=True)``."""
    from ratiokl.torch import loss

    b, v = x.ids.shape[0], x.weight.shape[0]
    return TorchOp(lambda: (loss.selected_logprobs(
        (x.hidden @ x.weight.T).view(b, -1, v), x.ids, x.mask, return_entropy=True,
        backend=backend, **_kw(check_ids)), ()), (x.hidden, x.weight))


def trl_chunked(op: str, x: Any, check_ids: Optional[bool]) -> TorchOp:
    """TRL's fused head (``trl/trainer/utils.py``'s patched forward, on a Triton device)."""
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    chunk = trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    mask = x.mask

    def forward() -> Any:
        logp, entropy, *_ = ChunkedLogProbFunction.apply(
            x.hidden[mask.reshape(-1)], x.weight, None, x.ids[mask], 1.0, chunk, None, 1.0,
            ("entropy",))
        scatter = lambda t: t.new_zeros(mask.shape).masked_scatter(mask, t)  # noqa: E731
        return (scatter(logp), scatter(entropy)), ()

    return TorchOp(forward, (x.hidden, x.weight))


def verl_fused(op: str, x: Any, check_ids: Optional[bool]) -> TorchOp:
    """verl's ``linear_cross_entropy`` (its fused actor forward's kernel), reduction none."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    b = x.ids.shape[0]

    def forward() -> Any:
        logp, entropy = linear_cross_entropy(x.hidden, x.weight, x.ids.reshape(-1), 1.0, "none")
        return (logp.view(b, -1), entropy.view(b, -1)), ()

    return TorchOp(forward, (x.hidden, x.weight))


def cce(op: str, x: Any, check_ids: Optional[bool]) -> TorchOp:
    """cut-cross-entropy's per-token NLL, negated: the log-prob alone (no entropy)."""
    from cut_cross_entropy import linear_cross_entropy

    b = x.ids.shape[0]

    def forward() -> Any:
        nll = linear_cross_entropy(x.hidden, x.weight, x.ids.reshape(-1), reduction="none")
        return -nll.view(b, -1), ()

    return TorchOp(forward, (x.hidden, x.weight), (x.cot_a,))
