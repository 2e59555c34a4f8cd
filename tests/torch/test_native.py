"""The native PyTorch backend against the float64 spec (``ratiokl.spec``): what only
PyTorch has, or only its tests check so far.

Per-row and 0-d temperature tensors, non-contiguous inputs, many row chunks, the
inactive-row rules on poisoned rows and in the shared epilogue, determinism, argument
validation (the errors of vocabularies, temperatures, devices) and backend resolution. The
behaviours both frameworks share (argument errors included):
``tests/test_native.py``. Every comparison uses ``ratiokl.spec.tolerances``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ratiokl import spec  # noqa: E402
from ratiokl._core import objective as _objective  # noqa: E402
from ratiokl.torch import _native, _route, loss  # noqa: E402
from ratiokl.torch._arrays import XP  # noqa: E402
from assertions import assert_close  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
V = 37
NATIVE = {"backend": "native"}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy() if t.is_floating_point() else t.detach().numpy()


def _scale(logits: np.ndarray, mask: np.ndarray, temperature=1.0) -> float:
    """max |logits / T| over the finite entries of active rows."""
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.abs(logits / np.broadcast_to(np.asarray(temperature), mask.shape)[..., None])
    z = np.where(mask[..., None] & np.isfinite(z), z, 0.0)
    return float(z.max(initial=0.0))


def _case(lead, dtype=torch.float32, seed=0, active=0.7):
    """Random logits (scale 3) in ``dtype``, ref logits, ids, mask and old log-probs."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*lead, V, generator=gen)).to(dtype)
    ref = (logits.float() + 0.3 * torch.randn(*lead, V, generator=gen)).to(dtype)
    ids = torch.randint(0, V, lead, generator=gen)
    mask = torch.rand(lead, generator=gen) < active
    exact = spec.selected_logprobs(_np(logits), _np(ids), _np(mask))
    old = torch.from_numpy(exact).float() + 0.2 * torch.randn(lead, generator=gen)
    return logits.requires_grad_(), ref, ids, mask, old


