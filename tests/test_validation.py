"""Bad input gives a clear error or the documented NaN poison, in both frameworks.

A per-row temperature that is 0, negative, infinite or NaN on an active row:
``ValueError`` naming the position with the host check, its row NaN (outputs
and gradient, the other rows untouched) without it and under ``jit`` (where a
``checkify``-wrapped call raises). ``kl_coef < 0`` is rejected. Flattened
``[B*T, V]`` logits with ``[B, T]`` ids name ``action_ids``. ``backend="triton"`` without a
GPU, ids of a dtype other than int64 / int32 (``uint8`` included) and integer advantages
raise the same error type in both frameworks, naming the argument and what it got; of two
bad per-token arguments, both frameworks name the same one first.
"""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

#: The interpreter's NumPy reductions of a NaN row (the poison under test) warn.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

B, T, V = 2, 3, 11
BAD = (1, 0)  # the active position given the bad temperature


def _inputs(bad_temperature: float):
    rng = np.random.default_rng(3)
    logits = rng.normal(0.0, 2.0, (B, T, V)).astype(np.float32)
    ids = rng.integers(0, V, (B, T))
    mask = np.ones((B, T), bool)
    mask[0, 2] = False
    temperature = np.full((B, T), 0.8, np.float32)
    temperature[0, 2] = -1.0  # inactive: whatever it holds is fine
    temperature[BAD] = bad_temperature
    return logits, ids, mask, temperature


def _check_poisoned(logp, grad, mask):
    assert np.isnan(logp[BAD]) and np.all(np.isnan(grad[BAD]))
    others = mask.copy()
    others[BAD] = False
    assert np.all(np.isfinite(logp[others])) and np.all(np.isfinite(grad[others]))
    assert logp[0, 2] == 0.0 and np.all(grad[0, 2] == 0.0)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_torch_bad_temperature_raises_or_poisons_its_row(backend, bad):
    pytest.importorskip("triton") if backend == "interpret" else None
    from ratiokl.torch import loss

    logits, ids, mask, temp = (torch.from_numpy(a) for a in _inputs(bad))
    with pytest.raises(ValueError, match=r"temperature\[1, 0\]"):
        loss.selected_logprobs(logits, ids, mask, temperature=temp, backend=backend)
    leaf = logits.clone().requires_grad_(True)
    logp = loss.selected_logprobs(leaf, ids, mask, temperature=temp, backend=backend,
                                  check_ids=False)
    logp.sum().backward()
    _check_poisoned(logp.detach().numpy(), leaf.grad.numpy(), mask.numpy())


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan")])
def test_jax_bad_temperature_raises_poisons_and_checkifies(bad):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.experimental import checkify

    from ratiokl.jax import loss

    logits, ids, mask, temp = (jnp.asarray(a) for a in _inputs(bad))
    with pytest.raises(ValueError, match=r"temperature\[1, 0\]"):
        loss.selected_logprobs(logits, ids, mask, temperature=temp)

    def total(x, t):  # t traced: no host check (a closed-over array would be checked)
        logp = loss.selected_logprobs(x, ids, mask, temperature=t)
        return logp.sum(), logp

    grad, logp = jax.jit(jax.grad(total, has_aux=True))(logits, temp)
    _check_poisoned(np.asarray(logp), np.asarray(grad), np.asarray(mask))
    err, _ = checkify.checkify(jax.jit(total))(logits, temp)
    with pytest.raises(Exception, match=r"temperature\[1, 0\]"):
        err.throw()


def test_kl_coef_below_zero_is_rejected_in_both_frameworks():
    from ratiokl.torch import loss as torch_loss

    logits, ids, mask, _ = _inputs(1.0)
    rows = np.zeros((B, T), np.float32)
    with pytest.raises(ValueError, match="kl_coef"):
        torch_loss.policy_loss(torch.from_numpy(logits), torch.from_numpy(logits),
                               torch.from_numpy(ids), torch.from_numpy(mask),
                               torch.from_numpy(rows), torch.from_numpy(rows), kl_coef=-0.1)
    jnp = pytest.importorskip("jax.numpy")
    from ratiokl.jax import loss as jax_loss

    with pytest.raises(ValueError, match="kl_coef"):
        jax_loss.policy_loss(jnp.asarray(logits), jnp.asarray(logits), jnp.asarray(ids),
                             jnp.asarray(mask), jnp.asarray(rows), jnp.asarray(rows),
                             kl_coef=-0.1)


