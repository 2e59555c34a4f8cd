"""``ratiokl.adapters.openrlhf`` against OpenRLHF 0.11.2's own code on the same batch.

OpenRLHF is the oracle: its ``PolicyLoss`` against the drop-in (loss, the gradient of the
log-probs, the four logged values), its ``Actor.forward`` against the adapter's on a tiny
``transformers`` Llama built in code (log-probs, entropies, every parameter's gradient),
and one ``ActorPPOTrainer.training_step`` with OpenRLHF's own against one with
``install()`` (the loss and every parameter's gradient). OpenRLHF gets finite values
everywhere; the adapter gets NaN on the padded positions of the log-probs, old / rollout
log-probs and advantages (``tests/helpers/trainer_batch.py``), in the forward on the last
hidden states of the positions the attention mask excludes, and in the training step on
the padded old / rollout log-probs and advantages (the reference log-probs feed
OpenRLHF's own ``compute_approx_kl`` on both sides). Its CUDA-only packages are stubbed
as ``tests/helpers/openrlhf_stubs.py`` says. Runs in its own venv (``.ci/run`` block (d)).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (see .ci/run block (d))")
transformers = pytest.importorskip("transformers")

from assertions import assert_close, two_paths  # noqa: E402
from openrlhf_stubs import (build_trainer, import_openrlhf, packing_functions,  # noqa: E402
                            trainer_args)
from trainer_batch import B, T, make_batch, token_logps, tolerances  # noqa: E402

from ratiokl.spec.tolerances import (linear_forward_tolerance,  # noqa: E402
                                     linear_grad_tolerance)

try:
    ppo_actor = import_openrlhf()
except ImportError as error:  # a dependency that is neither installed nor stubbed
    pytest.skip(f"OpenRLHF is not importable: {error}", allow_module_level=True)

from openrlhf.models import Actor  # noqa: E402
from openrlhf.models import PolicyLoss as OpenRLHFPolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402

from ratiokl.adapters import openrlhf as adapter  # noqa: E402

BACKENDS = ["native", "interpret"]
DP = dict(dp_size=2, batch_num_tokens=31.0, global_batch_size=9.0)
LOCAL = dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
TOKEN = dict(is_correction_level="token")
LOSS_CASES = {
    "ppo_token": {},
    "ppo_dual_clip": dict(kw=dict(dual_clip=3.0)),
    "ppo_sequence": dict(kw=dict(token_level_loss=False)),
    "ppo_token_dp": dict(info=DP),
    "ppo_sequence_dp_dual_clip": dict(info=DP, kw=dict(token_level_loss=False, dual_clip=2.0)),
    "ppo_token_local_counts": dict(info=LOCAL),
    "ppo_sequence_local_counts": dict(info=LOCAL, kw=dict(token_level_loss=False)),
    "gspo": dict(seq_adv=True, kw=dict(policy_loss_type="gspo", clip_eps_low=0.1,
                                       clip_eps_high=0.15)),
    "gspo_dp": dict(seq_adv=True, info=DP, kw=dict(policy_loss_type="gspo")),
    "gspo_ratio_to_rollout": dict(seq_adv=True, kw=dict(policy_loss_type="gspo", **TOKEN)),
    # Per-token advantages of both signs in a sequence: OpenRLHF differentiates the
    # sequence ratio (every token of a sequence gets the same gradient).
    "gspo_per_token_advantages": dict(kw=dict(policy_loss_type="gspo", clip_eps_low=0.1,
                                              clip_eps_high=0.15)),
    "gspo_per_token_advantages_dual_clip_dp": dict(info=DP, kw=dict(
        policy_loss_type="gspo", dual_clip=1.5, clip_eps_low=0.05, clip_eps_high=0.05)),
    "gspo_per_token_advantages_ratio_to_rollout": dict(kw=dict(policy_loss_type="gspo",
                                                               **TOKEN)),
    "gspo_per_token_advantages_local_counts": dict(info=LOCAL, kw=dict(
        policy_loss_type="gspo")),
    "tis_token_clip": dict(kw=dict(is_correction_mode="clip",
                                   is_correction_threshold=[0.0, 2.0], **TOKEN)),
    "tis_token_clip_floor": dict(kw=dict(is_correction_mode="clip", **TOKEN)),  # (0.5, 5)
    "tis_token_clip_floor_sequence_dp": dict(info=DP, kw=dict(
        token_level_loss=False, is_correction_mode="clip", is_correction_threshold=[0.8, 2.0],
        **TOKEN)),
    "geomean_sequence_mask": dict(kw=dict(is_correction_level="seq",
                                          is_correction_threshold=[0.5, 2.0])),
    "geomean_sequence_mask_default_bounds_dual_clip": dict(kw=dict(
        is_correction_level="seq", dual_clip=3.0)),
    "geomean_sequence_mask_sequence_level": dict(kw=dict(
        is_correction_level="seq", token_level_loss=False, is_correction_threshold=[0.7, 1.5])),
    "icepop_token_mask": dict(kw=TOKEN),
    "icepop_sequence_dual_clip_dp": dict(info=DP, kw=dict(
        token_level_loss=False, dual_clip=3.0, is_correction_threshold=[0.5, 2.0], **TOKEN)),
    # The divergence gates (an upper bound only), each dropping some units and keeping some.
    "binary_kl_token_mask": dict(kw=dict(is_correction_gating="binary_kl",
                                         is_correction_threshold=[0.0, 0.01], **TOKEN)),
    "tv_token_mask_sequence_dp": dict(info=DP, kw=dict(
        token_level_loss=False, is_correction_gating="tv", is_correction_threshold=[0.0, 0.05],
        **TOKEN)),
    "binary_kl_sequence_gate": dict(kw=dict(is_correction_level="seq",
                                            is_correction_gating="binary_kl",
                                            is_correction_threshold=[0.0, 0.012])),
    "tv_sequence_gate_dual_clip_local_counts": dict(info=LOCAL, kw=dict(
        is_correction_level="seq", is_correction_gating="tv", dual_clip=3.0,
        is_correction_threshold=[0.0, 0.1])),
}


def _loss_inputs(batch, poisoned: bool, seq_adv: bool):
    """``(log_probs leaf, old, advantages, rollout)``: OpenRLHF's (``Actor.forward``'s
    log-probs, 0 where padded) or the adapter's (NaN where padded)."""
    source = batch.poisoned() if poisoned else batch
    logp = token_logps(batch.logits, batch.ids)
    logp = torch.where(batch.mask, logp, float("nan") if poisoned else 0.0)
    return (logp.requires_grad_(), source.old, source.adv_seq if seq_adv else source.adv,
            source.rollout)


