"""The batch the trainer parity tests feed to a trainer's own loss code and to ratiokl.

``tests/adapters/test_verl_parity.py`` and ``test_openrlhf_parity.py`` run each in its
trainer's virtual environment (``.ci/run`` block (d)). The trainer is the oracle: it gets
finite values everywhere, as it would from its own padding; ratiokl gets the same batch
with NaN / +inf / -inf logits and NaN old / reference / rollout log-probs and advantages
on every padded position, and must still agree on the loss and on the logits' gradient
(and give exactly 0 there). The tolerances are ``ratiokl.spec.tolerances``'.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from assertions import as_float64, assert_close, two_paths

from ratiokl.harness import Check, compare_close
from ratiokl.spec import Tolerance
from ratiokl.spec.tolerances import forward_tolerance, grad_tolerance

B, T, V = 5, 6, 11
#: Completion lengths: uneven, one of a single token and one empty.
LENGTHS = (6, 4, 1, 0, 3)


@dataclass(frozen=True)
class Batch:
    """float32 ``logits [B, T, V]`` (finite), ``ids`` and boolean ``mask [B, T]``; ``old``,
    ``ref``, ``rollout`` log-probs, per-token ``adv`` and per-sequence ``adv_seq``
    broadcast to ``[B, T]`` (finite everywhere: the trainer's inputs)."""

    logits: torch.Tensor
    ids: torch.Tensor
    mask: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    rollout: torch.Tensor
    adv: torch.Tensor
    adv_seq: torch.Tensor

    def poisoned(self) -> "Batch":
        """ratiokl's copy: NaN / +inf / -inf logits and NaN per-token inputs where padded."""
        pad = ~self.mask
        bad = torch.tensor([float("nan"), float("inf"), float("-inf")])
        logits = self.logits.clone()
        logits[pad] = bad[torch.arange(int(pad.sum())) % 3, None].expand(-1, V)
        nan = torch.tensor(float("nan"))
        return replace(self, logits=logits, **{
            k: torch.where(pad, nan, getattr(self, k))
            for k in ("old", "ref", "rollout", "adv", "adv_seq")})


def token_logps(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """``log softmax(logits / T)[ids]`` in the logits' dtype."""
    return torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None])[..., 0]


def make_batch(seed: int = 0) -> Batch:
    """A batch whose ratios reach every PPO branch: a few tokens past both clip bounds and
    one of ``A < 0`` past a dual clip of 3; rollout weights on both sides of 0.5 and 2."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T) < torch.tensor(LENGTHS)[:, None]
    logits = 2.0 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    logp = token_logps(logits.double(), ids)

    def noise(scale):
        return scale * (2.0 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1.0)

    delta = noise(0.6)
    delta[0, 1], delta[1, 2] = -1.5, 1.0  # ratio 4.5 (past a dual clip of 3) and 0.37
    adv = torch.randn(B, T, generator=g)
    adv[0, 1] = -1.0
    old = (logp + delta).float()
    adv_seq = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    lw = noise(1.2)
    lw[1, 0], lw[4, 1] = -1.2, 1.8  # rollout weights exp(old - rollout) of 0.30 and 6.0
    return Batch(logits=logits, ids=ids, mask=mask, old=old, ref=(logp + noise(1.0)).float(),
                 rollout=(old.double() - lw).float(), adv=adv, adv_seq=adv_seq)


def tolerances(logits: torch.Tensor, want_grad: torch.Tensor, temperature: float = 1.0,
               both_float32: bool = False):
    """The value's and the gradient's tolerances for ratiokl's float32 result against the
    trainer's float64 one; ``both_float32``: the trainer's is float32 too (each side then
    holds its own float32 error, so the bound is twice the spec's)."""
    scale = float(logits.detach().abs().max()) / temperature
    value = forward_tolerance(scale)
    grad = grad_tolerance("float32", scale, float(want_grad.abs().max()))
    if both_float32:
        value, grad = two_paths(value), two_paths(grad)
    return value, grad


def assert_matches(value, grad, want_value, want_grad, batch: Batch, temperature=1.0,
                   both_float32=False) -> None:
    """ratiokl's loss and logits' gradient equal the trainer's, and its gradient is exactly
    0 on every padded position (whatever ratiokl's logits held there)."""
    tol_value, tol_grad = tolerances(batch.logits, want_grad, temperature, both_float32)
    assert_close(value, want_value, tol_value, "loss")
    assert_close(grad, want_grad, tol_grad, "d loss / d logits")
    assert torch.all(grad[~batch.mask] == 0)


def differs(value, want_value, tol: Tolerance) -> bool:
    """Whether ``value`` is outside ``tol`` of ``want_value``."""
    check = Check()
    compare_close(check, "value", as_float64(value), as_float64(want_value), tol)
    return not check.passed