@pytest.mark.parametrize("op", ["ratio_kl", "policy_loss"])
def test_flattened_logits_with_unflattened_ids_name_action_ids(op):
    from ratiokl.torch import loss as torch_loss

    logits, ids, mask, _ = _inputs(1.0)
    flat = logits.reshape(B * T, V)
    rows = np.zeros((B, T), np.float32)
    args = (flat, flat, ids, mask, rows) + ((rows,) if op == "policy_loss" else ())
    with pytest.raises(ValueError, match="`action_ids` must have the logits' leading shape"):
        getattr(torch_loss, op)(*(torch.from_numpy(a) for a in args))
    jnp = pytest.importorskip("jax.numpy")
    from ratiokl.jax import loss as jax_loss

    with pytest.raises(ValueError, match="`action_ids` must have the logits' leading shape"):
        getattr(jax_loss, op)(*(jnp.asarray(a) for a in args))


@pytest.mark.parametrize("options, match", [
    ({"objective": "grpo"}, r"`objective` must be one of 'ppo', 'cispo', 'sapo'; got 'grpo'"),
    ({"sapo_temperatures": (1.0, 1.0)}, r"`sapo_temperatures` has no meaning without"),
    ({"objective": "sapo", "sapo_temperatures": (1.0, 0.0)},
     r"`sapo_temperatures` must be > 0.0"),
    ({"objective": "sapo", "sapo_temperatures": 1.0}, r"`sapo_temperatures` must be a pair"),
    ({"objective": "sapo", "dual_clip": 3.0}, r"`dual_clip` / `ratio_cap` have no meaning"),
    ({"objective": "cispo", "dual_clip": 3.0}, r"`dual_clip` has no meaning with objective"),
    # CISPO's ceiling may be below 1 (TRL's epsilon_high <= 1), PPO's ratio cap may not.
    ({"objective": "cispo", "ratio_cap": 0.0}, r"`ratio_cap` must be > 0.0 \(with objective"),
    ({"ratio_cap": 0.8}, r"`ratio_cap` must be > 1.0 \(INTELLECT-2"),
])
def test_bad_objective_options_are_rejected_in_both_frameworks(options, match):
    from ratiokl.torch import loss as torch_loss

    logits, ids, mask, _ = _inputs(1.0)
    rows = np.zeros((B, T), np.float32)
    with pytest.raises(ValueError, match=match):
        torch_loss.policy_loss(torch.from_numpy(logits), None, torch.from_numpy(ids),
                               torch.from_numpy(mask), torch.from_numpy(rows),
                               torch.from_numpy(rows), **options)
    jnp = pytest.importorskip("jax.numpy")
    from ratiokl.jax import loss as jax_loss

    with pytest.raises(ValueError, match=match):
        jax_loss.policy_loss(jnp.asarray(logits), None, jnp.asarray(ids), jnp.asarray(mask),
                             jnp.asarray(rows), jnp.asarray(rows), **options)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_inplace_grad_where_it_cannot_apply_raises(framework, ratio_level):
    """``inplace_grad=True`` on the two-pass route (the native backend, GSPO) raises a
    ``ValueError`` that says why and where the opt-in works, instead of doing nothing."""
    mod = pytest.importorskip(framework)
    loss = importlib.import_module(f"ratiokl.{framework}.loss")
    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(2, 3, 7)).astype(np.float32), rng.integers(0, 7, (2, 3)),
              rng.random((2, 3)) < 0.8, rng.normal(size=(2, 3)).astype(np.float32) - 2,
              rng.normal(size=2).astype(np.float32)]
    conv = (lambda a: mod.from_numpy(np.asarray(a))) if framework == "torch" else (
        lambda a: mod.numpy.asarray(a))
    logits, ids, mask, old, adv = (conv(a) for a in arrays)
    kw = dict(backend="native", ratio_level=ratio_level, check_ids=False)
    why = "GSPO" if ratio_level == "sequence" else "no one-kernel policy loss"
    with pytest.raises(ValueError, match=rf"inplace_grad=True` cannot apply here: .*{why}.*"
                                         r"backend 'triton'.*pass inplace_grad=False"):
        loss.policy_loss(logits, None, ids, mask, old, adv, inplace_grad=True, **kw)
    value, _ = loss.policy_loss(logits, None, ids, mask, old, adv, **kw)  # the plain call
    assert np.isfinite(float(value))


