"""``vocab_axis=`` on the Triton path, on 4 CPU devices; run by ``test_vocab_parallel.py``.

No GPU here, so ``jax_triton.triton_call`` is replaced by the kernels'
interpreter twins behind ``jax.pure_callback`` (which, like jax-triton, types
its outputs as invariant across ``shard_map``'s axes: the trap the Triton path
must handle) and the availability probe is told that jax-triton runs, so
``backend="auto"`` resolves to ``"triton"``. The checks themselves are those of
``vocab_parallel_worker.py``. Usage: ``python vocab_parallel_triton_worker.py CHECK ...``.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from pathlib import Path
from typing import Callable, Dict

import numpy as np
import torch


def _load_native_worker():
    """The native worker module (it sets ``XLA_FLAGS`` before JAX initialises)."""
    path = Path(__file__).with_name("vocab_parallel_worker.py")
    module_spec = importlib.util.spec_from_file_location("_ratiokl_jax_vp_worker", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


WORKER = _load_native_worker()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ratiokl._kernels import interpreted  # noqa: E402
from ratiokl.jax import _launch, _route, loss  # noqa: E402

#: The interpreter patches module globals while a launch runs: one launch at a time
#: (the callbacks of the 4 devices run on 4 threads).
_LAUNCH = threading.Lock()
#: Kernel name -> launches, to show that the Triton path ran.
LAUNCHES: Dict[str, int] = {}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _to_torch(a) -> torch.Tensor:
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _to_numpy(t: torch.Tensor, dtype) -> np.ndarray:
    return t.view(torch.int16).numpy().view(dtype) if dtype == jnp.bfloat16 else t.numpy()


def interpreted_triton_call(*args, kernel, out_shape, grid, num_warps=None, **meta):
    """``triton_call`` look-alike: the kernel's interpreter twin behind ``jax.pure_callback``."""
    del num_warps
    single = not isinstance(out_shape, (list, tuple))
    shapes = [out_shape] if single else list(out_shape)

    def host(*arrays):
        outs = [torch.empty(s.shape, dtype=_TORCH[np.dtype(s.dtype).name]) for s in shapes]
        with _LAUNCH, np.errstate(all="ignore"):
            LAUNCHES[kernel.__name__] = LAUNCHES.get(kernel.__name__, 0) + 1
            interpreted(kernel)[grid](*[_to_torch(a) for a in arrays], *outs, **meta)
        return [_to_numpy(o, s.dtype) for o, s in zip(outs, shapes)]

    res = jax.pure_callback(host, shapes, *args)
    return res[0] if single else res


def check_fixtures() -> None:
    """Conformance fixtures sharded over 4 devices, ``backend="auto"`` -> Triton."""
    for name in ("kl_k3_fp32", "inactive_rows_nan_logits_bf16", "active_row_nan_logit_fp32",
                 "active_rows_masked_vocab_fp16", "active_id_out_of_range_fp32",
                 "empty_rows_fp32", "ref_logps_given_fp32",
                 "selected_logprobs_temperature_per_row_fp16", "entropy_masked_vocab_fp32",
                 "policy_entropy_masked_vocab_fp32", "policy_entropy_temperature_per_row_fp32"):
        WORKER.run_fixture(name)
    assert LAUNCHES.get("shard_stats_kernel") and LAUNCHES.get("logp_backward_kernel"), LAUNCHES


def check_vma_off() -> None:
    """``check_vma=False``: "auto" falls back to the native math (exact); "triton" refuses."""
    before = dict(LAUNCHES)
    WORKER.run_fixture("kl_k3_fp32", check_vma=False)
    assert LAUNCHES == before, "check_vma=False ran the Triton path"
    x = WORKER._inputs(1, (2, 3), 16)
    fn = jax.shard_map(
        lambda p, i, m: loss.selected_logprobs(p, i, m, backend="triton", vocab_axis="tp"),
        mesh=WORKER.MESH, in_specs=(P(None, None, "tp"), P(), P()), out_specs=P(),
        check_vma=False,
    )
    try:
        fn(x["policy"], x["ids"], x["mask"])
    except ValueError as exc:
        assert "check_vma=True" in str(exc), exc
    else:
        raise AssertionError("backend='triton' ran under check_vma=False")


def check_policy_loss() -> None:
    """Sharded ``policy_loss`` on the Triton path equals the unsharded native one, grads too,
    with and without an entropy bonus."""
    for extra in (dict(), dict(entropy_coef=0.2)):
        _check_policy_loss(extra)


def _check_policy_loss(extra) -> None:
    x = WORKER._inputs(2, (4, 5), 48)
    options = dict(kl_coef=0.1, loss_agg="seq-mean-token-mean", temperature=0.9, **extra)
    rows = (x["ids"], x["mask"], x["old"], x["adv"])

    def body(policy, ref, ids, mask, old, adv):
        return loss.policy_loss(policy, ref, ids, mask, old, adv, vocab_axis="tp",
                                backend="triton", **options)

    vocab = P(None, None, "tp")
    sharded = jax.shard_map(body, mesh=WORKER.MESH, in_specs=(vocab, vocab) + (P(),) * 4,
                            out_specs=P())
    (value, metrics), grad = jax.jit(jax.value_and_grad(
        lambda p: sharded(p, x["ref"], *rows), has_aux=True))(x["policy"])
    (value_1, metrics_1), grad_1 = jax.value_and_grad(
        lambda p: loss.policy_loss(p, x["ref"], *rows, backend="native", **options),
        has_aux=True)(x["policy"])
    WORKER._close(value, value_1, "policy loss")
    WORKER._close(grad, grad_1, "policy loss grad")
    for key in metrics_1:
        WORKER._close(metrics[key], metrics_1[key], key)
    assert np.isfinite(np.asarray(value)) and not np.any(np.asarray(grad)[~x["mask"]])


CHECKS: Dict[str, Callable[[], None]] = {
    "fixtures": check_fixtures,
    "vma_off": check_vma_off,
    "grad_inside_body": WORKER.check_grad_inside_body,
    "policy_loss": check_policy_loss,
}


def main(names) -> None:
    _launch.triton_call = interpreted_triton_call
    _route._jax_triton_error = lambda: ""
    for name in names:
        CHECKS[name]()
        print(f"ok {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
