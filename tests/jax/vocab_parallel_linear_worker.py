"""The linear ops with ``vocab_axis=`` (the lm_head's rows sharded) on 4 CPU devices.

Run by ``test_vocab_parallel.py``: ``python vocab_parallel_linear_worker.py BACKEND CHECK
...``. Inside ``shard_map`` device ``k`` holds rows ``[k V / 4, (k + 1) V / 4)`` of ``weight
[V, H]`` (``in_specs P("tp", None)``) and ``bias [V]`` (``P("tp")``); the hidden states
and per-token inputs are replicated. The sharded ``linear_selected_logprobs`` (with and
without the entropy) and ``linear_policy_loss`` are compared with the unsharded call and
the float64 spec: values, ``d hidden`` (whole on every device), ``d weight`` / ``d bias``
(the devices' blocks, assembled by ``out_specs``); inactive rows hold NaN / inf hidden
states and out-of-range ids. Also: gradients taken inside the body, the refusals
(``check_vma=False``, a replicated weight), bad ids, the compiled collectives, and linear
conformance fixtures with the head's rows over 2 devices (``fixtures``, ``fixtures_all``),
judged by ``ratiokl.harness``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Callable, Dict


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
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import checkify  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ratiokl import harness, spec  # noqa: E402
from ratiokl.jax import loss  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helpers"))
from assertions import assert_close  # noqa: E402
from vocab_linear_case import OPTIONS, expected, make_case  # noqa: E402

TP, WIDTH, VOCAB = WORKER.TP, 8, 20
#: The ``backend=`` of every call (the first command-line argument).
BACKEND = "native"
SPECS = dict(hidden=P(), weight=P("tp", None), bias=P("tp"))


def _arrays(case, dtype: str):
    """The case's arrays as JAX inputs (the head in ``dtype``)."""
    to = jnp.dtype(dtype)
    head = {k: jnp.asarray(case[k].astype(np.float32)).astype(to)
            for k in ("hidden", "weight", "bias")}
    rows = {k: jnp.asarray(case[k].astype(np.int32 if k == "ids" else np.float32))
            for k in ("ids", "temperature", "g_logp", "g_ent", "old", "adv", "ref_logps")}
    return head, dict(rows, mask=jnp.asarray(case["mask"]))


def _logprobs_objective(entropy: bool, axis=None):
    def objective(head, x):
        out = loss.linear_selected_logprobs(
            head["hidden"], head["weight"], x["ids"], x["mask"], bias=head["bias"],
            temperature=x["temperature"], return_entropy=entropy, backend=BACKEND,
            vocab_axis=axis, **OPTIONS)
        outputs = {"logp": out[0], "entropy": out[1]} if entropy else {"logp": out}
        total = jnp.sum(outputs["logp"] * x["g_logp"])
        if entropy:
            total = total + jnp.sum(outputs["entropy"] * x["g_ent"])
        return total, outputs

    return objective


def _sharded(fn, out_specs, check_vma: bool = True) -> Callable:
    return jax.shard_map(fn, mesh=WORKER.MESH, in_specs=(SPECS, P()), out_specs=out_specs,
                         check_vma=check_vma)


def check_logprobs() -> None:
    """Sharded ``linear_selected_logprobs`` vs the spec and the unsharded call, grad taken
    outside the ``shard_map``; fp32 and bf16, with and without the entropy. On the
    interpreter: the shard statistics and backward kernels ran."""
    if BACKEND != "interpret":
        return _check_logprobs()
    from ratiokl.jax import _interpret

    with _interpret.recording() as launches:
        _check_logprobs()
    ran = {launch.kernel for launch in launches}
    assert {"shard_stats_kernel", "logp_backward_kernel"} <= ran, ran
    return None


def _check_logprobs() -> None:
    for seed, (dtype, entropy) in enumerate((("float32", True), ("bfloat16", True),
                                             ("float32", False))):
        case = make_case(seed, (3, 5), WIDTH, VOCAB, TP, dtype)
        head, x = _arrays(case, dtype)
        objective = _logprobs_objective(entropy, "tp")
        sharded = _sharded(objective, (P(), P()))
        (_, outputs), grads = jax.jit(jax.value_and_grad(sharded, has_aux=True))(head, x)
        (_, outputs_1), grads_1 = jax.value_and_grad(_logprobs_objective(entropy),
                                                     has_aux=True)(head, x)
        _judge(case, dtype, entropy, outputs, grads, outputs_1, grads_1)


