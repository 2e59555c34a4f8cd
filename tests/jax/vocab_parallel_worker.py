"""Vocabulary-parallel ``ratiokl.jax.loss`` on 4 CPU devices; run by ``test_vocab_parallel.py``.

A script, not a test module: ``--xla_force_host_platform_device_count=4``
must be set before JAX initialises, so it runs in its own process. Usage:
``python vocab_parallel_worker.py CHECK [CHECK ...]`` runs the named checks
(see ``CHECKS``); a failure raises, so the process exits non-zero with the
traceback on stderr.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import sys  # noqa: E402
from typing import Callable, Dict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import checkify  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ratiokl import harness, spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
from assertions import assert_close  # noqa: E402  (the tests' one closeness rule)

#: The sharded call against the unsharded one or the float64 spec (fp32 inputs).
TOL = spec.Tolerance(rtol=2e-5, atol=2e-5)

TP = 4
MESH = jax.make_mesh((1, TP), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
#: The ``backend=`` of the fixture and grad-inside-body checks ("interpret" when
#: ``vocab_parallel_triton_worker.py`` runs them).
BACKEND = "auto"


def _padded(x: np.ndarray, width: int) -> np.ndarray:
    """Logits padded with ``-inf`` columns to ``width`` (the recipe for V not divisible by TP)."""
    pad = np.full(x.shape[:-1] + (width - x.shape[-1],), -np.inf, dtype=x.dtype)
    return np.concatenate([x, pad], axis=-1)


def _sharded(op, ndim: int, static, check_vma: bool) -> Callable:
    """The operator under ``shard_map`` (logits split on ``tp``, the rest replicated).

    ``static`` holds the Python-scalar options (closed over); the returned
    function takes ``(logits dict, arrays dict)`` and returns ``{output: array}``.
    """
    vocab_spec = P(*([None] * (ndim - 1)), "tp")

    def body(logits, arrays):
        call = dict(static, **arrays, **logits)
        positional = [call.get(k) for k in op.positional]
        keywords = {k: call[k] for k in op.keywords if k in call}
        return op.unpack(getattr(loss, op.name)(*positional, **keywords, **op.fixed,
                                                backend=BACKEND, vocab_axis="tp"))

    def run(logits, arrays):
        specs = ({k: vocab_spec for k in logits}, P())
        return jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P(),
                             check_vma=check_vma)(logits, arrays)

    return run


def _with_grad(op, ndim: int, static, check_vma: bool) -> Callable:
    """One jitted program: outputs and the vjp w.r.t. the differentiated logits."""
    fn = _sharded(op, ndim, static, check_vma)

    def run(logits, arrays, cotangents):
        def outputs_of(x):  # (the outputs with a cotangent, all outputs)
            out = fn(dict(logits, **{op.differentiate: x}), arrays)
            return {o: out[o] for o in op.cotangents}, out

        _, vjp, outputs = jax.vjp(outputs_of, logits[op.differentiate], has_aux=True)
        return outputs, vjp(cotangents)[0]

    return jax.jit(run)


def _split_arguments(case, width: int):
    """``(logits padded to width, array arguments, static options)`` of a case."""
    op = case.spec
    logits, arrays, static = {}, {}, {}
    for key, value in case.arguments().items():
        if key in op.logit_args:
            logits[key] = jnp.asarray(_padded(value, width)).astype(jnp.dtype(case.dtype))
        elif isinstance(value, np.ndarray) and value.dtype == np.bool_:
            arrays[key] = jnp.asarray(value)
        elif isinstance(value, np.ndarray):
            arrays[key] = jnp.asarray(value.astype(np.int32 if value.dtype.kind in "iu" else
                                                   np.float32))
        else:
            static[key] = value
    return logits, arrays, static


def run_fixture(name: str, *, check_vma: bool = True) -> None:
    """One conformance case, sharded over 4 devices, judged by ``ratiokl.harness``."""
    case = harness.load_case(name)
    op = case.spec
    vocab = case.logits.shape[-1]
    width = -(-vocab // TP) * TP
    logits, arrays, static = _split_arguments(case, width)
    to_np = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    if case.expect_error:
        # Traced ids cannot raise: bad active rows are NaN (checkify: check_bad_ids_and_errors).
        ids = case.arrays["action_ids"]
        bad = case.row_mask & ((ids < 0) | (ids >= vocab))
        outputs = jax.jit(_sharded(op, case.logits.ndim, static, check_vma))(logits, arrays)
        for o, v in outputs.items():
            assert np.array_equal(np.isnan(to_np(v)), bad), (name, o)
        return
    cot = {o: jnp.asarray(c) for o, c in case.cotangents().items()}
    outputs, grad = _with_grad(op, case.logits.ndim, static, check_vma)(logits, arrays, cot)
    outcome = harness.Outcome(
        outputs={o: to_np(v) for o, v in outputs.items()},
        output_dtypes={o: str(v.dtype) for o, v in outputs.items()},
        grad=to_np(grad)[..., :vocab],
        grad_dtype=str(grad.dtype),
    )
    check = harness.judge(case, outcome)
    assert check.passed, (name, check.failures)
    assert not np.any(to_np(grad)[..., vocab:]), (name, "padding columns got a gradient")


#: Fixtures run in CI, one per behaviour that sharding could break, dtypes mixed (each
#: case compiles its own program, so ``fixtures_all`` -- every case -- is left to manual runs).
CI_FIXTURES = (
    "kl_k3_fp32", "inactive_rows_nan_logits_bf16", "inactive_rows_bad_ids_fp32",
    "active_row_nan_logit_fp32", "active_rows_masked_vocab_fp16", "active_id_out_of_range_fp32",
    "all_inactive_fp32", "empty_rows_fp32", "temperature_per_row_bf16", "ref_logps_given_fp32",
    "selected_logprobs_inactive_rows_fp32", "selected_logprobs_temperature_per_row_fp16",
    "vocab_20011_fp32", "extreme_magnitude_fp32",
    "entropy_masked_vocab_fp32", "entropy_temperature_per_row_bf16", "entropy_peaked_fp16",
    "policy_entropy_masked_vocab_fp32", "policy_entropy_temperature_per_row_fp32",
    "policy_entropy_cispo_bf16", "policy_grpo_kl_k3_fp32",
    "entropy_active_row_nan_inf_logits_fp32", "policy_entropy_active_row_nan_inf_logits_bf16",
)


def check_fixtures() -> None:
    """The CI subset of fixtures (V padded with -inf to a multiple of 4)."""
    for name in CI_FIXTURES:
        run_fixture(name)


def check_fixtures_all() -> None:
    """Every fixture (slow: one compilation per case)."""
    for name in harness.list_cases():
        run_fixture(name)


#: Rollout-correction fixtures run sharded: token and sequence level, packed segments, bf16.
ROLLOUT_FIXTURES = ("policy_rollout_token_truncate_bf16", "policy_rollout_icepop_fp32",
                    "policy_rollout_sequence_mask_packed_fp32", "policy_rollout_gspo_fp32")


def check_rollout_fixtures() -> None:
    """The rollout-correction fixtures (``rollout_logps`` NaN on inactive rows) sharded."""
    for name in ROLLOUT_FIXTURES:
        run_fixture(name)


def check_vma_off() -> None:
    """``check_vma=False``: JAX transposes the psum itself, so the gradient stays exact."""
    run_fixture("kl_k3_fp32", check_vma=False)
    run_fixture("selected_logprobs_temperature_per_row_fp32", check_vma=False)


def _inputs(seed: int, lead, vocab: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = rng.random(lead) < 0.8
    policy = rng.normal(0.0, 2.0, lead + (vocab,)).astype(np.float32)
    policy[~mask, : vocab // TP] = np.nan  # inactive rows: NaN inside the first block only
    return {
        "policy": policy,
        "ref": rng.normal(0.0, 2.0, lead + (vocab,)).astype(np.float32),
        "ids": np.where(mask, rng.integers(0, vocab, lead), -3).astype(np.int32),
        "mask": mask,
        "old": rng.normal(-3.0, 1.0, lead).astype(np.float32),
        "adv": rng.normal(size=lead).astype(np.float32),
    }


def check_grad_inside_body() -> None:
    """``jax.grad`` taken inside the shard_map body gives each device its gradient block."""
    x = _inputs(1, (3, 4), 32)

    def body(policy, ids, mask):
        g = jax.grad(lambda p: loss.selected_logprobs(p, ids, mask, backend=BACKEND,
                                                      vocab_axis="tp").sum())
        return g(policy)

    grad = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(None, None, "tp"), P(), P()),
                                 out_specs=P(None, None, "tp")))(x["policy"], x["ids"], x["mask"])
    expected = spec.selected_logprobs_grad(x["policy"], x["ids"], x["mask"], np.ones((3, 4)))
    assert_close(grad, expected, TOL, "grad inside shard_map")


def check_policy_loss() -> None:
    """Sharded ``policy_loss`` (with a KL term on ref logits) equals the unsharded one: the
    PPO and the CISPO objective."""
    for objective in (dict(), dict(objective="cispo", clip_eps_high=0.28),
                      dict(entropy_coef=0.2), dict(entropy_coef=-0.1, ratio_level="sequence")):
        _check_policy_loss(objective)


def _check_policy_loss(objective) -> None:
    x = _inputs(2, (4, 5), 48)
    options = dict(kl_coef=0.1, loss_agg="seq-mean-token-mean", temperature=0.9, **objective)

    def unsharded(policy):
        return loss.policy_loss(policy, x["ref"], x["ids"], x["mask"], x["old"], x["adv"],
                                **options)

    def body(policy, ref, ids, mask, old, adv):
        return loss.policy_loss(policy, ref, ids, mask, old, adv, vocab_axis="tp", **options)

    vocab = P(None, None, "tp")
    sharded = jax.shard_map(body, mesh=MESH, in_specs=(vocab, vocab, P(), P(), P(), P()),
                            out_specs=P())
    fn = lambda p: sharded(p, x["ref"], x["ids"], x["mask"], x["old"], x["adv"])  # noqa: E731
    (value, metrics), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(x["policy"])
    (value_1, metrics_1), grad_1 = jax.value_and_grad(unsharded, has_aux=True)(x["policy"])
    assert_close(value, value_1, TOL, "policy loss")
    assert_close(grad, grad_1, TOL, "policy loss grad")
    for key in metrics_1:
        assert_close(metrics[key], metrics_1[key], TOL, key)
    assert np.isfinite(np.asarray(value)) and not np.any(np.asarray(grad)[~x["mask"]])


def check_plain_jit_named_sharding() -> None:
    """Plain ``jit`` of the ordinary API on vocabulary-sharded arrays: XLA partitions it."""
    x = _inputs(3, (4, 6), 64)
    sharding = NamedSharding(MESH, P(None, None, "tp"))
    policy = jax.device_put(x["policy"], sharding)
    ref = jax.device_put(x["ref"], sharding)

    def fn(p, r):
        ratio, kl = loss.ratio_kl(p, r, x["ids"], x["mask"], x["old"], backend="native")
        return (ratio * 0.5 + kl).sum(), (ratio, kl)

    (_, (ratio, kl)), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(policy, ref)
    exp_ratio, exp_kl = spec.ratio_kl(x["policy"], x["ref"], x["ids"], x["mask"], x["old"])
    g = np.full((4, 6), 0.5), np.ones((4, 6))
    exp_grad = spec.ratio_kl_grad(x["policy"], x["ref"], x["ids"], x["mask"], x["old"], *g)
    assert_close(ratio, exp_ratio, TOL, "ratio (plain jit)")
    assert_close(kl, exp_kl, TOL, "kl (plain jit)")
    assert_close(grad, exp_grad, TOL, "grad (plain jit)")
    assert grad.sharding.is_equivalent_to(sharding, 3), grad.sharding


def check_data_and_tensor_parallel() -> None:
    """A 2 x 2 mesh: rows split on ``dp``, vocabulary on ``tp``; per-row temperature."""
    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    x = _inputs(4, (4, 3), 40)
    temp = np.linspace(0.5, 1.5, 12, dtype=np.float32).reshape(4, 3)

    def body(policy, ref, ids, mask, old, t):
        ratio, kl = loss.ratio_kl(policy, ref, ids, mask, old, temperature=t, kl_estimator="k2",
                                  vocab_axis="tp")
        return ratio, kl

    rows, vocab = P("dp"), P("dp", None, "tp")
    fn = jax.shard_map(body, mesh=mesh, in_specs=(vocab, vocab, rows, rows, rows, rows),
                       out_specs=(rows, rows))

    def total(p):
        ratio, kl = fn(p, x["ref"], x["ids"], x["mask"], x["old"], temp)
        return (ratio - kl).sum(), (ratio, kl)

    (_, (ratio, kl)), grad = jax.jit(jax.value_and_grad(total, has_aux=True))(x["policy"])
    kw = dict(kl_estimator="k2", temperature=temp)
    args = (x["policy"], x["ref"], x["ids"], x["mask"], x["old"])
    exp_ratio, exp_kl = spec.ratio_kl(*args, **kw)
    exp_grad = spec.ratio_kl_grad(*args, np.ones((4, 3)), -np.ones((4, 3)), **kw)
    assert_close(ratio, exp_ratio, TOL, "ratio (dp x tp)")
    assert_close(kl, exp_kl, TOL, "kl (dp x tp)")
    assert_close(grad, exp_grad, TOL, "grad (dp x tp)")


def check_collectives() -> None:
    """Compiled fwd+bwd of ratio_kl: one pmax and one psum all-reduce, none in the backward;
    policy_loss with an entropy bonus: as many as without."""
    x = _inputs(6, (2, 8), 64)
    fn = jax.shard_map(
        lambda p, r: sum(jnp.sum(o) for o in loss.ratio_kl(p, r, x["ids"], x["mask"], x["old"],
                                                           vocab_axis="tp")),
        mesh=MESH, in_specs=(P(None, None, "tp"),) * 2, out_specs=P())
    text = jax.jit(jax.value_and_grad(fn)).lower(x["policy"], x["ref"]).compile().as_text()
    reduces = [line for line in text.splitlines() if " all-reduce(" in line
               or "all-reduce-start(" in line]
    assert len(reduces) == 2, reduces
    assert "all-gather" not in text
    # policy_loss: the entropy (always taken for entropy_mean, and in the loss with a
    # coefficient) adds a term to the policy's psum, not an all-reduce of its own.
    counts = []
    for coef in (0.0, 0.1):
        step = jax.shard_map(
            lambda p, r: loss.policy_loss(p, r, x["ids"], x["mask"], x["old"], x["adv"],
                                          kl_coef=0.1, entropy_coef=coef, vocab_axis="tp")[0],
            mesh=MESH, in_specs=(P(None, None, "tp"),) * 2, out_specs=P())
        text = jax.jit(jax.value_and_grad(step)).lower(x["policy"], x["ref"]).compile().as_text()
        counts.append(sum(" all-reduce(" in line or "all-reduce-start(" in line
                          for line in text.splitlines()))
    assert counts[0] == counts[1] <= 4, counts


def check_bad_ids_and_errors() -> None:
    """Ids are global: V_local..V-1 are fine, V is NaN (and raises under checkify)."""
    x = _inputs(5, (2, 3), 16)
    x["mask"][:] = True
    x["policy"] = np.nan_to_num(x["policy"])
    x["ids"][0, 0], x["ids"][0, 1], x["ids"][1, 2] = 4, 15, 16

    def body(policy, ids, mask):
        return loss.selected_logprobs(policy, ids, mask, vocab_axis="tp")

    fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(None, None, "tp"), P(), P()),
                               out_specs=P()))
    logp = np.asarray(fn(x["policy"], x["ids"], x["mask"]))
    assert np.argwhere(np.isnan(logp)).tolist() == [[1, 2]], logp
    ok = x["ids"] < 16
    expected = spec.selected_logprobs(x["policy"], np.where(ok, x["ids"], 0), x["mask"])
    assert_close(logp[ok], expected[ok], TOL, "logp next to a bad id")
    err, _ = checkify.checkify(fn, errors=checkify.user_checks)(x["policy"], x["ids"], x["mask"])
    assert err.get() is not None and "outside [0, 16)" in err.get(), err.get()
    for call, message in (
        (lambda: body(x["policy"], x["ids"], x["mask"]), "not a mesh axis bound here"),
        (lambda: jax.shard_map(
            lambda p, i, m: loss.selected_logprobs(p, i, m, backend="cuda", vocab_axis="tp"),
            mesh=MESH, in_specs=(P(None, None, "tp"), P(), P()), out_specs=P(),
        )(x["policy"], x["ids"], x["mask"]), "`backend` must be one of"),
    ):
        try:
            call()
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"expected ValueError containing {message!r}")


CHECKS: Dict[str, Callable[[], None]] = {
    "fixtures": check_fixtures,
    "fixtures_all": check_fixtures_all,
    "vma_off": check_vma_off,
    "grad_inside_body": check_grad_inside_body,
    "policy_loss": check_policy_loss,
    "rollout_fixtures": check_rollout_fixtures,
    "plain_jit_named_sharding": check_plain_jit_named_sharding,
    "data_and_tensor_parallel": check_data_and_tensor_parallel,
    "bad_ids_and_errors": check_bad_ids_and_errors,
    "collectives": check_collectives,
}


def main(names) -> None:
    for name in names:
        CHECKS[name]()
        print(f"ok {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
