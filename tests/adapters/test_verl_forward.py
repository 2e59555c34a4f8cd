"""``ratiokl.adapters.verl``'s fused forward, and a training step through verl's engine.

verl (0.9.1) is the oracle. A tiny Llama built in code (no download) gets verl's fused
forward (``use_fused_kernels``, ``impl_backend="torch"``: ``FusedLinearForPPO`` on the last
hidden states and the lm_head weight) and, on an identical copy, the adapter's
(``impl_backend="ratiokl"``: ``linear_selected_logprobs``); the log-probs, the entropies
and every parameter's gradient must agree. The training step runs verl's FSDP engine
code (``FSDPEngineWithLMHead.train_batch``: ``forward_backward_batch`` over two
micro-batches, ``prepare_model_inputs`` / ``prepare_model_outputs``, the engine's
``ppo_loss`` with its entropy and KL terms, ``optimizer_step``) once with verl's fused
forward and ``loss_mode="vanilla"`` and once with the adapter's through the config keys
(``apply_monkey_patch`` as the engine's ``_build_module`` calls it, ``loss_mode="ratiokl"``).

What the CPU needs (the engine is built for CUDA / NPU devices): the engine object is
made without ``FSDPEngine.__init__`` / ``initialize`` (no FSDP wrapping, no device mesh:
a plain module, an SGD optimizer, one gloo process), and its module's two device
look-ups (``get_device_id``, ``get_device_name``) answer ``"cpu"``.
"""

from __future__ import annotations

import copy
import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl is not installed (see .ci/run block (d))")

from assertions import assert_close, two_paths  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from trainer_batch import tolerances  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from ratiokl.adapters.verl import use_ratiokl_forward  # noqa: E402
from ratiokl.spec import trainer_tolerance  # noqa: E402
from ratiokl.spec.tolerances import (linear_forward_tolerance,  # noqa: E402
                                     linear_grad_tolerance)

V, S = 37, 7
LENGTHS = (7, 5, 2, 6)  # tokens per row (right-padded)


def _model(seed: int = 0) -> torch.nn.Module:
    """A tiny Llama, its class a fresh subclass (verl patches the class's forward)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         attn_implementation="eager")
    model = LlamaForCausalLM(config)
    model.__class__ = type("TinyLlama", (LlamaForCausalLM,),
                           {"__module__": LlamaForCausalLM.__module__})
    return model


def _twins():
    """verl's fused forward and a copy with the same weights for the adapter's."""
    verl_model, ours = _model(), _model()
    ours.load_state_dict(verl_model.state_dict())
    monkey_patch.patch_forward_with_backends(verl_model, use_fused_kernels=True,
                                             fused_kernels_backend="torch")
    return verl_model, ours


def _run(model, inputs, up, mask):
    out = model(**inputs, temperature=0.8, return_dict=True, use_cache=False)
    ((out.log_probs * up[0] * mask).sum() + (out.entropy * up[1] * mask).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach(), grads


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("backend", ["native", "interpret"])
def test_fused_forward_matches_verl(backend, layout):
    """log-probs, entropies and every parameter's gradient, in the engine's two layouts:
    ``padded`` (``[B, S]`` with the attention mask; the adapter's hidden states hold NaN /
    inf on the padded positions, which it skips: 0 there, no gradient) and ``packed``
    (``use_remove_padding``: ``[1, N]`` with the engine's rolled ``shift_labels``)."""
    if backend == "interpret":
        pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (len(LENGTHS), S), generator=g)
    mask = torch.arange(S) < torch.tensor(LENGTHS)[:, None]
    if layout == "padded":
        inputs = dict(input_ids=ids, attention_mask=mask.long(),
                      position_ids=torch.arange(S).expand(len(LENGTHS), S))
    else:
        flat = ids[mask][None]
        inputs = dict(input_ids=flat, position_ids=torch.cat(
            [torch.arange(n) for n in LENGTHS])[None], shift_labels=flat.roll(-1, -1))
        mask = torch.ones_like(flat, dtype=torch.bool)
    up = torch.randn(2, *mask.shape, generator=g)
    verl_model, ours = _twins()
    use_ratiokl_forward(ours, backend=backend, chunk_rows=5)
    want = _run(verl_model, inputs, up, mask)
    with torch.no_grad():
        hidden = ours.model(**{k: v for k, v in inputs.items() if k != "shift_labels"})[0]
        logits = hidden @ ours.lm_head.weight.T
    # the adapter's last hidden states hold NaN / inf on the padded positions
    bad = torch.tensor([float("nan"), float("inf"), float("-inf")])
    ours.model.norm.register_forward_hook(lambda module, args, out: torch.where(
        mask[..., None], out, bad[torch.arange(out.shape[1]) % 3, None]))
    got = _run(ours, inputs, up, mask)
    for what, a, e in (("log_probs", got[0], want[0]), ("entropy", got[1], want[1])):
        _, tol = tolerances(logits, e, temperature=0.8, both_float32=True)
        assert_close(torch.where(mask, a, 0.0), torch.where(mask, e, 0.0), tol, what)
    assert torch.all(got[0][~mask] == 0) and torch.all(got[1][~mask] == 0)
    for name, e in want[2].items():
        _, tol = tolerances(logits, e, temperature=0.8, both_float32=True)
        assert_close(got[2][name], e, tol, f"d/d {name}")


_SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)

#: Tiny models of each head family, built from a config (no download): ``(config class,
#: model class, config fields)``. Each family's own ``tie_word_embeddings`` default.
HEADS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "phi_bias": ("PhiConfig", "PhiForCausalLM", {}),  # lm_head = Linear(bias=True)
    "gemma2_softcap": ("Gemma2Config", "Gemma2ForCausalLM",
                       {"final_logit_softcapping": 1.5, "head_dim": 8}),
    "cohere_logit_scale": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0}),
    "granite_logits_scaling": ("GraniteConfig", "GraniteForCausalLM",
                               {"logits_scaling": 0.25}),
    "hyperclovax_logits_scaling": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM",
                                   {"logits_scaling": 3.0}),
    "falcon_h1_lm_head_multiplier": ("FalconH1Config", "FalconH1ForCausalLM", {
        "lm_head_multiplier": 3.0, "head_dim": 8, "mamba_d_ssm": 16, "mamba_n_heads": 2,
        "mamba_d_head": 8, "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 4}),
}
#: The heads whose logits are ``hidden @ lm_head.weight.T``, the only ones verl's own fused
#: forward computes.
PLAIN = ("llama", "qwen2")


def _head_model(name: str) -> torch.nn.Module:
    """``HEADS[name]`` with an lm_head large enough for its logits to reach past the soft
    cap (std 1: logits of a few units) and, where it has one, a bias that is not 0."""
    config_cls, model_cls, fields = HEADS[name]
    config_cls = getattr(transformers, config_cls, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {HEADS[name][0]}")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config_cls(**_SMALL, **fields))
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        model.lm_head.weight.normal_(std=1.0)
        if model.lm_head.bias is not None:
            model.lm_head.bias.normal_(std=1.0)
    return model


def _subclassed(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in a fresh subclass of its class (verl patches the class's forward)."""
    cls = type(model)
    model.__class__ = type(f"Tiny{cls.__name__}", (cls,), {"__module__": cls.__module__})
    return model


def _model_own(model, inputs, temperature):
    """The oracle: the model's own forward (its logits, bias and head transform included)
    in float64, then log-softmax of ``logits / temperature`` at the next token, and the
    entropy. Also the largest ``|logits / temperature|``."""
    out = model(**inputs, use_cache=False)
    z = out.logits / temperature
    logp = torch.log_softmax(z, -1)
    next_ids = inputs["input_ids"].roll(-1, -1)
    token = logp.gather(-1, next_ids[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return token, entropy, float(z.detach().abs().max())


@pytest.mark.parametrize("backend", ["native", "interpret"])
@pytest.mark.parametrize("name", list(HEADS))
def test_fused_forward_gives_the_models_own_logprobs(name, backend):
    """Through verl's fused-forward entry point (``patch_forward_with_backends`` with
    ``impl_backend="ratiokl"``), each head family's log-probs, entropies and every
    parameter's gradient are the model's own (its float64 forward, log-softmax, gather):
    the lm_head's bias (Phi), Gemma 2's soft cap, Cohere's ``logit_scale``, Granite's
    ``logits_scaling`` (HyperCLOVA X's, which multiplies), Falcon-H1's
    ``lm_head_multiplier``. verl's own fused forward
    (``impl_backend="torch"``) computes ``hidden @ lm_head.weight.T`` and so agrees with
    the model on the plain heads only; docs/trainers.md gives the differences."""
    if backend == "interpret":
        pytest.importorskip("triton")
    base = _head_model(name)
    oracle, verl_model = copy.deepcopy(base).double(), _subclassed(copy.deepcopy(base))
    ours = _subclassed(base)
    monkey_patch.patch_forward_with_backends(verl_model, use_fused_kernels=True,
                                             fused_kernels_backend="torch")
    monkey_patch.patch_forward_with_backends(ours, use_fused_kernels=True,
                                             fused_kernels_backend="ratiokl")
    ours._ratiokl_backend, ours._ratiokl_chunk_rows = backend, 5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (len(LENGTHS), S), generator=g)
    mask = torch.arange(S) < torch.tensor(LENGTHS)[:, None]
    inputs = dict(input_ids=ids, attention_mask=mask.long(),
                  position_ids=torch.arange(S).expand(len(LENGTHS), S))
    active = mask & mask.roll(-1, -1)  # the next token is a real one
    active[:, -1] = False
    up = torch.randn(2, *mask.shape, generator=g, dtype=torch.float64) * active
    want_logp, want_entropy, scale = _model_own(oracle, inputs, 0.8)
    ((want_logp * up[0]).sum() + (want_entropy * up[1]).sum()).backward()
    got = ours(**inputs, temperature=0.8, return_dict=True, use_cache=False)
    ((got.log_probs * up[0]).sum() + (got.entropy * up[1]).sum()).backward()
    for what, a, e in (("log_probs", got.log_probs, want_logp),
                       ("entropy", got.entropy, want_entropy)):
        tol = linear_forward_tolerance("float32", scale, V, entropy=what == "entropy")
        assert_close(a[active], e[active].detach(), two_paths(tol), what)
    for (label, p), (_, e) in zip(ours.named_parameters(), oracle.named_parameters()):
        tol = linear_grad_tolerance("float32", scale, float(e.grad.abs().max()))
        assert_close(p.grad, e.grad, two_paths(tol), f"d/d {label}")
    with torch.no_grad():
        theirs = verl_model(**inputs, temperature=0.8, return_dict=True, use_cache=False)
    want_logp = want_logp.detach()[active]
    off = float((theirs.log_probs.detach().double()[active] - want_logp).abs().max())
    tol = linear_forward_tolerance("float32", scale, V)
    assert (off <= tol.atol + tol.rtol * float(want_logp.abs().max())) == \
        (name in PLAIN), f"verl's fused log-probs are off the model's by {off:.3g}"


def test_an_instance_the_patch_never_saw_reads_its_own_head():
    """verl patches the class: another instance of it (a second model of the same family
    with another soft cap) gets the fused forward without ``use_ratiokl_forward`` having
    read its config; its log-probs are still its own model's."""
    first = _subclassed(_head_model("gemma2_softcap"))
    monkey_patch.patch_forward_with_backends(first, use_fused_kernels=True,
                                             fused_kernels_backend="ratiokl")
    config = copy.deepcopy(first.config)
    config.final_logit_softcapping = 0.5
    second = type(first)(config)
    second.load_state_dict(first.state_dict())
    oracle = copy.deepcopy(second).double()  # its class's forward is the patched one
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        own = transformers.Gemma2ForCausalLM.forward.__get__(oracle)
        want, _, scale = _model_own(own, dict(input_ids=ids), 0.8)
        got = second(input_ids=ids, temperature=0.8, return_dict=True, use_cache=False)
    tol = linear_forward_tolerance("float32", scale, V)
    assert_close(got.log_probs[:, :-1], want[:, :-1], two_paths(tol), "log_probs")


@pytest.mark.parametrize("field, value, model_type", [
    ("final_logit_softcapping", -1.0, None), ("logit_scale", float("nan"), None),
    ("logits_scaling", 0.0, None), ("lm_head_multiplier", -2.0, None),
    ("output_multiplier", 0.5, None), ("logit_scale", 0.5, "mpt")])
def test_refuses_a_head_transform_it_cannot_take(field, value, model_type):
    """A scale or soft cap that is no positive number, a field no transformers class
    applies, or one only the model's remote code applies (MPT's ``logit_scale``)."""
    model = _model()
    setattr(model.config, field, value)
    if model_type is not None:
        model.config.model_type = model_type
    with pytest.raises(ValueError, match=f"`model.config.{field}="):
        monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True,
                                                 fused_kernels_backend="ratiokl")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("gloo") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0,
                                         world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _engine(impl_backend: str):
    """verl's ``FSDPEngineWithLMHead`` on the CPU around a tiny Llama patched by
    ``apply_monkey_patch`` (what ``_build_module`` does with the model config's
    ``use_fused_kernels`` / ``fused_kernel_options.impl_backend``)."""
    model = _model()
    monkey_patch.apply_monkey_patch(model, ulysses_sp_size=1, use_remove_padding=False,
                                    use_fused_kernels=True, fused_kernels_backend=impl_backend)
    engine = transformer_impl.FSDPEngineWithLMHead.__new__(transformer_impl.FSDPEngineWithLMHead)
    engine.__dict__.update(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        optimizer_config=types.SimpleNamespace(clip_grad=1e6), _qat_enabled=False,
        scaler=None, engine_config=types.SimpleNamespace(entropy_checkpointing=False),
        ulysses_sequence_parallel_size=1, use_ulysses_sp=False, ulysses_device_mesh=None,
        pad_to_length=False, _autocast_dtype=torch.float32)
    return engine


def _rollout_batch(model):
    """A left-padded prompt + right-padded response batch as the actor receives it, in
    verl's no-padding layout; ``old_log_probs`` near the model's own."""
    g = torch.Generator().manual_seed(2)
    P, R, prompt, response = 3, 5, (3, 2, 1, 3), (5, 3, 1, 4)
    ids = torch.randint(0, V, (4, P + R), generator=g)
    attention = torch.zeros(4, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt, response)):
        attention[b, P - p:P + r] = 1
    response_mask = attention[:, P:].bool()
    position = (attention.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model.model(input_ids=ids, attention_mask=attention,
                             position_ids=position)[0] @ model.lm_head.weight.T
        logp = torch.log_softmax(logits[:, P - 1:-1] / 0.8, -1).gather(
            -1, ids[:, P:, None])[..., 0]
    noise = 0.5 * torch.randn(4, R, generator=g)
    data = TensorDict({
        "prompts": ids[:, :P], "responses": ids[:, P:], "input_ids": ids,
        "attention_mask": attention, "position_ids": position,
        "response_mask": response_mask, "old_log_probs": logp + noise,
        "ref_log_prob": logp - noise, "advantages": torch.randn(4, R, generator=g)},
        batch_size=[4])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, temperature=0.8, use_remove_padding=False,
                         use_dynamic_bsz=False, micro_batch_size_per_gpu=2,
                         use_fused_kernels=True, calculate_entropy=True, global_batch_size=4)
    return data


def _train_step(impl_backend: str, loss_mode: str, monkeypatch):
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    engine = _engine(impl_backend)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01,
                         use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
                         policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    out = engine.train_batch(_rollout_batch(engine.module),
                             lambda **kw: ppo_loss(config, **kw))
    grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
    return out["metrics"], grads, engine.module


def test_training_step_through_verls_engine_matches_verl(process_group, monkeypatch):
    want_metrics, want_grads, verl_model = _train_step("torch", "vanilla", monkeypatch)
    metrics, grads, model = _train_step("ratiokl", "ratiokl", monkeypatch)
    assert type(model).forward.__module__ == "ratiokl.adapters.verl._forward"
    assert type(verl_model).forward.__module__ != type(model).forward.__module__
    # Two float32 steps over _rollout_batch's 4 x 5 response tokens, verl's and ratiokl's.
    tol = two_paths(trainer_tolerance(4 * 5))
    assert_close(metrics["grad_norm"], want_metrics["grad_norm"], tol, "grad_norm")
    for key in ("actor/pg_loss", "kl_loss", "actor/entropy_loss", "actor/pg_clipfrac"):
        got, want = (torch.tensor(getattr(m[key], "values", m[key])).double()
                     for m in (metrics, want_metrics))
        assert got.numel() == 2  # one per micro-batch
        assert_close(got, want, tol, key)
    with torch.no_grad():
        scale = torch.stack([p.abs().max() for p in verl_model.parameters()]).max()
    for name, e in want_grads.items():
        _, tol = tolerances(scale.reshape(1), e, temperature=0.8, both_float32=True)
        assert_close(grads[name], e, tol, f"d/d {name}")
    start = _model().state_dict()
    for name, p in model.named_parameters():  # optimizer_step ran
        assert not torch.equal(p.detach(), start[name]) or not grads[name].any(), name