def _run_loss(module, batch, case, poisoned):
    logp, old, adv, rollout = _loss_inputs(batch, poisoned, case.get("seq_adv", False))
    info = case.get("info") or dict(dp_size=1, batch_num_tokens=float(batch.mask.sum()),
                                    global_batch_size=float(batch.mask.any(-1).sum()))
    out = module(logp, old, adv, action_mask=batch.mask, rollout_log_probs=rollout, **info)
    out[0].backward()
    return out, logp.grad


@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_policy_loss_matches_openrlhf(name):
    """The drop-in's five outputs and ``d loss / d log_probs`` are OpenRLHF's ``PolicyLoss``'s
    (constructed from the same arguments), exactly 0 on the padded positions."""
    case, batch = LOSS_CASES[name], make_batch()
    want, want_grad = _run_loss(OpenRLHFPolicyLoss(**case.get("kw", {})), batch, case, False)
    got, grad = _run_loss(adapter.PolicyLoss(**case.get("kw", {})), batch, case, True)
    tol_value, tol_grad = tolerances(batch.logits, want_grad, both_float32=True)
    assert_close(got[0], want[0], tol_value, "loss")
    assert_close(grad, want_grad, tol_grad, "d loss / d log_probs")
    assert torch.all(grad[~batch.mask] == 0)
    for label, g, w in zip(("clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"), got[1:],
                           want[1:]):
        assert (g is None) == (w is None), label
        if w is not None:
            assert_close(g, w, tol_value, label)