def _judge(case, dtype, entropy, outputs, grads, outputs_1, grads_1) -> None:
    exp_outputs, exp_grads, tols = expected(case, dtype, entropy)
    for name, value in outputs.items():
        assert_close(value, exp_outputs[name], tols[name], name)
        assert_close(value, outputs_1[name], tols[name], f"{name} vs unsharded")
        assert not np.any(np.asarray(value)[~case["mask"]]), name
    for name, exp in zip(("hidden", "weight", "bias"), exp_grads):
        assert grads[name].dtype == jnp.dtype(dtype), (name, grads[name].dtype)
        assert_close(grads[name].astype(jnp.float32), exp, tols[name], f"d {name}")
        assert_close(grads[name].astype(jnp.float32), grads_1[name].astype(jnp.float32),
                     tols[name], f"d {name} vs unsharded")
    assert not np.any(np.asarray(grads["hidden"])[~case["mask"]]), "d hidden, inactive rows"


def check_grad_inside_body() -> None:
    """``jax.grad`` inside the body: each device gets its rows of ``d weight`` / ``d bias``
    and the whole ``d hidden``."""
    case = make_case(4, (3, 5), WIDTH, VOCAB, TP, "float32")
    head, x = _arrays(case, "float32")
    objective = _logprobs_objective(True, "tp")

    def body(head, x):
        return jax.grad(lambda h: objective(h, x)[0])(head)

    grads = jax.jit(_sharded(body, SPECS))(head, x)
    grads_1 = jax.grad(lambda h: _logprobs_objective(True)(h, x)[0])(head)
    _, exp_grads, tols = expected(case, "float32", True)
    for name, exp in zip(("hidden", "weight", "bias"), exp_grads):
        assert_close(grads[name], exp, tols[name], f"d {name} (grad inside the body)")
        assert_close(grads[name], grads_1[name], tols[name], f"d {name} vs unsharded")


