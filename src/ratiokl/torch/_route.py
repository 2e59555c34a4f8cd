"""The route from a public ``ratiokl.torch.loss`` call to its launches, one function per op.

The two ops from hidden states (``linear_selected_logprobs``, ``linear_policy_loss``) take
the same steps in ``_linear_route``, with this module's helpers.

Every call runs the same steps, each once:

1. validate (``_checks``; shapes, dtypes and devices only -- no host sync) and
   flatten the leading shape ``[...]`` to ``N`` rows;
2. queue the check of active ids and temperatures (``check_ids=True``; an
   :class:`~ratiokl.torch._checks.ActiveCheck`);
3. resolve the backend (:func:`resolve`) and call it on the flattened rows,
   which queues the kernels;
4. read the check (the call's one host sync: the GPU keeps running what was
   queued) and reshape the outputs back to ``[...]``.

Backend interface: :class:`ratiokl._backend.Backend` (documented there).
PyTorch specifics: the logits may have any strides, ``ref`` and the per-row
values are detached, and per-row inputs are contiguous (the kernels read row
``i`` at ``i``).

Backends: the table of :mod:`ratiokl._core.backends` (``"native"``: ``_native``, any
device; ``"triton"``: ``_triton`` on CUDA tensors; ``"interpret"``: the same ``_triton``
on CPU tensors, through Triton's interpreter); ``"auto"`` is ``"triton"`` for CUDA
tensors when Triton is installed, else ``"native"``. ``vocab_group`` wraps the per-shard
math of either in ``_vocab_parallel``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import torch

from ratiokl._backend import Backend
from ratiokl._core import backends, route as _tail
from ratiokl._core.route import Rows
from ratiokl._requirements import unmet
from ratiokl.spec import (BACKENDS, PolicyLossOptions, check_bool_option, kl_estimator_code,
                          rollout_options)
from ratiokl.torch import _checks
from ratiokl.torch._arrays import XP

__all__ = ["BACKENDS", "backend_name", "policy_loss", "ratio_kl", "resolve",
           "selected_logprobs"]


def _native(name: str) -> Backend:
    from ratiokl.torch import _linear_logprobs, _native

    return Backend(_native.selected_logprobs, _native.ratio_kl, _native.logprobs_entropy,
                   linear_selected_logprobs=functools.partial(
                       _linear_logprobs.selected_logprobs, _linear_logprobs.NATIVE_ROWS))


def _triton(name: str) -> Backend:
    """``"triton"`` and ``"interpret"`` alike: each launch binds by the tensors' device."""
    # Import triton: only when a kernel backend runs.
    from ratiokl.torch import _linear, _linear_logprobs, _triton

    return Backend(_triton.selected_logprobs, _triton.ratio_kl, _triton.logprobs_entropy,
                   _triton.policy_loss, _triton.token_weights,
                   rollout_weights=_triton.rollout_weights,
                   linear_policy_loss=_linear.policy_loss,
                   linear_selected_logprobs=functools.partial(
                       _linear_logprobs.selected_logprobs, _linear_logprobs.TRITON_ROWS))


#: Binding module (``_core.backends.PROVIDERS``) -> its loader (plain imports:
#: torch.compile traces through them).
_LOADERS: Dict[str, Callable[[str], Backend]] = {"_native": _native, "_triton": _triton}
_LOADED: Dict[str, Backend] = {}

#: Why the installed ``triton`` cannot serve the Triton backends (not installed, or
#: older than ``ratiokl._requirements`` allows), or ``None``. Read from package
#: metadata once, not imported, so ``import ratiokl.torch`` stays light and
#: ``torch.compile`` never traces the lookup.
_TRITON_PROBLEM: Optional[str] = unmet("triton")