@pytest.mark.parametrize("kw, field", [
    (dict(is_correction_level="seq", is_correction_mode="clip"), "is_correction_mode"),
    (dict(is_correction_level="token", is_correction_mode="clip",
          is_correction_gating="tv", is_correction_threshold=[0.0, 0.1]),
     "is_correction_mode"),
    (dict(dual_clip=1.0), "dual_clip"),
    # GSPO applies no correction weight, but OpenRLHF's constructor checks the gate first.
    (dict(policy_loss_type="gspo", is_correction_level="token",
          is_correction_gating="binary_kl"), "is_correction_gating"),
    (dict(policy_loss_type="gspo", is_correction_level="seq", is_correction_gating="tv",
          is_correction_threshold=[0.1, 0.5]), "is_correction_gating"),
    (dict(policy_loss_type="gspo", is_correction_level="seq", is_correction_mode="clip"),
     "is_correction_mode"),
    (dict(policy_loss_type="gspo", dual_clip=0.5), "dual_clip"),
])
def test_policy_loss_refuses_what_openrlhf_refuses(kw, field):
    """What OpenRLHF's own constructor refuses (a ``ValueError``, or an ``assert`` for the
    dual clip), the drop-in's refuses, naming the argument."""
    with pytest.raises((ValueError, AssertionError)):
        OpenRLHFPolicyLoss(**kw)
    with pytest.raises(ValueError, match=f"`{field}="):
        adapter.PolicyLoss(**kw)


@pytest.mark.parametrize("kw, missing", [
    (dict(), "old_log_probs"),
    (dict(policy_loss_type="gspo"), "old_log_probs"),
    (dict(policy_loss_type="gspo", is_correction_level="token"), "rollout_log_probs"),
    (dict(is_correction_level="token", is_correction_gating="tv",
          is_correction_threshold=[0.0, 0.1]), "rollout_log_probs"),
])
def test_policy_loss_refuses_a_missing_ratio_reference(kw, missing):
    """The log-probs OpenRLHF takes its ratio against, None: OpenRLHF's forward fails on
    them; the drop-in names them, rather than reading None as on-policy."""
    batch = make_batch()
    logp, old, adv, rollout = _loss_inputs(batch, False, False)
    inputs = {"old_log_probs": old, "rollout_log_probs": rollout, missing: None}
    with pytest.raises((TypeError, AttributeError, RuntimeError)):
        OpenRLHFPolicyLoss(**kw)(logp, advantages=adv, action_mask=batch.mask, **inputs)
    with pytest.raises(ValueError, match=f"needs `{missing}`"):
        adapter.PolicyLoss(**kw)(logp, advantages=adv, action_mask=batch.mask, **inputs)


@pytest.mark.parametrize("kw", [
    dict(policy_loss_type="gspo", is_correction_level="token", is_correction_gating="binary_kl",
         is_correction_threshold=[0.0, 0.01]),
    dict(policy_loss_type="gspo", is_correction_level="seq", is_correction_gating="tv",
         is_correction_threshold=[0.0, 0.2]),
])
def test_gspo_with_a_divergence_gate_openrlhf_accepts_matches(kw):
    """GSPO with a ``binary_kl`` / ``tv`` gate and a lower bound of 0: OpenRLHF builds it
    and applies no correction weight (only the ratio against the rollout log-probs); so
    does the drop-in (the refusals above stop at what OpenRLHF refuses)."""
    case, batch = dict(kw=kw, seq_adv=True), make_batch()
    want, want_grad = _run_loss(OpenRLHFPolicyLoss(**kw), batch, case, False)
    got, grad = _run_loss(adapter.PolicyLoss(**kw), batch, case, True)
    tol_value, tol_grad = tolerances(batch.logits, want_grad, both_float32=True)
    assert_close(got[0], want[0], tol_value, "loss")
    assert_close(grad, want_grad, tol_grad, "d loss / d log_probs")
    assert got[3:] == want[3:] == (None, None)


# --- Actor.forward on a tiny transformers model --------------------------------------

PROMPT = (3, 1, 2, 3, 2)  # prompt lengths, left-padded to P
P, VOCAB = 3, 29


def _model(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config).float()


