"""The route from a public ``ratiokl.jax.loss`` call to its launches, one function per op.

The two ops from hidden states (``linear_selected_logprobs``, ``linear_policy_loss``) take
the same steps in ``_linear_route``, with this module's helpers.

Every call runs the same steps, each once, mirroring ``ratiokl.torch._route``:

1. validate (``_checks``; shapes, dtypes and Python scalars only, so it works
   on tracers) and flatten the leading shape ``[...]`` to ``N`` rows;
2. queue the check of active ids and temperatures (an
   :class:`~ratiokl.jax._checks.ActiveCheck`: on concrete inputs with
   ``check_ids``, two booleans; traced, a ``checkify`` check);
3. resolve the backend in the table below and call it on the flattened rows;
4. read the check (concrete inputs: the device keeps running what was queued)
   and reshape the outputs back to ``[...]``.

Backend interface: :class:`ratiokl._backend.Backend` (documented there).
JAX specifics: ``kl_code`` and the option codes are static; the coefficients
(``opts.kl_coef``, the clip bounds) and every array may be traced (``jit``,
``grad``, ``vmap``).

Backends: the table of :mod:`ratiokl._core.backends` (``"native"``: ``_native``, XLA,
runs everywhere; ``"triton"``: ``_triton``, the shared Triton kernels through
``jax_triton``, GPU only; ``"interpret"``: the same binding with each launch run by
Triton's CPU interpreter through ``_interpret``, needs torch and triton, for tests, slow).
``"auto"`` picks ``"triton"`` when JAX's default backend is a GPU and ``jax_triton``
imports, else ``"native"``; never ``"interpret"``. ``vocab_axis`` wraps any of them in
``_vocab_parallel``.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp

from ratiokl._backend import Backend
from ratiokl._core import backends, route as _tail
from ratiokl._core.route import Rows
from ratiokl._requirements import unmet
from ratiokl.jax import _checks, _jax_triton
from ratiokl.jax._arrays import XP
from ratiokl.spec import (PolicyLossOptions, check_bool_option, kl_estimator_code,
                          rollout_options)

__all__ = ["backend_name", "policy_loss", "ratio_kl", "resolve", "selected_logprobs"]


def _native(name: str) -> Backend:
    from ratiokl.jax import _linear_logprobs, _native

    return Backend(_native.selected_logprobs, _native.ratio_kl, _native.logprobs_entropy,
                   linear_selected_logprobs=functools.partial(
                       _linear_logprobs.selected_logprobs, _linear_logprobs.NATIVE_ROWS))


def _triton(name: str) -> Backend:
    """The Triton binding's functions bound to the launch of ``name``: ``jax_triton``'s
    ``triton_call`` (``"triton"``) or the interpreter's stand-in (``"interpret"``), with
    results typed as ``_triton.typed_call`` says."""
    # Import triton (and, for the interpreter, torch): only when a kernel backend runs.
    from ratiokl.jax import (_interpret, _linear, _linear_logprobs, _triton, _triton_loss,
                             _triton_shard, _vocab_linear)

    call = _triton.typed_call(_interpret.triton_call if name == "interpret"
                              else _jax_triton.triton_call)
    bind = functools.partial
    return Backend(bind(_triton.selected_logprobs, call), bind(_triton.ratio_kl, call),
                   bind(_triton.logprobs_entropy, call), bind(_triton_loss.policy_loss, call),
                   bind(_triton_loss.token_weights, call),
                   rollout_weights=bind(_triton_loss.rollout_weights, call),
                   shard_logps=bind(_triton_shard.shard_logps, call),
                   shard_rows=bind(_vocab_linear.kernel_rows, call),
                   linear_policy_loss=bind(_linear.policy_loss, call),
                   linear_selected_logprobs=bind(_linear_logprobs.selected_logprobs,
                                                 _linear_logprobs.triton_rows(call)))


#: Binding module (``_core.backends.PROVIDERS``) -> its loader (imported on first use).
_LOADERS: Dict[str, Callable[[str], Backend]] = {"_native": _native, "_triton": _triton}


@functools.lru_cache(maxsize=None)
def _jax_triton_error() -> str:
    """Why ``jax_triton`` cannot run here, or ``""`` when it can (the full reason: versions
    first, then the device, then jax-triton's own import)."""
    for distribution in ("triton", "jax-triton"):
        reason = unmet(distribution, extra="jax-triton")
        if reason:
            return reason
    if _no_gpu():
        return _no_gpu()
    try:
        _jax_triton.import_jax_triton()
    except ImportError as err:
        return f"`import jax_triton` failed: {err}"
    return ""


def _no_gpu() -> str:
    """Why there is no GPU for ``backend="triton"`` (JAX's default backend), or ``""``."""
    if jax.default_backend() != "gpu":
        return f"JAX's default backend is {jax.default_backend()!r}, not a GPU"
    return ""


@functools.lru_cache(maxsize=None)
def _interpret_error() -> str:
    """Why ``backend="interpret"`` cannot run here (torch or triton missing or too old),
    or ``""`` when it can."""
    for distribution in ("torch", "triton"):
        reason = unmet(distribution, extra="torch-triton")
        if reason:
            return reason
    return ""


def backend_name(backend: str) -> str:
    """The concrete backend for ``backend`` (a static string); raises if it cannot run here.

    ``"auto"`` never fails for want of a GPU; ``"triton"`` without one raises
    ``ValueError`` (as PyTorch's ``"triton"`` does for CPU tensors), an explicit backend
    whose packages are missing, too old or fail to import ``RuntimeError`` saying why, an
    unknown name ``ValueError``.
    """
    backends.check_name(backend)
    if backend == "interpret":
        reason = _interpret_error()
        if reason:
            raise backends.cannot_run(
                backend, reason, ". It runs the Triton kernels through Triton's CPU "
                "interpreter on torch CPU tensors, so it needs torch and triton: pip install "
                "'ratiokl[torch-triton]'; or use backend='native'")
        return backend
    if backend == "auto":
        return "native" if _jax_triton_error() else "triton"
    if backend == "triton":
        reason = _jax_triton_error()
        if reason and reason == _no_gpu():
            raise ValueError(
                f"backend='triton' needs a GPU; {reason}. Use backend='native' or 'auto' "
                "(or 'interpret' to run the Triton kernels on the CPU)"
            )
        if reason:
            raise backends.cannot_run(
                backend, reason, ". It needs a CUDA build of jaxlib and `pip install "
                "'ratiokl[jax-triton]'`; use backend='native' or 'auto'")
    return backend


@functools.lru_cache(maxsize=None)
def resolve(name: str) -> Backend:
    """The :class:`Backend` of a concrete backend name (from :func:`backend_name`)."""
    return backends.load(name, _LOADERS, catch=(ImportError,))


def _lead(logits: jax.Array, action_ids: jax.Array,
          name: str = "policy_logits") -> Tuple[jax.Array, jax.Array, Tuple[int, ...]]:
    """Check the logits (the op's argument ``name``), then the ids (first: a flattened
    ``[N, V]`` names the ids)."""
    logits = _checks.check_logits(name, logits, float64=True)
    lead = tuple(logits.shape[:-1])
    return logits, _checks.check_ids(action_ids, lead), lead


def _rows(logits: jax.Array, lead: Tuple[int, ...], ids: jax.Array, mask, temperature,
          backend: str, check_ids: bool, vocab_axis: Optional[str],
          vocab: Optional[int] = None, logits_name: str = "policy_logits",
          ref_logits: Optional[jax.Array] = None) -> Rows:
    """Steps 1-3 for the inputs every op shares (``logits`` and ``ids`` already checked).

    ``vocab``: the ids' range where ``logits`` is not ``[..., V]`` (hidden states: the
    lm_head weight's rows; None: ``logits.shape[-1]``); ``logits_name``: the op's name for
    ``logits``; ``ref_logits``: the reference logits, if any (float64 keeps to native).
    """
    mask = jnp.ones(lead, dtype=bool) if mask is None else _checks.check_mask(mask, lead)
    temperature = _checks.check_temperature(temperature, lead)
    check_ids = check_bool_option("check_ids", check_ids)
    name = _checks.float64_backend(backend_name(backend), backend,
                                   None if vocab_axis is None else "vocab_axis",
                                   **{logits_name: logits, "ref_logits": ref_logits})
    if vocab_axis is None:
        vocab, run = vocab or logits.shape[-1], resolve(name)
    else:
        from ratiokl.jax import _vocab_linear, _vocab_parallel

        vocab = _vocab_parallel.global_vocab(vocab or logits.shape[-1], vocab_axis,
                                             "weight" if vocab else "logits")
        run = _vocab_parallel.backend(resolve(name), vocab_axis, explicit=backend != "auto",
                                      linear_selected_logprobs=_vocab_linear.selected_logprobs)
    check = _checks.ActiveCheck(ids, mask, vocab, check_ids, temperature)
    if not isinstance(temperature, float):
        temperature = _checks.poison_bad_temperature(
            XP.for_dtype(logits.dtype).flat(temperature))  # float64 logits: float64
    return Rows(lead, logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), mask.reshape(-1),
                 temperature, run, check)


