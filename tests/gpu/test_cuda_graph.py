"""A whole training step captured as one CUDA graph (``check_ids=False``) replays exactly.

Trainers capture their step once and replay it with new data copied into the
static inputs: every launch of the step must be capturable (no host sync, no
allocation that outlives the capture, no host-to-device copy), and a replay
must give the eager step's bits on the new data. Here: ``policy_loss`` (fused,
with a 0-d tensor ``kl_coef`` that changes between replays), ``ratio_kl`` and
``selected_logprobs``, forward and backward, on the H200.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from ratiokl.torch import loss  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, T, V = 4, 96, 50_257


def _inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return dict(
        logits=(torch.randn(B, T, V, device="cuda", generator=g) * 2).bfloat16(),
        ref=(torch.randn(B, T, V, device="cuda", generator=g) * 2).bfloat16(),
        ids=torch.randint(0, V, (B, T), device="cuda", generator=g),
        mask=torch.rand(B, T, device="cuda", generator=g) < 0.8,
        old=torch.randn(B, T, device="cuda", generator=g) * 0.3 - 11.0,
        adv=torch.randn(B, T, device="cuda", generator=g),
        kl_coef=torch.rand((), device="cuda", generator=g) * 0.2,
    )


def _step(x, leaf):
    """One step's scalar and outputs; the gradient lands in ``leaf.grad``."""
    value, metrics = loss.policy_loss(leaf, None, x["ids"], x["mask"], x["old"], x["adv"],
                                      ref_logps=x["old"] + 0.05, kl_coef=x["kl_coef"],
                                      check_ids=False)
    ratio, kl = loss.ratio_kl(leaf, x["ref"], x["ids"], x["mask"], x["old"], check_ids=False)
    logp = loss.selected_logprobs(leaf, x["ids"], x["mask"], check_ids=False)
    total = value + 0.1 * (ratio + kl).sum() + 0.01 * logp.sum()
    total.backward()
    return total.detach(), metrics["clip_fraction"]


def _eager(x):
    leaf = x["logits"].clone().requires_grad_(True)
    total, clip = _step(x, leaf)
    return total, clip, leaf.grad


def test_a_captured_step_replays_the_eager_bits_on_new_data() -> None:
    static = _inputs(0)
    leaf = static["logits"].clone().requires_grad_(True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: compiles and caches outside the capture
        for _ in range(2):
            leaf.grad = None
            _step(static, leaf)
    torch.cuda.current_stream().wait_stream(side)
    leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        total, clip = _step(static, leaf)
    for seed in (1, 2):
        fresh = _inputs(seed)
        for name, value in fresh.items():
            (leaf.data if name == "logits" else static[name]).copy_(value)
        graph.replay()
        want_total, want_clip, want_grad = _eager(fresh)
        assert torch.equal(total, want_total), seed
        assert torch.equal(clip, want_clip), seed
        assert torch.equal(leaf.grad, want_grad), seed
        assert torch.all(leaf.grad[~fresh["mask"]] == 0)


@pytest.mark.parametrize("op", ["selected_logprobs", "policy_loss"])
def test_check_ids_true_inside_a_capture_says_to_pass_false(op) -> None:
    """The default check waits for the device: inside a capture it raises a ValueError that
    names the fix before anything is queued, and the stream is usable after."""
    x = _inputs(2)
    call = {
        "selected_logprobs": lambda: loss.selected_logprobs(x["logits"], x["ids"], x["mask"]),
        "policy_loss": lambda: loss.policy_loss(x["logits"], None, x["ids"], x["mask"],
                                                x["old"], x["adv"]),
    }[op]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="check_ids=False inside the capture"):
        with torch.cuda.graph(graph):
            call()
    torch.cuda.synchronize()
    out = call()  # outside the capture the default check runs as ever
    assert torch.isfinite(out[0] if op == "policy_loss" else out).all()
