"""The ``ratio_kl`` interpreter cases both frameworks run (``tests/test_triton_interpret.py``,
one body per behaviour on ``torch-interpret`` and ``jax-interpret``): random inputs in the
logits' dtype, the call of either framework's Triton binding, and their float64 spec."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from assertions import assert_close

from ratiokl import spec
from ratiokl.torch import _triton

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
KL_NAMES = {1: "k1", 2: "k2", 3: "k3"}


class Case:
    """Random inputs of one case, in the logits' dtype, plus their float64 spec."""

    def __init__(self, n: int, vocab: int, dtype: str, seed: int = 0, scale: float = 3.0):
        rng = np.random.default_rng(seed)
        self.dtype = dtype
        as_dtype = lambda a: torch.tensor(a, dtype=torch.float32).to(DTYPES[dtype])  # noqa: E731
        self.policy = as_dtype(rng.normal(size=(n, vocab)) * scale)
        self.ref = as_dtype(rng.normal(size=(n, vocab)) * scale)
        self.ids = torch.tensor(rng.integers(0, vocab, n))
        self.mask = torch.tensor(rng.random(n) < 0.8)
        self.old = torch.tensor(rng.normal(size=n) - 2.0, dtype=torch.float32)
        self.ref_logps = torch.tensor(rng.normal(size=n) - 2.0, dtype=torch.float32)
        self.g_ratio = torch.tensor(rng.normal(size=n), dtype=torch.float32)
        self.g_kl = torch.tensor(rng.normal(size=n), dtype=torch.float32)
        self.temperature: object = 1.0

    def np(self, t: Optional[torch.Tensor]):
        return None if t is None else t.detach().float().numpy().astype(np.float64)

    def scale(self) -> float:
        t = self.temperature
        t_min = float(t.min()) if isinstance(t, torch.Tensor) else t
        finite = lambda a: np.abs(a[np.isfinite(a)]).max(initial=1.0)  # noqa: E731
        return max(finite(self.np(self.policy)), finite(self.np(self.ref))) / t_min

    def run(self, use_ref_logits: bool, kl_code: int, check_ids: bool = True,
            framework: str = "torch"):
        """``(ratio, kl, policy-logit gradient)`` as NumPy arrays (the gradient in float32),
        from ``framework``'s Triton binding through the interpreter; the gradient's dtype
        is checked to be the logits'. PyTorch launches the kernels directly (no id check)."""
        if framework == "jax":
            return self._run_jax(use_ref_logits, kl_code, check_ids)
        policy = self.policy.clone().requires_grad_(True)
        ratio, kl = _triton.ratio_kl(
            policy, self.ref if use_ref_logits else None, self.ids, self.mask, self.old,
            None if use_ref_logits else self.ref_logps, kl_code, self.temperature,
        )
        (ratio * self.g_ratio + kl * self.g_kl).sum().backward()
        assert policy.grad.dtype == DTYPES[self.dtype]
        return ratio.detach().numpy(), kl.detach().numpy(), policy.grad.float().numpy()

    def _run_jax(self, use_ref_logits: bool, kl_code: int, check_ids: bool):
        import jax
        import jax.numpy as jnp

        from ratiokl.jax import loss

        def as_jax(t, dtype=None):
            return jnp.asarray(t.float().numpy() if t.is_floating_point() else t.numpy(), dtype)

        temp = self.temperature
        kwargs = dict(ref_logps=None if use_ref_logits else as_jax(self.ref_logps),
                      kl_estimator=KL_NAMES[kl_code], check_ids=check_ids,
                      temperature=as_jax(temp) if isinstance(temp, torch.Tensor) else temp,
                      backend="interpret")
        ref = as_jax(self.ref, self.dtype) if use_ref_logits else None
        rows = [as_jax(t) for t in (self.ids.int(), self.mask, self.old)]
        (ratio, kl), vjp = jax.vjp(lambda x: loss.ratio_kl(x, ref, *rows, **kwargs),
                                   as_jax(self.policy, self.dtype))
        (grad,) = vjp((as_jax(self.g_ratio), as_jax(self.g_kl)))
        assert grad.dtype == jnp.dtype(self.dtype)
        return np.asarray(ratio), np.asarray(kl), np.asarray(grad.astype(jnp.float32))

    def expected(self, use_ref_logits: bool, kl_code: int):
        temp = self.temperature
        kwargs = dict(
            ref_logps=None if use_ref_logits else self.np(self.ref_logps),
            kl_estimator=KL_NAMES[kl_code],
            temperature=self.np(temp) if isinstance(temp, torch.Tensor) else temp,
        )
        args = (self.np(self.policy), self.np(self.ref) if use_ref_logits else None,
                self.ids.numpy(), self.mask.numpy(), self.np(self.old))
        ratio, kl = spec.ratio_kl(*args, **kwargs)
        grad = spec.ratio_kl_grad(*args, self.np(self.g_ratio), self.np(self.g_kl), **kwargs)
        return ratio, kl, grad

    def check(self, use_ref_logits: bool = True, kl_code: int = 3, check_ids: bool = True,
              framework: str = "torch"):
        ratio, kl, grad = self.run(use_ref_logits, kl_code, check_ids, framework)
        e_ratio, e_kl, e_grad = self.expected(use_ref_logits, kl_code)
        fwd = spec.forward_tolerance(self.scale())
        assert_close(ratio, e_ratio, fwd, "ratio")
        assert_close(kl, e_kl, fwd, "kl")
        finite = np.isfinite(e_grad)
        grad_scale = np.abs(e_grad[finite]).max(initial=0.0)
        assert_close(grad, e_grad,
                      spec.grad_tolerance(self.dtype, self.scale(), grad_scale), "grad")
        return ratio, kl, grad