def _both_frameworks(arrays):
    """``[(loss module, converted arrays)]`` for PyTorch and, if installed, JAX."""
    from ratiokl.torch import loss as torch_loss

    out = [(torch_loss, [torch.from_numpy(np.asarray(a)) for a in arrays])]
    if importlib.util.find_spec("jax") is not None:
        import jax.numpy as jnp

        from ratiokl.jax import loss as jax_loss

        out.append((jax_loss, [jnp.asarray(a) for a in arrays]))
    return out


def test_triton_without_a_gpu_is_a_value_error_in_both_frameworks():
    """PyTorch's ``triton`` on CPU tensors and JAX's without a GPU: ``ValueError`` saying
    what it needs and what to use instead (JAX raised ``RuntimeError``)."""
    logits, ids, mask, _ = _inputs(1.0)
    for loss, (x, a, m) in _both_frameworks((logits, ids, mask)):
        if loss.__name__.startswith("ratiokl.jax"):
            import jax

            if jax.default_backend() == "gpu":
                continue
        with pytest.raises(ValueError, match=r"backend='triton' needs .*backend='native'"):
            loss.selected_logprobs(x, a, m, backend="triton")


@pytest.mark.parametrize("dtype", ["uint8", "int16", "float32"])
def test_ids_other_than_int64_or_int32_are_rejected_naming_the_dtype(dtype):
    """``uint8`` ids were accepted although the message says int64 / int32."""
    logits, ids, mask, _ = _inputs(1.0)
    for loss, (x, a, m) in _both_frameworks((logits, ids.astype(dtype), mask)):
        with pytest.raises(TypeError, match=rf"`action_ids` must be int(64|32) or int(32|64); "
                                            rf"got (torch\.)?{dtype}"):
            loss.selected_logprobs(x, a, m, backend="native")


def test_integer_advantages_are_rejected_naming_the_dtype():
    logits, ids, mask, _ = _inputs(1.0)
    rows = np.zeros((B, T), np.float32)
    arrays = (logits, ids, mask, rows, rows.astype(np.int32))
    for loss, (x, a, m, old, adv) in _both_frameworks(arrays):
        with pytest.raises(TypeError, match=r"`advantages` must be a floating .*got "
                                            r"(torch\.)?int32"):
            loss.policy_loss(x, None, a, m, old, adv, backend="native")


ROWS = np.zeros((B, T), np.float32)
#: Per-token arguments (arrays, then Python values) with two of them wrong, the error
#: and the argument each framework names first.
TWO_BAD = {
    "advantages, segment_ids": (dict(advantages=ROWS.astype(np.int32), segment_ids=ROWS),
                                {}, TypeError, "advantages"),
    "segment_ids, loss_normalizer": (dict(advantages=ROWS, segment_ids=ROWS),
                                     dict(loss_normalizer=0.0), TypeError, "segment_ids"),
    "importance_weights, advantages": (dict(advantages=ROWS[0, :1], importance_weights=ROWS[0]),
                                       {}, ValueError, "importance_weights"),
}


@pytest.mark.parametrize("case", list(TWO_BAD))
def test_two_bad_per_token_arguments_name_the_same_one_in_both_frameworks(case):
    """The per-token rules are one list checked in one order (PyTorch checked
    ``segment_ids`` before ``advantages``, JAX after)."""
    arrays, values, error, first = TWO_BAD[case]
    logits, ids, mask, _ = _inputs(1.0)
    for loss, (x, a, m, old, *given) in _both_frameworks([logits, ids, mask, ROWS,
                                                          *arrays.values()]):
        with pytest.raises(error, match=rf"^`{first}`"):
            loss.policy_loss(x, None, a, m, old, **dict(zip(arrays, given)), **values,
                             backend="native")


def test_vocab_blocks_give_the_starts_and_the_global_vocabulary():
    """``ratiokl.spec.vocab_blocks``: the ranks' contiguous blocks in order, the global ``V``
    the ids are checked against; an empty block is refused naming the sharded argument."""
    from ratiokl.spec import vocab_blocks

    assert vocab_blocks([3, 2, 2], "weight") == ((0, 3, 5), 7)
    with pytest.raises(ValueError, match=r"^`weight`: every rank's vocabulary block needs at "
                                         r"least one token; rank\(s\) 1 hold none"):
        vocab_blocks([4, 0], "weight")
