"""The interpreter twins (``ratiokl._kernels.interpret``) as a process that also compiles for
a GPU needs them: ``backend="interpret"`` keeps the interpreter's NumPy noise
(deprecations, NaN/inf arithmetic on data rows) out of the caller's warnings, and leaves
``triton.language`` as it found it."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ratiokl.torch import loss  # noqa: E402


def test_interpret_backend_warns_nothing():
    gen = torch.Generator().manual_seed(0)
    B, T, V = 2, 3, 37
    logits = torch.randn(B, T, V, generator=gen, requires_grad=True)
    ref = torch.randn(B, T, V, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    with torch.no_grad():
        logits[0, 2] = float("nan")  # an inactive row of garbage: data, not an accident
    old = torch.randn(B, T, generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, _ = loss.policy_loss(logits, ref, ids, mask, old, torch.randn(B, generator=gen),
                                    kl_coef=0.1, temperature=torch.full((B, T), 0.7),
                                    backend="interpret")
        value.backward()
        loss.selected_logprobs(logits, ids, mask, backend="interpret").sum().backward()
    assert torch.isfinite(value)
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []


def _builtins(module) -> dict:
    return {name: getattr(module, name) for name in dir(module) if not name.startswith("_")}


def test_interpret_backend_leaves_triton_language_as_it_was():
    """Each interpreted call of a ``@triton.jit`` helper patches ``triton.language`` with
    interpreter builtins (Triton 3.6 never undid it: a real compile afterwards failed);
    after a launch, every name is the object it was."""
    import triton.language as tl

    before, before_core = _builtins(tl), _builtins(tl.core)
    logits = torch.randn(4, 33, requires_grad=True)
    ids = torch.randint(0, 33, (4,))
    loss.selected_logprobs(logits.detach(), ids, backend="interpret", return_entropy=True)
    value, _ = loss.policy_loss(logits, None, ids, torch.ones(4, dtype=torch.bool),
                                torch.zeros(4), torch.ones(4), backend="interpret")
    value.backward()
    assert [n for n, v in before.items() if getattr(tl, n) is not v] == []
    assert [n for n, v in before_core.items() if getattr(tl.core, n) is not v] == []