def selected_logprobs(logits, action_ids, mask, *, temperature, backend, check_ids,
                      vocab_axis, return_entropy=False):
    """``ratiokl.jax.loss.selected_logprobs`` (documented there)."""
    logits, ids, lead = _lead(logits, action_ids, "logits")
    rows = _rows(logits, lead, ids, mask, temperature, backend, check_ids, vocab_axis,
                 logits_name="logits")
    return _tail.logprobs_step(rows, return_entropy)


def ratio_kl(policy_logits, ref_logits, action_ids, mask, old_logps, *, ref_logps,
             kl_estimator, temperature, backend, check_ids,
             vocab_axis) -> Tuple[jax.Array, jax.Array]:
    """``ratiokl.jax.loss.ratio_kl`` (documented there)."""
    policy_logits, ids, lead = _lead(policy_logits, action_ids)
    ref_logits, ref_logps = _checks.check_ref(ref_logits, ref_logps, tuple(policy_logits.shape))
    old_logps = _checks.check_row_values("old_logps", old_logps, lead)
    kl_code = kl_estimator_code(kl_estimator)
    rows = _rows(policy_logits, lead, ids, mask, temperature, backend, check_ids, vocab_axis,
                 ref_logits=ref_logits)
    ref = None if ref_logits is None else ref_logits.reshape(rows.logits.shape)
    return _tail.ratio_kl_step(XP.for_dtype(policy_logits.dtype), rows, ref, old_logps,
                               ref_logps, kl_code)


