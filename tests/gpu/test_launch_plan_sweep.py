"""Every launch plan the GPU picks, swept over the shapes at the heuristics' boundaries.

Each public op on the Triton backend against the native path of the same
framework on the same inputs: values and gradients finite exactly where the
native ones are, and within the fixture tolerances elsewhere. The shapes come
from the heuristics themselves (``tests/helpers/launch_plans.py``): every vocabulary
size on both sides of a tile width, warp count or split change, and every row
count on both sides of a row threshold, in fp32, fp16 and bf16, so a changed
heuristic moves the sweep with it. Odd row counts carry adversarial inactive
rows (NaN / +-inf logits, ids < 0 and >= V, NaN old log-probs) and an active
row with -inf (masked) logits; even ones are clean.

PyTorch runs every (vocabulary, rows) pair; every shape is a compile in JAX
(jax-triton makes sizes compile-time constants), so JAX runs each plan the
sweep reaches at its smallest shape and the named sizes of the sweep.

The linear ops (``linear_selected_logprobs``, ``linear_policy_loss``) run once per (dtype, V)
with the options: the row kernels on chunk buffers of a third of the rows (a remainder chunk),
their gradients of hidden and weight against ``spec.linear_grad_tolerance``.

Run on the H200: ``bash scripts/h200.sh sweep-torch`` and ``sweep-jax`` (the PyTorch half
on 8 workers with expandable segments, the JAX half on 4: 10 and 6 ran out of GPU memory),
each in interleaved parts that fit a device call: ``SWEEP_PART=1/2 bash scripts/h200.sh
sweep-torch`` (pytest ``--part``). ``SWEEP_OPS=selected_logprobs_entropy`` sweeps only the
named ops (comma-separated), every plan of theirs: for a change to one kernel.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import pytest  # noqa: E402
import torch  # noqa: E402

from ratiokl import spec  # noqa: E402
from launch_plans import plans, sweep_rows, sweep_vocabularies  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Largest [N, V] swept (elements): the policy, reference, two gradients and the native
#: path's float32 temporaries of 4 parallel workers fit the H200 at this size.
MAX_ELEMENTS = 300_000_000
#: The sizes the issue names (kept in the JAX subset whatever the heuristics say).
NAMED_VOCABS = (1, 2, 31, 32, 33, 1000, 4095, 4096, 4097, 8191, 8192, 50_257, 151_936, 262_144)
AGGREGATIONS = tuple(spec.LOSS_AGGS)
#: The linear ops' hidden size (small: the sweep is about the row kernels on chunk buffers).
LINEAR_H = 16


def _rows(dtype: str, vocab: int):
    """Every sweep row count for the named vocabularies; elsewhere the fewest rows of each
    distinct set of plans (the rows change no bit of a row, only which plans run)."""
    rows = [n for n in sweep_rows(ITEMSIZE[dtype]) if n * vocab <= MAX_ELEMENTS or n == 1]
    if vocab in NAMED_VOCABS:
        return rows
    first = {}
    for n in rows:
        first.setdefault(plans(n, vocab, ITEMSIZE[dtype]), n)
    return sorted(first.values())


def _jax_shapes():
    """(dtype, V, N): each plan at its first (smallest) shape, plus the named sizes at N = 7."""
    seen, shapes = set(), []
    for dtype in DTYPES:
        for vocab in sweep_vocabularies(ITEMSIZE[dtype]):
            for n in _rows(dtype, vocab):
                new = plans(n, vocab, ITEMSIZE[dtype]) - seen
                if new or (vocab in NAMED_VOCABS and n == 7):
                    seen |= new
                    shapes.append((dtype, vocab, n))
    return shapes


# --- inputs ------------------------------------------------------------------------------


def _inputs(n: int, vocab: int, dtype: str, garbage: bool):
    g = torch.Generator(device="cuda").manual_seed(vocab * 131 + n)
    cuda = dict(device="cuda", generator=g)
    policy = torch.randn(n, vocab, **cuda) * 2
    ref = policy + 0.3 * torch.randn(n, vocab, **cuda)
    ids = torch.randint(0, vocab, (n,), **cuda)
    mask = torch.rand(n, **cuda) < 0.8
    mask[0] = True
    if garbage and n >= 4:
        mask[1:4] = False
        policy[1], ref[2], policy[3] = float("nan"), float("inf"), -float("inf")
        ids[1], ids[2] = -7, vocab + 5
        if n > 4 and vocab > 2:
            mask[4] = True
            policy[4, ::2] = -float("inf")  # vocabulary masking on an active row
            ids[4] = 1
    policy, ref = policy.to(DTYPES[dtype]), ref.to(DTYPES[dtype])
    logp = torch.log_softmax(policy.float(), -1).gather(1, ids.clamp(0, vocab - 1)[:, None])[:, 0]
    old = torch.where(torch.isfinite(logp), logp, -5.0) + 0.2 * torch.randn(n, **cuda)
    if garbage and n >= 4:
        old[1] = float("nan")
    ref_logps = old + 0.1 * torch.randn(n, **cuda)
    # The linear ops' inputs: hidden states [n, H] and an lm_head [V, H] (+ bias) whose logits
    # spread like the policy's, a NaN hidden state on an inactive row.
    hidden = torch.randn(n, LINEAR_H, **cuda)
    weight = torch.randn(vocab, LINEAR_H, **cuda) * (2.0 / LINEAR_H**0.5)
    bias = 0.1 * torch.randn(vocab, **cuda)
    if garbage and n >= 4:
        hidden[1] = float("nan")
    return dict(policy=policy, ref=ref, ids=ids, mask=mask, old=old, ref_logps=ref_logps,
                adv=torch.randn(n, **cuda), g1=torch.randn(n, **cuda),
                g2=torch.randn(n, **cuda), hidden=hidden.to(DTYPES[dtype]),
                weight=weight.to(DTYPES[dtype]), bias=bias.to(DTYPES[dtype]))


def _scale(x) -> float:
    p = x["policy"].float()[x["mask"]]
    return float(p[torch.isfinite(p)].abs().max()) if p.numel() else 1.0


# --- the ops, one runner per framework ----------------------------------------------------
# Each runner returns {name: float32 CUDA tensor}: the op's outputs and its policy-logit gradient.


def _policy_options(op: str, agg: str, backend: str, coefficient):
    """``policy_loss`` keyword options of a sweep op, and whether it takes ``ref_logps``.

    The op's name says them: ``gspo``, ``inplace``, ``cispo``, ``entropy`` (an entropy
    bonus of 0.05; ``entropy_tensor``: as a 0-d array, ``coefficient(0.05)``), a
    ``ref_logps`` ending; ``policy_fwd*`` takes no gradient (the runners); ``on_policy``:
    no old log-probs (the runners pass None).
    """
    kw = dict(kl_coef=0.1, loss_agg=agg)
    if "gspo" in op:
        kw["ratio_level"] = "sequence"
    if "inplace" in op:
        kw["inplace_grad"] = backend == "triton"
    if "cispo" in op:
        kw["objective"] = "cispo"
    if "entropy" in op:
        kw["entropy_coef"] = coefficient(0.05) if "tensor" in op else 0.05
    return kw, op.startswith("policy_fwd") or op.endswith("ref_logps")


def _linear_chunk(n: int) -> int:
    """The linear ops' ``chunk_rows``: a third of the rows, so the last chunk is a remainder."""
    return max(1, n // 3 + 1)


def _torch_linear(x, backend: str, op: str, agg: str):
    """``linear_selected_logprobs`` (entropy, bias, softcap) or ``linear_policy_loss`` (bias,
    logit scale) in chunks of :func:`_linear_chunk` rows; gradients to hidden and weight."""
    from ratiokl.torch import loss

    hidden = x["hidden"].detach().clone().requires_grad_()
    weight = x["weight"].detach().clone().requires_grad_()
    common = dict(backend=backend, check_ids=False, bias=x["bias"],
                  chunk_rows=_linear_chunk(hidden.shape[0]))
    if op == "linear_logprobs":
        logp, ent = loss.linear_selected_logprobs(hidden, weight, x["ids"], x["mask"],
                                                  logit_softcap=30.0, return_entropy=True,
                                                  **common)
        outs, obj = {"logp": logp, "entropy": ent}, (logp * x["g1"] + ent * x["g2"]).sum()
    else:
        lead = (1, hidden.shape[0])
        value, metrics = loss.linear_policy_loss(
            hidden.view(*lead, -1), weight, x["ids"].view(lead), x["mask"].view(lead),
            x["old"].view(lead), x["adv"].view(lead), ref_logps=x["ref_logps"].view(lead),
            kl_coef=0.1, entropy_coef=0.05, loss_agg=agg, logit_scale=0.5, **common)
        outs, obj = {"loss": value, **metrics}, (value * -1.7).sum()  # "none": [...]
    outs["grad"], outs["grad_weight"] = torch.autograd.grad(obj, (hidden, weight))
    return {k: v.detach().float() for k, v in outs.items()}


def _torch_ops(x, backend: str, op: str, agg: str = "token-mean"):
    from ratiokl.torch import loss

    if op.startswith("linear"):
        return _torch_linear(x, backend, op, agg)
    leaf = x["policy"].detach().clone().requires_grad_(not op.startswith("policy_fwd"))
    lead = (1, leaf.shape[0])  # one row of sequences for the sequence aggregations
    common = dict(backend=backend, check_ids=False)
    if op == "selected_logprobs":
        logp = loss.selected_logprobs(leaf, x["ids"], x["mask"], **common)
        outs, obj = {"logp": logp}, (logp * x["g1"]).sum()
    elif op == "selected_logprobs_entropy":
        logp, ent = loss.selected_logprobs(leaf, x["ids"], x["mask"], return_entropy=True,
                                           **common)
        outs, obj = {"logp": logp, "entropy": ent}, (logp * x["g1"] + ent * x["g2"]).sum()
    elif op in ("ratio_kl", "ratio_kl_ref_logps"):
        by_logps = op == "ratio_kl_ref_logps"
        ratio, kl = loss.ratio_kl(leaf, None if by_logps else x["ref"], x["ids"], x["mask"],
                                  x["old"], ref_logps=x["ref_logps"] if by_logps else None,
                                  **common)
        outs, obj = {"ratio": ratio, "kl": kl}, (ratio * x["g1"] + kl * x["g2"]).sum()
    else:
        kw, by_logps = _policy_options(op, agg, backend,
                                       lambda v: torch.tensor(v, device="cuda"))
        value, metrics = loss.policy_loss(
            leaf.view(*lead, -1), None if by_logps else x["ref"].view(*lead, -1),
            x["ids"].view(lead), x["mask"].view(lead),
            None if "on_policy" in op else x["old"].view(lead), x["adv"].view(lead),
            ref_logps=x["ref_logps"].view(lead) if by_logps else None, **common, **kw)
        outs, obj = {"loss": value, **metrics}, (value * -1.7).sum()  # "none": [...]
    if leaf.requires_grad:
        grad = torch.autograd.grad(obj, leaf)[0]
        outs["grad"] = grad
        assert grad.dtype == x["policy"].dtype
    return {k: v.detach().float() for k, v in outs.items()}


def _jax_ops(x, backend: str, op: str, agg: str = "token-mean"):
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    j = {k: jax.dlpack.from_dlpack(v.contiguous()) for k, v in x.items()}  # no copy
    lead = (1, j["policy"].shape[0])
    common = dict(backend=backend, check_ids=False)
    if op.startswith("linear"):
        return _jax_linear(j, backend, op, agg)

    def run(policy):
        if op == "selected_logprobs":
            logp = loss.selected_logprobs(policy, j["ids"], j["mask"], **common)
            return jnp.sum(logp * j["g1"]), {"logp": logp}
        if op == "selected_logprobs_entropy":
            logp, ent = loss.selected_logprobs(policy, j["ids"], j["mask"], return_entropy=True,
                                               **common)
            return jnp.sum(logp * j["g1"] + ent * j["g2"]), {"logp": logp, "entropy": ent}
        if op in ("ratio_kl", "ratio_kl_ref_logps"):
            by_logps = op == "ratio_kl_ref_logps"
            ratio, kl = loss.ratio_kl(policy, None if by_logps else j["ref"], j["ids"], j["mask"],
                                      j["old"], ref_logps=j["ref_logps"] if by_logps else None,
                                      **common)
            return jnp.sum(ratio * j["g1"] + kl * j["g2"]), {"ratio": ratio, "kl": kl}
        kw, by_logps = _policy_options(op, agg, backend, jnp.float32)
        r = lambda a: a.reshape(lead)  # noqa: E731
        value, metrics = loss.policy_loss(
            policy.reshape(*lead, -1), None if by_logps else j["ref"].reshape(*lead, -1),
            r(j["ids"]), r(j["mask"]), None if "on_policy" in op else r(j["old"]), r(j["adv"]),
            ref_logps=r(j["ref_logps"]) if by_logps else None, **common, **kw)
        return jnp.sum(value * -1.7), {"loss": value, **metrics}

    if op.startswith("policy_fwd"):
        outs = jax.jit(lambda p: run(p)[1])(j["policy"])
    else:
        grad, outs = jax.jit(jax.grad(run, has_aux=True))(j["policy"])
        assert grad.dtype == j["policy"].dtype
        outs = {**outs, "grad": grad}
    return {k: torch.from_dlpack(jnp.asarray(v, jnp.float32)) for k, v in outs.items()}


def _jax_linear(j, backend: str, op: str, agg: str):
    """:func:`_torch_linear` in JAX (jitted, ``jax.grad`` with respect to hidden and weight)."""
    import jax
    import jax.numpy as jnp

    from ratiokl.jax import loss

    n = j["hidden"].shape[0]
    common = dict(backend=backend, check_ids=False, chunk_rows=_linear_chunk(n))

    def run(hw):
        hidden, weight = hw
        if op == "linear_logprobs":
            logp, ent = loss.linear_selected_logprobs(
                hidden, weight, j["ids"], j["mask"], bias=j["bias"], logit_softcap=30.0,
                return_entropy=True, **common)
            return jnp.sum(logp * j["g1"] + ent * j["g2"]), {"logp": logp, "entropy": ent}
        lead = (1, n)
        r = lambda a: a.reshape(lead)  # noqa: E731
        value, metrics = loss.linear_policy_loss(
            hidden.reshape(*lead, -1), weight, r(j["ids"]), r(j["mask"]), r(j["old"]),
            r(j["adv"]), ref_logps=r(j["ref_logps"]), bias=j["bias"], kl_coef=0.1,
            entropy_coef=0.05, loss_agg=agg, logit_scale=0.5, **common)
        return jnp.sum(value * -1.7), {"loss": value, **metrics}

    (g_hidden, g_weight), outs = jax.jit(jax.grad(run, has_aux=True))((j["hidden"], j["weight"]))
    outs = {**outs, "grad": g_hidden, "grad_weight": g_weight}
    return {k: torch.from_dlpack(jnp.asarray(v, jnp.float32)) for k, v in outs.items()}


def _linear_magnitudes(x, op: str, agg: str):
    """``((d hidden, d weight) yardsticks, (d hidden, d weight) noise)`` of a linear op.

    The yardsticks (what ``spec.linear_grad_tolerance`` takes) are the largest entries of
    ``|du| @ |W|`` and ``|du|.T @ |hidden|``, ``du`` the float32 logits gradient of the
    same call, from autograd through the materialised logits (native backend). The noise is
    an absolute allowance on top of that tolerance: the same sums of a few float32 ulps of
    each active row's upstream gradient at its target's ``du`` entry, which every path
    carries even where the exact ``du`` is 0 (V = 1: ``p = 1 - 1e-7`` on the GPU, so
    ``du = g (1 - p)`` is not 0).
    """
    from ratiokl.torch import loss

    keep = x["mask"][:, None]
    hidden = torch.where(keep, x["hidden"].float(), 0.0)
    weight = x["weight"].float()
    u = (hidden @ weight.T + x["bias"].float()).requires_grad_()
    native = dict(backend="native", check_ids=False)
    if op == "linear_logprobs":
        z = 30.0 * torch.tanh(u / 30.0)
        logp, ent = loss.selected_logprobs(z, x["ids"], x["mask"], return_entropy=True, **native)
        obj = (logp * x["g1"] + ent * x["g2"]).sum()
    else:
        lead = (1, u.shape[0])
        value, _ = loss.policy_loss(
            (u * 0.5).view(*lead, -1), None, x["ids"].view(lead), x["mask"].view(lead),
            x["old"].view(lead), x["adv"].view(lead), ref_logps=x["ref_logps"].view(lead),
            kl_coef=0.1, entropy_coef=0.05, loss_agg=agg, **native)
        obj = value * -1.7
    du = torch.autograd.grad(obj, u)[0].abs().nan_to_num(0.0, 0.0, 0.0)
    upstream = 1.7 if op != "linear_logprobs" else x["g1"].abs() + x["g2"].abs()
    floor = 16.0 * torch.finfo(torch.float32).eps * torch.as_tensor(upstream).max().clamp(min=1.0)
    # One entry per active row: the target's 1 - p (its cancellation), where p is near 1.
    noise = torch.zeros_like(du)
    rows = torch.nonzero(x["mask"])[:, 0]
    noise[rows, x["ids"][rows].clamp(0, du.shape[1] - 1)] = floor
    return ((float((du @ weight.abs()).max()), float((du.T @ hidden.abs()).max())),
            (float((noise @ weight.abs()).max()), float((noise.T @ hidden.abs()).max())))


# --- the comparison -------------------------------------------------------------------------


def _compare(fast, slow, dtype: str, scale: float, n: int, what: str,
             magnitudes=None) -> None:
    """Finite exactly where the native path is; within the fixture tolerances elsewhere.

    On the GPU (float32 tensors): the sweep's largest gradients are gigabytes.
    ``magnitudes``: a linear op's yardsticks and noise (:func:`_linear_magnitudes`): its
    gradients take ``spec.linear_grad_tolerance`` plus the noise.
    """
    assert fast.keys() == slow.keys(), what
    fwd = spec.forward_tolerance(scale)
    for name, expected in slow.items():
        got, label = fast[name], f"{what}: {name}"
        assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), \
            f"{label}: finite positions differ"
        assert torch.equal(torch.isnan(got), torch.isnan(expected)), f"{label}: NaN positions"
        summed = expected.ndim == 0  # a sum over rows: float32 reordering grows with N
        ok = torch.isfinite(expected)
        got, expected = got[ok], expected[ok]
        if magnitudes is not None and name.startswith("grad"):
            (sizes, noise), which = magnitudes, name == "grad_weight"
            tol = spec.linear_grad_tolerance(dtype, scale, sizes[which])
            tol = spec.Tolerance(rtol=tol.rtol, atol=tol.atol + noise[which])
        elif name == "grad":
            top = float(expected.abs().max()) if expected.numel() else 1.0
            tol = spec.grad_tolerance(dtype, scale, top)
        elif summed:
            tol = spec.Tolerance(rtol=fwd.rtol * max(1.0, math.log2(n)) + 1e-6, atol=fwd.atol)
        else:
            tol = fwd
        excess = (got - expected).abs() - (tol.atol + tol.rtol * expected.abs())
        worst = float(excess.max()) if excess.numel() else -1.0
        assert worst <= 0.0, f"{label}: beyond tolerance by {worst:.3g} ({tol})"


