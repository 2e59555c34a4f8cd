"""``vocab_axis=`` on the Triton path, on 4 CPU devices; run by ``test_vocab_parallel.py``.

No GPU here: the checks run with ``backend="interpret"``, the Triton binding with each
kernel run by Triton's interpreter behind ``jax.pure_callback`` (which, like jax-triton,
types its outputs as invariant across ``shard_map``'s axes: the trap the Triton path
must handle); ``ratiokl.jax._interpret.recording`` shows that the kernels ran. The
fixture and grad-inside-body checks are those of ``vocab_parallel_worker.py``. Usage:
``python vocab_parallel_triton_worker.py CHECK ...``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Callable, Dict, List


def _load_native_worker():
    """The native worker module (it sets ``XLA_FLAGS`` before JAX initialises)."""
    path = Path(__file__).with_name("vocab_parallel_worker.py")
    module_spec = importlib.util.spec_from_file_location("_ratiokl_jax_vp_worker", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


WORKER = _load_native_worker()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ratiokl.jax import _interpret, _route, _vocab_linear, _vocab_parallel, loss  # noqa: E402


def _kernels(launches: List[_interpret.Launch]) -> set:
    return {launch.kernel for launch in launches}


def check_fixtures() -> None:
    """Conformance fixtures sharded over 4 devices on the kernels."""
    with _interpret.recording() as launches:
        for name in ("kl_k3_fp32", "inactive_rows_nan_logits_bf16", "active_row_nan_logit_fp32",
                     "active_rows_masked_vocab_fp16", "active_id_out_of_range_fp32",
                     "empty_rows_fp32", "ref_logps_given_fp32",
                     "selected_logprobs_temperature_per_row_fp16", "entropy_masked_vocab_fp32",
                     "policy_entropy_masked_vocab_fp32",
                     "policy_entropy_temperature_per_row_fp32"):
            WORKER.run_fixture(name)
    assert {"shard_stats_kernel", "logp_backward_kernel"} <= _kernels(launches), launches


def check_vma_off() -> None:
    """``check_vma=False``: an explicit Triton backend refuses; the one ``"auto"`` resolves
    to on a GPU takes the kernels only on logits typed varying over the axis, else the
    native math (exact either way)."""
    x = WORKER._inputs(1, (2, 3), 16)
    specs = dict(mesh=WORKER.MESH, in_specs=(P(None, None, "tp"), P(), P()), out_specs=P())
    fn = jax.shard_map(
        lambda p, i, m: loss.selected_logprobs(p, i, m, backend="interpret", vocab_axis="tp"),
        check_vma=False, **specs)
    try:
        fn(x["policy"], x["ids"], x["mask"])
    except ValueError as exc:
        assert "check_vma=True" in str(exc), exc
    else:
        raise AssertionError("backend='interpret' ran under check_vma=False")

    def auto_on_kernels(policy, ids, mask):  # what the route builds for "auto" on a GPU
        run = _vocab_parallel.backend(_route.resolve("interpret"), "tp", explicit=False,
                                      linear_selected_logprobs=_vocab_linear.selected_logprobs)
        logp = run.selected_logprobs(policy.reshape(-1, policy.shape[-1]), ids.reshape(-1),
                                     mask.reshape(-1), 1.0)
        return logp.reshape(ids.shape)

    want = loss.selected_logprobs(x["policy"], x["ids"], x["mask"], backend="native")
    for check_vma in (True, False):
        with _interpret.recording() as launches:
            got = jax.block_until_ready(jax.shard_map(auto_on_kernels, check_vma=check_vma,
                                                      **specs)(x["policy"], x["ids"], x["mask"]))
        assert ("shard_stats_kernel" in _kernels(launches)) == check_vma, (check_vma, launches)
        WORKER.assert_close(got, want, WORKER.TOL, f"auto, check_vma={check_vma}")


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
                                backend="interpret", **options)

    vocab = P(None, None, "tp")
    sharded = jax.shard_map(body, mesh=WORKER.MESH, in_specs=(vocab, vocab) + (P(),) * 4,
                            out_specs=P())
    with _interpret.recording() as launches:
        (value, metrics), grad = jax.block_until_ready(jax.jit(jax.value_and_grad(
            lambda p: sharded(p, x["ref"], *rows), has_aux=True))(x["policy"]))
    assert {"shard_stats_kernel", "logp_backward_kernel"} <= _kernels(launches), launches
    (value_1, metrics_1), grad_1 = jax.value_and_grad(
        lambda p: loss.policy_loss(p, x["ref"], *rows, backend="native", **options),
        has_aux=True)(x["policy"])
    WORKER.assert_close(value, value_1, WORKER.TOL, "policy loss")
    WORKER.assert_close(grad, grad_1, WORKER.TOL, "policy loss grad")
    for key in metrics_1:
        WORKER.assert_close(metrics[key], metrics_1[key], WORKER.TOL, key)
    assert np.isfinite(np.asarray(value)) and not np.any(np.asarray(grad)[~x["mask"]])


CHECKS: Dict[str, Callable[[], None]] = {
    "fixtures": check_fixtures,
    "vma_off": check_vma_off,
    "grad_inside_body": WORKER.check_grad_inside_body,
    "policy_loss": check_policy_loss,
}


def main(names) -> None:
    WORKER.BACKEND = "interpret"
    for name in names:
        CHECKS[name]()
        print(f"ok {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