def check_data_and_tensor_parallel() -> None:
    """A 2 x 2 mesh: rows on ``dp`` (hidden, ids, mask, temperature), the head's rows on
    ``tp``: values and gradients equal the unsharded call's (``d weight`` summed over
    ``dp``). Also the head replicated (no ``vocab_axis``) with rows on ``dp`` alone."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((2, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    case = make_case(8, (4, 3), WIDTH, VOCAB, 2, "float32")
    head, x = _arrays(case, "float32")
    rows = {k: P("dp") for k in x}
    for axis, head_specs in (("tp", dict(hidden=P("dp"), weight=P("tp", None), bias=P("tp"))),
                             (None, dict(hidden=P("dp"), weight=P(), bias=P()))):
        sharded = jax.shard_map(lambda h, t, a=axis: _logprobs_objective(True, a)(h, t)[1],
                                mesh=mesh, in_specs=(head_specs, rows), out_specs=P("dp"))

        def objective(head, x):  # the outputs per row (split on dp), summed outside
            out = sharded(head, x)
            return jnp.sum(out["logp"] * x["g_logp"] + out["entropy"] * x["g_ent"]), out

        (_, outputs), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(head, x)
        (_, outputs_1), grads_1 = jax.value_and_grad(_logprobs_objective(True),
                                                     has_aux=True)(head, x)
        _judge(case, "float32", True, outputs, grads, outputs_1, grads_1)


def check_policy_loss() -> None:
    """Sharded ``linear_policy_loss`` equals the unsharded call: loss, metrics, gradients."""
    options = [dict(entropy_coef=0.2, loss_agg="seq-mean-token-mean")]
    if BACKEND == "native":
        options += [dict(), dict(objective="cispo", clip_eps_high=0.28),
                    dict(rollout_correction="token-truncate", rollout_bounds=(0.0, 1.2))]
    for extra in options:
        _check_policy_loss(extra)


def _check_policy_loss(extra) -> None:
    case = make_case(11, (4, 5), WIDTH, VOCAB, TP, "float32")
    head, x = _arrays(case, "float32")
    if "rollout_correction" in extra:  # the engine's log-probs, NaN on inactive rows
        extra = dict(extra, rollout_logps=jnp.asarray(
            (case["old"] + 0.3 * (case["ref_logps"] + 3.0)).astype(np.float32)))

    def objective(head, x, axis=None):
        return loss.linear_policy_loss(
            head["hidden"], head["weight"], x["ids"], x["mask"], x["old"], x["adv"],
            ref_logps=x["ref_logps"], bias=head["bias"], kl_coef=0.1, temperature=0.9,
            backend=BACKEND, vocab_axis=axis, **OPTIONS, **extra)

    sharded = _sharded(lambda h, t: objective(h, t, "tp"), (P(), P()))
    (value, metrics), grads = jax.jit(jax.value_and_grad(sharded, has_aux=True))(head, x)
    (value_1, metrics_1), grads_1 = jax.value_and_grad(objective, has_aux=True)(head, x)
    tol = spec.paths_tolerance(case["mask"].size)  # sums over the tokens
    assert np.isfinite(np.asarray(value)), value
    assert_close(value, value_1, tol, "linear policy loss")
    for key in metrics_1:
        assert_close(metrics[key], metrics_1[key], tol, key)
    for name in ("hidden", "weight", "bias"):
        # d hidden sums over the vocabulary, d weight and d bias over the tokens
        terms = VOCAB if name == "hidden" else case["mask"].size
        grad_tol = spec.paths_tolerance(terms, float(jnp.max(jnp.abs(grads_1[name]))))
        assert_close(grads[name], grads_1[name], grad_tol, f"policy loss d {name}")
    assert not np.any(np.asarray(grads["hidden"])[~case["mask"]])


def check_data_parallel() -> None:
    """Rows on ``dp`` (4 devices), the head replicated, no ``vocab_axis``: the ``psum`` of
    each device's token-sum ``linear_policy_loss`` is the unsharded call's loss, and so are
    its gradients (``d weight`` summed over ``dp`` by the transpose of the head's cast).
    Each call's outputs are typed as varying over ``dp``: a loss typed invariant made the
    ``psum`` a no-op whose transpose scaled ``d weight`` by the device count."""
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4,), ("dp",), axis_types=(AxisType.Auto,))
    case = make_case(13, (4, 5), WIDTH, VOCAB, 1, "float32")
    head, x = _arrays(case, "float32")
    options = dict(OPTIONS, loss_agg="token-sum", chunk_rows=3)

    def objective(head, x):
        return loss.linear_policy_loss(
            head["hidden"], head["weight"], x["ids"], x["mask"], x["old"], x["adv"],
            ref_logps=x["ref_logps"], bias=head["bias"], kl_coef=0.1, backend=BACKEND,
            **options)[0]

    head_specs = dict(hidden=P("dp"), weight=P(), bias=P())
    sharded = jax.shard_map(lambda h, t: lax.psum(objective(h, t), "dp"), mesh=mesh,
                            in_specs=(head_specs, {k: P("dp") for k in x}), out_specs=P())
    value, grads = jax.jit(jax.value_and_grad(sharded))(head, x)
    value_1, grads_1 = jax.value_and_grad(objective)(head, x)
    assert_close(value, value_1, spec.paths_tolerance(case["mask"].size), "dp loss")
    for name in ("hidden", "weight", "bias"):
        terms = VOCAB if name == "hidden" else case["mask"].size
        tol = spec.paths_tolerance(terms, float(jnp.max(jnp.abs(grads_1[name]))))
        assert_close(grads[name], grads_1[name], tol, f"dp d {name}")


def check_refusals() -> None:
    """``check_vma=False``, or a weight replicated along the axis: ``ValueError`` naming it
    (JAX could not type the gradients)."""
    case = make_case(5, (2, 3), WIDTH, VOCAB, TP, "float32")
    head, x = _arrays(case, "float32")
    objective = _logprobs_objective(False, "tp")
    replicated = jax.shard_map(objective, mesh=WORKER.MESH,
                               in_specs=(dict(SPECS, weight=P()), P()), out_specs=(P(), P()))
    head_full = dict(head, weight=head["weight"][:VOCAB // TP])  # a block, but replicated
    for run, args, name in ((_sharded(objective, (P(), P()), check_vma=False), (head, x),
                             "`weight`"),
                            (replicated, (head_full, x), "`weight`")):
        try:
            run(*args)
        except ValueError as err:
            assert name in str(err) and "check_vma=True" in str(err), err
        else:
            raise AssertionError("a weight not typed as varying over the axis was accepted")


def check_bad_ids() -> None:
    """A traced active id ``>= V`` (global) makes its row NaN, the others not; checkify
    raises naming the range."""
    case = make_case(6, (2, 3), WIDTH, VOCAB, TP, "float32")
    case["hidden"] = np.where(case["mask"][..., None], case["hidden"], 0.5)
    case["ids"] = np.where(case["mask"], case["ids"], VOCAB // TP)  # another block's id
    case["temperature"] = np.where(case["mask"], case["temperature"], 1.0)
    case["mask"][:] = True
    case["ids"][1, 2] = VOCAB
    head, x = _arrays(case, "float32")
    fn = jax.jit(_sharded(_logprobs_objective(False, "tp"), (P(), P())))
    logp = np.asarray(fn(head, x)[1]["logp"])
    assert np.argwhere(np.isnan(logp)).tolist() == [[1, 2]], logp
    err, _ = checkify.checkify(fn, errors=checkify.user_checks)(head, x)
    assert err.get() is not None and f"outside [0, {VOCAB})" in err.get(), err.get()


def _all_reduces(step, *args) -> set:
    """``(element type, size)`` of what each all-reduce (or its async start) of the compiled
    ``step`` reduces; no all-gather in it."""
    text = step.lower(*args).compile().as_text()
    assert "all-gather" not in text
    reduced = set()
    for line in text.splitlines():
        match = re.search(r"=\s*(.*?)\s+all-reduce(?:-start)?\(", line)
        if match is not None:
            reduced |= {(kind, int(np.prod([int(d) for d in dims.split(",") if d])))
                        for kind, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]",
                                                     match.group(1))}
    return reduced


def check_collectives() -> None:
    """The compiled fwd+bwd: only all-reduces of ``[C]``-sized rows (per chunk) and the one
    ``[N, H]`` of ``d hidden``, float32 with a bfloat16 head too, none when only the head is
    differentiated; no all-gather."""
    case = make_case(7, (3, 5), WIDTH, VOCAB, TP, "float32")
    n_rows, chunk = 15, OPTIONS["chunk_rows"]  # 3 full chunks and one of 3 rows
    per_chunk = {k * c for k in (1, 2, 3) for c in (chunk, n_rows % chunk)}
    whole = ("f32", n_rows * WIDTH)  # d hidden: float32 partials, summed, rounded once
    objective = _sharded(_logprobs_objective(True, "tp"), (P(), P()))
    for dtype in ("float32", "bfloat16"):
        head, x = _arrays(case, dtype)
        reduced = _all_reduces(jax.jit(jax.value_and_grad(objective, has_aux=True)), head, x)
        assert whole in reduced and {n for _, n in reduced - {whole}} <= per_chunk, reduced

    def head_only(head, x):  # d weight and d bias alone
        rest = {k: v for k, v in head.items() if k != "hidden"}
        return jax.grad(lambda r: objective(dict(r, hidden=head["hidden"]), x)[0])(rest)

    reduced = _all_reduces(jax.jit(head_only), head, x)
    assert {n for _, n in reduced} <= per_chunk, reduced


#: Linear fixtures run with the head's rows over 2 devices, one per behaviour (each case
#: compiles its own program; ``fixtures_all`` runs every one the padding can take).
FIXTURES = ("linear_masked_vocab_bf16", "linear_large_logits_argmax_fp32",
            "linear_bf16_weight_fp32", "linear_fp32_weight_bf16")
SHARDS = 2


def _padded_head(case, rows: int) -> Dict[str, np.ndarray]:
    """The case's ``hidden``, ``weight`` and ``bias`` (zeros where it has none) with the head
    padded to ``rows``: zero weight rows whose bias is ``-inf`` add ``exp(-inf) = 0`` to every
    sum, are never an action and get a zero gradient (not under a softcap, which maps
    ``-inf`` to ``-softcap``)."""
    weight, vocab = case.arrays["weight"], case.vocab
    bias = case.arrays.get("bias", np.zeros(vocab, np.float32))
    return {"hidden": case.arrays["hidden"],
            "weight": np.concatenate([weight, np.zeros((rows - vocab, weight.shape[1]),
                                                       np.float32)]),
            "bias": np.concatenate([bias, np.full(rows - vocab, -np.inf, np.float32)])}


def run_fixture(name: str) -> None:
    """One linear conformance case with the head's rows over ``SHARDS`` devices, judged by
    ``ratiokl.harness`` against the fixture's float64 expectations and tolerances."""
    case = harness.load_case(name)
    op = case.spec
    assert case.expect_error is None and case.options.get("logit_softcap") is None, name
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:SHARDS]), ("tp",))
    rows = -(-case.vocab // SHARDS) * SHARDS
    head = {k: jnp.asarray(v).astype(jnp.dtype(case.dtype_of(k if k in case.arrays
                                                             else "weight")))
            for k, v in _padded_head(case, rows).items()}
    arrays, static = {}, {}
    for key, value in case.arguments().items():
        if key in head:
            continue
        if isinstance(value, np.ndarray):  # mask bool, ids int32, the rest float32
            kind = {"b": np.bool_, "i": np.int32, "u": np.int32}.get(value.dtype.kind,
                                                                    np.float32)
            arrays[key] = jnp.asarray(value.astype(kind))
        else:
            static[key] = value

    def body(head, x):
        call = dict(static, **x, **head)
        return op.unpack(getattr(loss, op.name)(
            *[call.get(k) for k in op.positional],
            **{k: call[k] for k in op.keywords if k in call}, **op.fixed, backend=BACKEND,
            vocab_axis="tp"))

    sharded = jax.shard_map(body, mesh=mesh, in_specs=(SPECS, P()), out_specs=P())
    cot = case.cotangents()

    def objective(head):
        out = sharded(head, arrays)
        return sum(jnp.sum(out[o] * cot[o]) for o in op.cotangents), out

    (_, outputs), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(head)
    to_np = lambda x: np.asarray(x.astype(jnp.float32))  # noqa: E731
    extra = case.also_differentiated
    outcome = harness.Outcome(
        outputs={o: to_np(v) for o, v in outputs.items()},
        output_dtypes={o: str(v.dtype) for o, v in outputs.items()},
        grad=to_np(grads["hidden"]), grad_dtype=str(grads["hidden"].dtype),
        extra_grads={k: to_np(grads[k])[:case.vocab] for k in extra},
        extra_grad_dtypes={k: str(grads[k].dtype) for k in extra})
    check = harness.judge(case, outcome)
    assert check.passed, (name, check.failures)
    for key in ("weight", "bias"):
        assert not np.any(to_np(grads[key])[case.vocab:]), (name, f"padded rows' d {key}")


def check_fixtures() -> None:
    """The linear fixtures of ``FIXTURES`` on 2 devices (V = 257 padded to 258)."""
    for name in FIXTURES:
        run_fixture(name)


def check_fixtures_all() -> None:
    """Every linear fixture the padding can take (no softcap, no expected error)."""
    for name in harness.list_cases("linear_*"):
        case = harness.load_case(name)
        if case.expect_error is None and case.options.get("logit_softcap") is None:
            run_fixture(name)


CHECKS: Dict[str, Callable[[], None]] = {
    "logprobs": check_logprobs,
    "grad_inside_body": check_grad_inside_body,
    "policy_loss": check_policy_loss,
    "data_and_tensor_parallel": check_data_and_tensor_parallel,
    "data_parallel": check_data_parallel,
    "refusals": check_refusals,
    "bad_ids": check_bad_ids,
    "collectives": check_collectives,
    "fixtures": check_fixtures,
    "fixtures_all": check_fixtures_all,
}


def main(argv) -> None:
    global BACKEND
    BACKEND = argv[0]
    for name in argv[1:]:
        CHECKS[name]()
        print(f"ok {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