def _sequences(batch):
    """``(sequences [B, P + T], attention_mask)``: left-padded prompts, the batch's
    right-padded completions (its uneven lengths, one empty)."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (B, P), generator=g)
    prompt_mask = torch.arange(P) >= P - torch.tensor(PROMPT)[:, None]
    completion = torch.randint(0, VOCAB, (B, T), generator=g)
    sequences = torch.cat([torch.where(prompt_mask, prompt, 0),
                           torch.where(batch.mask, completion, 0)], 1)
    return sequences, torch.cat([prompt_mask, batch.mask], 1).long()


def _actor_pair(temperature=0.8, dtype=torch.float32, packed=False):
    """Two ``Actor``s on equal copies of one tiny model: OpenRLHF's and the adapter's;
    ``packed``: with ``--ds.packing_samples``."""
    model = _model().to(dtype)
    # Actor.__init__ sets these only when it loads a checkpoint; without use_cache=False
    # transformers would not read the packed positions as separate sequences.
    model.config.use_cache = False
    actors = [Actor(copy.deepcopy(model), temperature=temperature) for _ in range(2)]
    for actor in actors:
        actor.packing_samples = packed
    return actors


def _poison_padded_hidden_states(actor, attention, packed=False):
    """NaN in the adapter's last hidden states wherever the attention mask is 0, or (packed:
    the padding is never run) on the packed tokens that predict no attended token, each
    sequence's last (a hook on the final norm): they must reach neither a value nor a
    gradient."""
    keep = attention.bool()
    if packed:
        predicts = torch.zeros_like(keep)
        predicts[:, :-1] = keep[:, 1:]
        keep = predicts[keep][None]
    actor.model.model.norm.register_forward_hook(
        lambda module, args, out: torch.where(keep[..., None], out, float("nan")))


def _logit_scale(actor, sequences, attention):
    with torch.no_grad():
        return float(actor.model(sequences, attention_mask=attention).logits.abs().max()) \
            / actor.temperature


def _assert_grads(got_model, want_model, scale, dtype="float32"):
    for (name, got), (_, want) in zip(got_model.named_parameters(),
                                      want_model.named_parameters()):
        magnitude = float(want.grad.abs().max())
        # OpenRLHF's head rounds its logits to the model's dtype, the adapter's keeps them
        # in float32: the two differ by that rounding (logits_dtype of the rounded side).
        tol = linear_grad_tolerance(dtype, scale, magnitude, logits_dtype=dtype)
        assert_close(got.grad, want.grad, two_paths(tol), name)


MODES = ["entropy", "action_only", "all_logprobs"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_actor_forward_matches_openrlhf(mode, backend, dtype):
    """Log-probs, entropies and every parameter's gradient (of a loss weighing both) of the
    adapter's forward are ``Actor.forward``'s (a bfloat16 model too: OpenRLHF's logits
    and the adapter's differ by their rounding to it: the adapter's are float32); 0 where
    inactive."""
    _forward_matches(mode, backend, dtype, packed=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_packed_actor_forward_matches_openrlhf(mode, backend):
    """``--ds.packing_samples``: the attended tokens of all rows in one row, each sequence's
    positions from 0, no attention mask; the log-probs and entropies unpacked to
    ``[B, S - 1]``. Values and every parameter's gradient are ``Actor.forward``'s with
    packing (whose own numbers are its padded forward's, which this checks too)."""
    _forward_matches(mode, backend, "float32", packed=True)


def _forward_matches(mode, backend, dtype, packed):
    if backend == "interpret":
        pytest.importorskip("triton")
    batch = make_batch()
    sequences, attention = _sequences(batch)
    theirs, ours = _actor_pair(dtype=getattr(torch, dtype), packed=packed)
    forward = adapter.actor_forward(backend)
    kwargs = dict(attention_mask=attention, return_output=True,
                  return_entropy=mode == "entropy")
    if mode == "all_logprobs":
        kwargs["return_logprobs"] = True
    mask = None if mode == "all_logprobs" else batch.mask
    with packing_functions():
        want, want_out = theirs(sequences, mask, **kwargs)
    _poison_padded_hidden_states(ours, attention, packed)
    got, got_out = forward(ours, sequences, mask, **kwargs)
    active = attention[:, :-1].bool() & attention[:, 1:].bool()
    rows = active if mask is None else batch.mask
    g = torch.Generator().manual_seed(3)
    w_logp = torch.randn(got.shape, generator=g) * rows
    scale = _logit_scale(theirs, sequences, attention)
    tol = linear_forward_tolerance(dtype, scale, VOCAB, logits_dtype=dtype)
    if packed:  # the packing keeps the sequences apart: OpenRLHF's padded numbers
        with torch.no_grad():
            padded = _actor_pair(dtype=getattr(torch, dtype))[0](sequences, mask, **kwargs)
        assert_close(want[rows].detach(), padded[0][rows], tol, "OpenRLHF packed / padded")
    assert_close(got[rows], want[rows].detach(), two_paths(tol), "log-probs")
    assert torch.all(got[~rows] == 0)
    objective = [(got * w_logp).sum(), (want * w_logp).sum()]
    if mode == "entropy":
        ent_tol = linear_forward_tolerance(dtype, scale, VOCAB, entropy=True,
                                           logits_dtype=dtype)
        assert_close(got_out.entropy[active], want_out.entropy[active].detach(),
                     two_paths(ent_tol), "entropy")
        assert torch.all(got_out.entropy[~active] == 0)
        w_ent = torch.randn(active.shape, generator=g) * active
        objective[0] = objective[0] + (got_out.entropy * w_ent).sum()
        objective[1] = objective[1] + (want_out.entropy * w_ent).sum()
    else:
        assert got_out.entropy is None
    objective[0].backward()
    objective[1].backward()
    _assert_grads(ours.model, theirs.model, scale, dtype)


def test_actor_forward_wanting_logits_runs_openrlhfs():
    """No ``action_mask`` and no ``return_logprobs``: the caller wants the logits, which
    OpenRLHF's own forward returns."""
    batch = make_batch()
    sequences, attention = _sequences(batch)
    theirs, ours = _actor_pair()
    want = theirs(sequences, attention_mask=attention, return_output=True)
    got = adapter.actor_forward("native")(ours, sequences, attention_mask=attention,
                                          return_output=True)
    assert torch.equal(got["logits"], want["logits"])


def test_actor_forward_refuses_ring_attention():
    """Ring attention splits the packed tokens over ranks: refused, naming the argument."""
    batch = make_batch()
    sequences, attention = _sequences(batch)
    _, ours = _actor_pair(packed=True)
    with pytest.raises(ValueError, match="`ds.ring_attn_size="):
        adapter.actor_forward("native")(ours, sequences, batch.mask, attention_mask=attention,
                                        ring_attn_group=object())


def test_actor_forward_refuses_a_head_it_would_compute_otherwise():
    batch = make_batch()
    sequences, attention = _sequences(batch)
    _, ours = _actor_pair()
    ours.model.config.output_multiplier = 0.5
    with pytest.raises(ValueError, match="`model.config.output_multiplier=0.5`"):
        adapter.actor_forward("native")(ours, sequences, batch.mask, attention_mask=attention)


_SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def _with_head_bias(model):
    """A Llama whose lm_head has a bias (its forward calls ``self.lm_head``)."""
    head = torch.nn.Linear(16, VOCAB, bias=True)
    torch.nn.init.normal_(head.bias, std=1.0)
    model.lm_head = head
    return model


#: Tiny models built in code whose logits are not ``hidden @ W.T``: the model's own forward
#: (OpenRLHF's) is the oracle for the adapter's options.
HEADS = {
    "gemma2_softcap": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_SMALL, head_dim=8, final_logit_softcapping=1.5)),
    "cohere_logit_scale": lambda: transformers.CohereForCausalLM(transformers.CohereConfig(
        **_SMALL, logit_scale=4.0)),
    "granite_logits_scaling": lambda: transformers.GraniteForCausalLM(
        transformers.GraniteConfig(**_SMALL, logits_scaling=0.25)),
    # HyperCLOVA X multiplies by its logits_scaling, where Granite divides
    "hyperclovax_logits_scaling": lambda: transformers.HyperCLOVAXForCausalLM(
        transformers.HyperCLOVAXConfig(**_SMALL, logits_scaling=3.0)),
    "llama_head_bias": lambda: _with_head_bias(transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**_SMALL))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(HEADS))