def _check_ratio_kl(logits, ref, ids, mask, old, *, seed=1, **kw):
    """Forward and gradient of ratio_kl (random upstream cotangents) against the spec."""
    ratio, kl = loss.ratio_kl(logits, ref, ids, mask, old, **NATIVE, **kw)
    gen = torch.Generator().manual_seed(seed)
    g_ratio, g_kl = torch.randn(ratio.shape, generator=gen), torch.randn(kl.shape, generator=gen)
    (grad,) = torch.autograd.grad((ratio * g_ratio + kl * g_kl).sum(), logits)
    args = [_np(logits), None if ref is None else _np(ref), _np(ids), _np(mask), _np(old)]
    opts = {k: (_np(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    exp_ratio, exp_kl = spec.ratio_kl(*args, **opts)
    exp_grad = spec.ratio_kl_grad(*args, _np(g_ratio), _np(g_kl), **opts)
    scale = _scale(_np(logits), _np(mask), kw.get("temperature", 1.0))
    fwd = spec.forward_tolerance(scale)
    assert_close(ratio, exp_ratio, fwd)
    assert_close(kl, exp_kl, fwd)
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    grad_scale = float(np.abs(np.nan_to_num(exp_grad)).max(initial=0.0))
    dtype_name = str(logits.dtype).removeprefix("torch.")
    assert_close(grad, exp_grad, spec.grad_tolerance(dtype_name, scale, grad_scale))
    return ratio, kl, grad


def test_per_row_temperature_tensor() -> None:
    logits, ref, ids, mask, old = _case((3, 5))
    temperature = 0.5 + torch.rand((3, 5), generator=torch.Generator().manual_seed(2))
    _check_ratio_kl(logits, ref, ids, mask, old, temperature=temperature)


def test_zero_dim_temperature_tensor_broadcasts() -> None:
    logits, ref, ids, mask, old = _case((3, 4))
    as_float = loss.ratio_kl(logits, ref, ids, mask, old, temperature=0.6, **NATIVE)
    as_tensor = loss.ratio_kl(logits, ref, ids, mask, old, temperature=torch.tensor(0.6), **NATIVE)
    assert all(torch.equal(a, b) for a, b in zip(as_float, as_tensor))


@pytest.mark.parametrize("transpose", [False, True], ids=["vocab_stride_2", "transposed"])
def test_non_contiguous_inputs(transpose: bool) -> None:
    base, ref, ids, mask, old = _case((5, 3), torch.bfloat16)
    pairs = torch.stack([base.detach(), torch.full_like(base, float("nan"))], dim=-1)
    wide = pairs.reshape(5, 3, 2 * V)[..., ::2]  # vocab stride 2, NaN between the entries
    t = (lambda x: x.transpose(0, 1)) if transpose else (lambda x: x)  # [3, 5, ...] or [5, 3, ...]
    logits = t(wide).detach().requires_grad_()
    assert not logits.is_contiguous() and torch.equal(logits, t(base))
    _check_ratio_kl(logits, t(ref), t(ids), t(mask), t(old))


def test_many_chunks_match_spec(monkeypatch) -> None:
    monkeypatch.setattr(_native, "_CHUNK_BYTES", {"cpu": 4 * V * 3, "default": 4 * V * 3})
    chunks = _native.row_chunks(40, V, torch.device("cpu"))  # 3 rows per chunk, 1 at the end
    assert len(chunks) == 14 and chunks[0] == slice(0, 3) and chunks[-1] == slice(39, 42)
    _check_ratio_kl(*_case((40,), torch.float16), temperature=1.3)


def _poisoned_inactive_rows():
    """Inactive rows holding NaN/+inf/-inf logits, NaN old_logps and bad ids."""
    logits, ref, ids, mask, old = _case((4, 5), active=1.0)
    x, r = logits.detach().clone(), ref.clone()
    mask[0, :] = False
    nan, inf = float("nan"), float("inf")
    x[0, 0, 3], x[0, 1, :], x[0, 2, 0], x[0, 3, :] = nan, inf, -inf, -inf
    r[0, :, 1] = float("nan")
    ids[0, 0], ids[0, 1], ids[0, 2] = -5, V, V + 100
    old[0, :] = float("nan")
    temperature = torch.ones(4, 5)
    temperature[0, :] = torch.tensor([0.0, float("nan"), -1.0, float("inf"), 0.0])
    return x.requires_grad_(), r, ids, mask, old, temperature


@pytest.mark.parametrize("with_ref_logits", [True, False])
def test_inactive_rows_are_exactly_neutral(with_ref_logits: bool) -> None:
    logits, ref, ids, mask, old, temperature = _poisoned_inactive_rows()
    ref_kw = {} if with_ref_logits else {"ref_logps": old - 0.1}  # NaN on row 0
    ratio, kl, grad = _check_ratio_kl(
        logits, ref if with_ref_logits else None, ids, mask, old, temperature=temperature, **ref_kw
    )
    assert torch.equal(ratio[0], torch.ones(5)) and torch.equal(kl[0], torch.zeros(5))
    assert torch.equal(grad[0], torch.zeros(5, V))
    assert torch.isfinite(ratio).all() and torch.isfinite(kl).all() and torch.isfinite(grad).all()
    logp = loss.selected_logprobs(logits, ids, mask, temperature=temperature, **NATIVE)
    (grad_logp,) = torch.autograd.grad(logp.sum(), logits)
    assert torch.equal(logp[0], torch.zeros(5)) and torch.equal(grad_logp[0], torch.zeros(5, V))


@pytest.mark.parametrize("kl_code", [1, 2, 3])
def test_elementwise_epilogue_isolates_inactive_rows(kl_code: int) -> None:
    """The shared epilogue alone: NaN/inf inputs on inactive rows give exactly 0 gradient."""
    nan, inf = float("nan"), float("inf")
    logp = torch.tensor([-1.0, nan, inf, -0.5], requires_grad=True)
    logp_ref = torch.tensor([-1.2, nan, -inf, -0.4])
    old = torch.tensor([-0.9, nan, nan, -inf])
    mask = torch.tensor([True, False, False, False])
    ratio, kl = _objective.token_ratio_kl(XP, logp, logp_ref, old, mask, kl_code)
    (grad,) = torch.autograd.grad((ratio + kl).sum(), logp)
    assert torch.equal(ratio[1:], torch.ones(3)) and torch.equal(kl[1:], torch.zeros(3))
    assert torch.equal(grad[1:], torch.zeros(3)) and torch.isfinite(grad[0])


def test_deterministic_bitwise() -> None:
    def run():
        logits, ref, ids, mask, old = _case((6, 7), torch.bfloat16, seed=3)
        ratio, kl = loss.ratio_kl(logits, ref, ids, mask, old, **NATIVE)
        (grad,) = torch.autograd.grad((ratio * 2 - kl).sum(), logits)
        return ratio, kl, grad

    first, second = run(), run()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_vocabulary_temperature_and_device_errors() -> None:
    with pytest.raises(ValueError, match="`logits`"):
        loss.selected_logprobs(torch.zeros(3, 0), torch.zeros(3, dtype=torch.long), **NATIVE)
    logits, ref, ids, mask, old = _case((3, 4))
    with pytest.raises(ValueError, match="temperature"):
        loss.selected_logprobs(logits, ids, temperature=torch.ones(4), **NATIVE)
    with pytest.raises(ValueError, match="old_logps"):
        loss.ratio_kl(logits, ref, ids, mask, old.to("meta"), **NATIVE)


def test_backend_resolution() -> None:
    for name in ("auto", "native"):
        backend = _route.resolve(name, torch.device("cpu"))
        assert backend.selected_logprobs is _native.selected_logprobs
        assert backend.policy_loss is None  # two passes: log-probs, then the objective
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        _route.resolve("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="needs CPU tensors"):
        _route.resolve("interpret", torch.device("cuda"))
    with pytest.raises(ValueError, match="`backend` must be one of"):
        _route.resolve("nope", torch.device("cpu"))