def policy_loss(policy_logits, ref_logits, action_ids, mask, old_logps, advantages,
                opts: PolicyLossOptions, *, ref_logps, loss_normalizer, kl_entropy_normalizer,
                segment_ids, importance_weights, temperature, backend, check_ids, vocab_axis,
                inplace_grad, rollout_logps, rollout_correction,
                rollout_bounds) -> Tuple[jax.Array, Dict[str, jax.Array]]:
    """``ratiokl.jax.loss.policy_loss`` (documented there), its options in ``opts``."""
    policy_logits, ids, lead = _lead(policy_logits, action_ids)
    if ref_logits is not None or ref_logps is not None or opts.uses_kl:
        ref_logits, ref_logps = _checks.check_ref(ref_logits, ref_logps, policy_logits.shape)
    xp = XP.for_dtype(policy_logits.dtype)  # float64 logits: float64 math (native)
    inputs = _tail.loss_inputs(xp, opts, lead, old_logps, advantages, segment_ids,
                               importance_weights, loss_normalizer, kl_entropy_normalizer,
                               rollout_logps)
    rows = _rows(policy_logits, lead, ids, mask, temperature, backend, check_ids, vocab_axis,
                 ref_logits=ref_logits)
    ref = None if ref_logits is None else ref_logits.reshape(rows.logits.shape)
    # The rollout options are checked on every call; only a call with rollout_logps
    # visits the correction (its weights, folded into importance_weights, and metrics).
    rollout = rollout_options(rollout_correction, rollout_bounds, rollout_logps is not None,
                              old_given=old_logps is not None)
    return _tail.loss_step(xp, rows, ref, ref_logps, inputs, opts, rollout,
                           inplace_grad, "policy_loss")