#: Every (V, N) of the sweep: ``policy_entropy`` is the fused kernel with its entropy term
#: (``entropy_coef`` 0.05) in pass 2, at every launch plan.
OPS = ("selected_logprobs", "selected_logprobs_entropy", "ratio_kl", "ratio_kl_ref_logps",
       "policy", "policy_fwd", "policy_entropy", "policy_on_policy")
#: Once per (dtype, V), at the row count nearest 128: every aggregation, GSPO, in place,
#: CISPO (token and sequence ratio), and the entropy bonus with each of them (a 0-d tensor
#: coefficient once).
OPTION_OPS = tuple(("policy_ref_logps", agg) for agg in AGGREGATIONS) + (
    ("policy_gspo", "seq-mean-token-mean"), ("policy_inplace", "token-mean"),
    ("policy_cispo", "token-mean"), ("policy_cispo", "seq-mean-token-sum"),
    ("policy_entropy_ref_logps", "seq-mean-token-mean"),
    ("policy_entropy_ref_logps", "seq-mean-token-sum-norm"),
    ("policy_entropy_tensor", "token-sum"), ("policy_entropy_gspo", "seq-mean-token-mean"),
    ("policy_entropy_inplace", "token-mean"), ("policy_entropy_cispo", "seq-mean-token-sum"),
    ("policy_fwd_on_policy", "token-mean"),
    # The linear ops: the row kernels on chunk buffers (a remainder chunk), with their logit
    # options and a NaN hidden state on an inactive row.
    ("linear_logprobs", "token-mean"), ("linear_policy", "token-mean"),
    ("linear_policy", "seq-mean-token-sum"))