def test_actor_forward_reads_the_models_head(name, backend):
    """A soft cap, a logit scale or a head bias: log-probs, entropies and every parameter's
    gradient are ``Actor.forward``'s on the model's own logits."""
    if backend == "interpret":
        pytest.importorskip("triton")
    torch.manual_seed(0)
    model = HEADS[name]().float()
    model.config._attn_implementation = "eager"
    theirs, ours = (Actor(copy.deepcopy(model), temperature=0.7) for _ in range(2))
    theirs.packing_samples = ours.packing_samples = False
    batch = make_batch()
    sequences, attention = _sequences(batch)
    kwargs = dict(attention_mask=attention, return_output=True, return_entropy=True)
    want, want_out = theirs(sequences, batch.mask, **kwargs)
    got, got_out = adapter.actor_forward(backend)(ours, sequences, batch.mask, **kwargs)
    active = attention[:, :-1].bool() & attention[:, 1:].bool()
    scale = _logit_scale(theirs, sequences, attention)
    for label, g, w, rows in (("log-probs", got, want, batch.mask),
                              ("entropy", got_out.entropy, want_out.entropy, active)):
        tol = linear_forward_tolerance("float32", scale, VOCAB, entropy=label == "entropy")
        assert_close(g[rows], w[rows].detach(), two_paths(tol), label)
    g = torch.Generator().manual_seed(3)
    w_logp, w_ent = torch.randn(got.shape, generator=g), torch.randn(active.shape, generator=g)
    ((got * w_logp).sum() + (got_out.entropy * w_ent * active).sum()).backward()
    ((want * w_logp).sum() + (want_out.entropy * w_ent * active).sum()).backward()
    _assert_grads(ours.model, theirs.model, scale)


