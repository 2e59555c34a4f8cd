"""``backend="interpret"`` keeps the interpreter's NumPy noise (deprecations, NaN/inf
arithmetic on data rows) out of the caller's warnings."""

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