def _swept(cases):
    """``cases`` whose op is in ``$SWEEP_OPS`` (comma-separated op names), or all if unset:
    after a change to one kernel, every plan of the ops that launch it, in less device time."""
    only = [op for op in os.environ.get("SWEEP_OPS", "").split(",") if op]
    known = set(OPS) | {op for op, _ in OPTION_OPS}
    unknown = set(only) - known
    assert not unknown, f"SWEEP_OPS: no such op {sorted(unknown)}; the ops: {sorted(known)}"
    return [case for case in cases if not only or case[0] in only]


def _sweep_one(runner, dtype: str, vocab: int, n: int, with_options: bool) -> int:
    garbage = n % 2 == 1
    x = _inputs(n, vocab, dtype, garbage)
    scale = _scale(x)
    cases = _swept([(op, "token-mean") for op in OPS] + (list(OPTION_OPS) if with_options else []))
    for op, agg in cases:
        what = f"{runner.__name__} {op} {agg} {dtype} V={vocab} N={n} garbage={garbage}"
        fast, slow = runner(x, "triton", op, agg), runner(x, "native", op, agg)
        magnitudes = _linear_magnitudes(x, op, agg) if op.startswith("linear") else None
        _compare(fast, slow, dtype, scale, n, what, magnitudes)
        if "grad" in fast:
            assert bool((fast["grad"][~x["mask"]] == 0).all()), f"{what}: inactive rows' gradient"
    return len(cases)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("vocab", sorted(set(sweep_vocabularies(2)) | set(sweep_vocabularies(4))))
def test_torch_sweep(dtype: str, vocab: int) -> None:
    if vocab not in sweep_vocabularies(ITEMSIZE[dtype]):
        pytest.skip(f"V = {vocab} is no boundary for {ITEMSIZE[dtype]}-byte logits")
    rows = _rows(dtype, vocab)
    option_rows = min(rows, key=lambda n: abs(n - 128))
    count = sum(_sweep_one(_torch_ops, dtype, vocab, n, n == option_rows) for n in rows)
    print(f"[sweep] torch {dtype} V={vocab}: {len(rows)} row counts, {count} op calls")


@pytest.mark.parametrize("dtype, vocab, n", _jax_shapes())
def test_jax_sweep(dtype: str, vocab: int, n: int) -> None:
    pytest.importorskip("jax")
    from ratiokl.jax._jax_triton import import_jax_triton

    try:
        import_jax_triton()
    except ImportError as err:
        pytest.skip(f"jax_triton unavailable: {err}")
    count = _sweep_one(_jax_ops, dtype, vocab, n, with_options=vocab in NAMED_VOCABS)
    print(f"[sweep] jax {dtype} V={vocab} N={n}: {count} op calls")