def _zero3_forward_matches(backend: str) -> None:
    """In a child process (DeepSpeed initialises ``torch.distributed``, gloo, one rank):
    OpenRLHF's ``Actor.forward`` and the adapter's, each ``Actor`` in a ZeRO-3 DeepSpeed
    engine (the lm_head weight partitioned), on a loss weighing the log-probs and the
    entropies: values and every parameter's full gradient (``safe_get_full_grad``)."""
    import os
    import socket
    from unittest import mock

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    # Every parameter partitioned and released after each use (none kept resident as
    # small, none prefetched): the lm_head weight exists only inside the head's own call.
    config = {"train_micro_batch_size_per_gpu": B,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 0,
                                    "stage3_max_live_parameters": 0,
                                    "stage3_max_reuse_distance": 0},
              "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    batch = make_batch()
    sequences, attention = _sequences(batch)
    active = attention[:, :-1].bool() & attention[:, 1:].bool()
    scale = _logit_scale(_actor_pair()[0], sequences, attention)
    g = torch.Generator().manual_seed(3)
    w_logp, w_ent = torch.randn(B, T, generator=g), torch.randn(active.shape, generator=g)
    results = []
    for forward in (Actor.forward, adapter.actor_forward(backend)):
        actor = _actor_pair()[0]
        engine, *_ = deepspeed.initialize(model=actor, model_parameters=actor.parameters(),
                                          config=config)
        assert actor.model.lm_head.weight.numel() == 0  # partitioned outside its forward
        with mock.patch.object(Actor, "forward", forward):
            logp, out = engine(sequences, batch.mask, attention_mask=attention,
                               return_output=True, return_entropy=True)
            engine.backward((logp * w_logp).sum() + (out.entropy * w_ent * active).sum())
        results.append((logp.detach(), out.entropy.detach(),
                        {n: safe_get_full_grad(p) for n, p in actor.named_parameters()}))
    (want, want_ent, want_grads), (got, got_ent, grads) = results
    tol = two_paths(linear_forward_tolerance("float32", scale, VOCAB, entropy=True))
    assert_close(got[batch.mask], want[batch.mask], tol, "log-probs")
    assert_close(got_ent[active], want_ent[active], tol, "entropy")
    for name, want_grad in want_grads.items():
        grad_tol = linear_grad_tolerance("float32", scale, float(want_grad.abs().max()))
        assert_close(grads[name], want_grad, two_paths(grad_tol), name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_actor_forward_under_deepspeed_zero3_matches_openrlhf(backend):
    """ZeRO-3 partitions the lm_head weight; the adapter runs its GEMMs inside the head
    module's call, where DeepSpeed gathers it (for the forward and the backward)."""
    pytest.importorskip("deepspeed")
    if backend == "interpret":
        pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parent / "helpers"),
                            str(here.parents[1] / "src"), os.environ.get("PYTHONPATH", "")])
    code = ("import test_openrlhf_adapter as t; "
            f"t._zero3_forward_matches({backend!r}); print('ZERO3 OK')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path}, timeout=600)
    assert proc.returncode == 0 and "ZERO3 OK" in proc.stdout, \
        (proc.stdout + proc.stderr)[-4000:]


# --- one training step of OpenRLHF's ActorPPOTrainer, with install() ------------------

STEP_CASES = {
    "ppo_token_dual_clip_kl_k3_entropy": dict(
        actor=dict(dual_clip=3.0, entropy_coef=0.01),
        kl=dict(use_loss=True, init_coef=0.1, estimator="k3")),
    "ppo_sequence_icepop_kl_k2": dict(
        actor=dict(loss_agg_mode="seq-mean-token-mean"),
        advantage=dict(is_correction_level="token", is_correction_threshold=[0.5, 2.0]),
        kl=dict(use_loss=True, init_coef=0.05, estimator="k2")),
    # OpenRLHF's own KL code (the clamp at 10, the unbiased gradient, token-mean whatever
    # the policy loss's level) on the adapter's log-probs; the unbiased gradient reads the
    # old log-probs too, so they stay finite.
    "ppo_sequence_kl_k3_unbiased_entropy": dict(finite_old=True,
        actor=dict(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.02),
        kl=dict(use_loss=True, init_coef=0.2, estimator="k3", unbiased_gradient=True)),
    "tis_token_clip_floor": dict(advantage=dict(is_correction_level="token",
                                                is_correction_mode="clip")),  # (0.5, 5)
    "binary_kl_sequence_gate": dict(advantage=dict(
        is_correction_level="seq", is_correction_gating="binary_kl",
        is_correction_threshold=[0.0, 0.012])),
    "geomean_sequence_mask": dict(advantage=dict(is_correction_level="seq",
                                                 is_correction_threshold=[0.6, 1.6])),
    "gspo": dict(seq_adv=True, actor=dict(policy_loss_type="gspo", entropy_coef=-0.01)),
    "gspo_per_token_advantages_kl_k3": dict(
        actor=dict(policy_loss_type="gspo"), kl=dict(use_loss=True, init_coef=0.1,
                                                     estimator="k3")),
    # --ds.packing_samples: the forward packs; the loss gets the unpacked [B, T] tensors.
    "packed_ppo_sequence_icepop_kl_k3_entropy": dict(
        packed=True, actor=dict(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01),
        advantage=dict(is_correction_level="token", is_correction_threshold=[0.5, 2.0]),
        kl=dict(use_loss=True, init_coef=0.1, estimator="k3")),
}


def _experience(actor, batch, seq_adv: bool, poisoned: bool, finite_old: bool):
    """The batch's offsets (old, reference and rollout log-probs, advantages) around the
    tiny model's own log-probs; the adapter's copy NaN where padded, but for the reference
    log-probs (OpenRLHF's ``compute_approx_kl`` reads them on both sides) and, with
    ``finite_old``, the old ones."""
    sequences, attention = _sequences(batch)
    with torch.no_grad():
        logp = actor(sequences, batch.mask, attention_mask=attention)
    base = token_logps(batch.logits, batch.ids)
    source = batch.poisoned() if poisoned else batch
    pad = {"old": 0.0 if finite_old or not poisoned else float("nan"),
           "rollout": float("nan") if poisoned else 0.0}
    shifted = {k: torch.where(batch.mask, logp + getattr(source, k) - base, pad[k])
               for k in ("old", "rollout")}
    ref = torch.where(batch.mask, logp + batch.ref - base, 0.0)
    adv = source.adv_seq if seq_adv else source.adv
    return Experience(sequences=sequences, attention_mask=attention, action_mask=batch.mask,
                      action_log_probs=shifted["old"], base_action_log_probs=ref,
                      rollout_log_probs=shifted["rollout"], advantages=adv, info={})


def _step(actor, case, batch, poisoned: bool):
    args = trainer_args(case.get("actor"), case.get("advantage"), case.get("kl"))
    args.ds.packing_samples = actor.packing_samples
    trainer, strategy = build_trainer(ppo_actor, args, actor, B)
    experience = _experience(actor, batch, case.get("seq_adv", False), poisoned,
                             case.get("finite_old", False))
    trainer.training_step(experience, args.algo.kl.init_coef, 0)
    return trainer, strategy.loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_training_step_with_install_matches_openrlhf(name, backend):
    """``install()``: ``ActorPPOTrainer`` builds the drop-in and its ``training_step`` runs
    the adapter's forward; the loss and every parameter's gradient are OpenRLHF's own
    step's. ``restore()`` puts OpenRLHF's back."""
    if backend == "interpret":
        pytest.importorskip("triton")
    case, batch = STEP_CASES[name], make_batch()
    theirs, ours = _actor_pair(temperature=0.9, packed=case.get("packed", False))
    own_forward, own_loss = Actor.forward, ppo_actor.PolicyLoss
    with packing_functions():
        _, want = _step(theirs, case, batch, poisoned=False)
    restore = adapter.install(backend)
    try:
        assert Actor.forward.ratiokl_original is own_forward
        trainer, got = _step(ours, case, batch, poisoned=True)
    finally:
        restore()
    assert isinstance(trainer.actor_loss_fn, adapter.PolicyLoss)
    assert (Actor.forward, ppo_actor.PolicyLoss) == (own_forward, own_loss)
    sequences, attention = _sequences(batch)
    scale = _logit_scale(theirs, sequences, attention)
    assert_close(got, want, linear_forward_tolerance("float32", scale, VOCAB), "loss")
    _assert_grads(ours.model, theirs.model, scale)


def test_training_step_refuses_the_moe_router_loss():
    """``aux_loss_coef > 0`` makes the step read ``output.aux_loss``, which the adapter's
    forward does not compute: a ``ValueError`` naming the argument, not a silent 0."""
    _, ours = _actor_pair()
    restore = adapter.install("native")
    try:
        with pytest.raises(ValueError, match="`aux_loss_coef="):
            _step(ours, dict(actor=dict(aux_loss_coef=0.01)), make_batch(), poisoned=True)
    finally:
        restore()


def test_launcher_installs_in_every_ray_worker(monkeypatch):
    """``python -m ratiokl.adapters.openrlhf ARGS`` starts Ray with a setup hook that Ray's
    own loader resolves to :func:`install`, then runs OpenRLHF's CLI module with ARGS."""
    ray = pytest.importorskip("ray")
    from ray._private.runtime_env import setup_hook  # how Ray's workers load the hook

    from ratiokl.adapters.openrlhf import __main__ as launcher

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(init=kw))
    monkeypatch.setattr(launcher.runpy, "run_module",
                        lambda name, **kw: seen.update(module=name, argv=list(launcher.sys.argv),
                                                       **kw))
    monkeypatch.setattr(launcher.sys, "argv", list(launcher.sys.argv))
    launcher.main(["--actor.pretrain", "x"])
    hook = seen["init"]["runtime_env"]["worker_process_setup_hook"]
    assert setup_hook.load_class(hook) is adapter.install
    assert seen["init"]["runtime_env"]["env_vars"]["NCCL_DEBUG"]
    assert (seen["module"], seen["run_name"]) == ("openrlhf.cli.train_ppo_ray", "__main__")
    assert seen["argv"][1:] == ["--actor.pretrain", "x"]


def test_the_readmes_openrlhf_block_runs_here():
    """The README's OpenRLHF block, as printed, in OpenRLHF's environment: afterwards
    ``Actor`` runs the adapter's forward and the trainer builds the drop-in."""
    from readme_blocks import block_importing

    block = block_importing("ratiokl.adapters.openrlhf")
    own = Actor.forward, ppo_actor.PolicyLoss
    try:
        exec(compile(block.code, f"README.md:{block.line}", "exec"), {})
        assert Actor.forward.ratiokl_original is own[0]
        assert ppo_actor.PolicyLoss is adapter.PolicyLoss
    finally:
        Actor.forward, ppo_actor.PolicyLoss = own