def backend_name(backend: str, device: torch.device) -> str:
    """The concrete backend for ``backend`` on ``device``; raises if it cannot run there."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and _TRITON_PROBLEM is None else "native"
    backends.check_name(backend)
    if backend == "triton" and device.type != "cuda":
        raise ValueError(
            f"backend='triton' needs CUDA tensors; the inputs are on {device}. Use "
            "backend='native' (or 'interpret' to run the Triton kernels on the CPU)"
        )
    if backend == "interpret" and device.type != "cpu":
        raise ValueError(
            f"backend='interpret' runs Triton's CPU interpreter and needs CPU tensors; "
            f"the inputs are on {device}. Use backend='triton' or 'native'"
        )
    if backend in ("triton", "interpret") and _TRITON_PROBLEM is not None:
        raise backends.cannot_run(backend, _TRITON_PROBLEM, "; or use backend='native'")
    return backend


def resolve(backend: str, device: torch.device) -> Backend:
    """The :class:`Backend` for ``backend`` (``"auto"`` resolved) on tensors on ``device``."""
    return _loaded(backend_name(backend, device))


def _loaded(name: str) -> Backend:
    """The :class:`Backend` of a concrete name (from :func:`backend_name`), loaded once.

    While ``torch.compile`` traces, the loader runs uncached: a trace that read (and
    filled) ``_LOADED`` would guard on its contents and compile again on the next call.
    """
    loaded = None if torch.compiler.is_compiling() else _LOADED.get(name)
    if loaded is None:
        loaded = backends.load(name, _LOADERS)  # any import failure: which, what to use
        if not torch.compiler.is_compiling():
            _LOADED[name] = loaded
    return loaded


def _rows(logits: torch.Tensor, lead: Tuple[int, ...], ids: torch.Tensor, mask, temperature,
          backend: str, check_ids: bool, vocab_group, vocab: Optional[int] = None,
          inplace_grad: bool = False, logits_name: str = "policy_logits",
          **per_token) -> Rows:
    """Steps 1-3 for the inputs every op shares (``logits`` and ``ids`` already checked).

    ``per_token`` holds the call's other tensors by argument name, for the device check;
    ``vocab``: the ids' range where ``logits`` is not ``[..., V]`` (hidden states: the
    lm_head weight's rows; None: ``logits.shape[-1]``); ``logits_name``: the op's name for
    ``logits``.
    """
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=logits.device)
    mask = _checks.check_mask(mask, lead)
    temperature = _checks.check_temperature(temperature, lead)
    check_ids = check_bool_option("check_ids", check_ids)
    first_name = "hidden" if vocab else logits_name
    device = _checks.check_same_device(
        **{first_name: logits}, action_ids=ids, mask=mask,
        temperature=temperature if isinstance(temperature, torch.Tensor) else None, **per_token,
    )
    if check_ids and vocab_group is not None and torch.compiler.is_compiling():
        raise ValueError(
            "check_ids=True with `vocab_group` agrees the ranks' shapes and checks the ids "
            "on the host, which torch.compile cannot trace; pass check_ids=False under "
            "torch.compile (a bad id or temperature then makes its row NaN)"
        )
    name = _checks.float64_backend(
        backend_name(backend, device), backend, None if vocab_group is None else "vocab_group",
        **{first_name: logits, "ref_logits": per_token.get("ref_logits")})
    _checks.check_transform_backend(name, vocab_group, inplace_grad)
    check = None
    if check_ids:  # sharded logits: their ids are checked against the global V later
        check = _checks.ActiveCheck(ids, mask, None if vocab_group else
                                    vocab or logits.shape[-1],
                                    temperature, one_launch=name == "triton")
        mask = check.mask  # under torch.compile: the checking op's output
    if vocab_group is None:
        run = _loaded(name)
    else:
        from ratiokl.torch import _vocab_linear, _vocab_parallel

        run = _vocab_parallel.backend(vocab_group, lead, name != "native", check_ids,
                                      _vocab_linear.selected_logprobs)
    if isinstance(temperature, torch.Tensor):
        temperature = XP.for_dtype(logits.dtype).flat(temperature)  # float64 logits: float64
        temperature = _checks.poison_bad_temperature(temperature)
    return Rows(lead, logits.reshape(-1, logits.shape[-1]), ids.reshape(-1).contiguous(),
                 mask.reshape(-1).contiguous(), temperature, run, check)


def _lead(logits: torch.Tensor, action_ids: torch.Tensor,
          name: str = "policy_logits") -> Tuple[int, ...]:
    """Check the logits (the op's argument ``name``), then the ids (first: a flattened
    ``[N, V]`` names the ids)."""
    _checks.check_logits(name, logits, float64=True)
    lead = tuple(logits.shape[:-1])
    _checks.check_ids(action_ids, lead)
    return lead


def selected_logprobs(logits, action_ids, mask, *, temperature, backend, check_ids,
                      vocab_group, return_entropy=False):
    """``ratiokl.torch.loss.selected_logprobs`` (documented there)."""
    lead = _lead(logits, action_ids, "logits")
    rows = _rows(logits, lead, action_ids, mask, temperature, backend, check_ids, vocab_group,
                 logits_name="logits")
    return _tail.logprobs_step(rows, return_entropy)


def ratio_kl(policy_logits, ref_logits, action_ids, mask, old_logps, *, ref_logps,
             kl_estimator, temperature, backend, check_ids,
             vocab_group) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ratiokl.torch.loss.ratio_kl`` (documented there)."""
    lead = _lead(policy_logits, action_ids)
    _checks.check_ref(ref_logits, ref_logps, tuple(policy_logits.shape))
    _checks.check_row_values("old_logps", old_logps, lead)
    kl_code = kl_estimator_code(kl_estimator)
    rows = _rows(policy_logits, lead, action_ids, mask, temperature, backend, check_ids,
                 vocab_group, ref_logits=ref_logits, old_logps=old_logps, ref_logps=ref_logps)
    ref = None if ref_logits is None else ref_logits.detach().reshape(rows.logits.shape)
    return _tail.ratio_kl_step(XP.for_dtype(policy_logits.dtype), rows, ref, old_logps,
                               ref_logps, kl_code)


def policy_loss(policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
                opts: PolicyLossOptions, *, ref_logps, loss_normalizer, kl_entropy_normalizer,
                segment_ids, importance_weights, temperature, backend, check_ids, vocab_group,
                inplace_grad, rollout_logps, rollout_correction,
                rollout_bounds) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """``ratiokl.torch.loss.policy_loss`` (documented there), its options in ``opts``."""
    lead = _lead(policy_logits, action_ids)
    if inplace_grad and not policy_logits.is_contiguous():
        raise ValueError(
            "`inplace_grad=True` needs contiguous `policy_logits` (the gradient is written "
            "into their buffer); pass `policy_logits.contiguous()` or `inplace_grad=False`"
        )
    if ref_logits is not None or ref_logps is not None or opts.uses_kl:
        _checks.check_ref(ref_logits, ref_logps, tuple(policy_logits.shape))
    xp = XP.for_dtype(policy_logits.dtype)  # float64 logits: float64 math (native)
    inputs = _tail.loss_inputs(xp, opts, lead, old_logps, advantages, segment_ids,
                               importance_weights, loss_normalizer, kl_entropy_normalizer,
                               rollout_logps)
    rows = _rows(
        policy_logits, lead, action_ids, mask, temperature, backend, check_ids, vocab_group,
        inplace_grad=inplace_grad, ref_logits=ref_logits, old_logps=old_logps,
        ref_logps=ref_logps, advantages=advantages,
        segment_ids=segment_ids, importance_weights=importance_weights,
        rollout_logps=rollout_logps,
    )
    ref = None if ref_logits is None else ref_logits.detach().reshape(rows.logits.shape)
    # The rollout options are checked on every call; only a call with rollout_logps
    # visits the correction (its weights, folded into importance_weights, and metrics).
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None,
                              cached=not torch.compiler.is_compiling())
    return _tail.loss_step(xp, rows, ref, ref_logps, inputs, opts, rollout,
                           inplace_grad, "policy_loss")
