"""Check targets for trainers' own loss code: ``ratiokl check --target
ratiokl.harness.targets.<trainer>:TARGET``.

Each module imports its trainer only when a case runs (``ratiokl[verl]``,
``ratiokl[openrlhf]``, ``ratiokl[trl]``), maps the fixture's options onto the trainer's own
configuration in one small table, and refuses by name what the trainer cannot express.
Every target computes the per-token log-probs (and entropies) from the case's logits in
float32 with the trainer's own helpers, runs the trainer's loss, and differentiates it
with ``torch.autograd``. What the trainer computes differently (NaN in padded positions
reaching the loss, a clamp, another denominator) is a reported disagreement, case by case.

* :mod:`~ratiokl.harness.targets.verl`: verl 0.9.1 ``core_algos`` (``get_policy_loss_fn``,
  ``agg_loss``, ``kl_penalty``) composed as ``workers/utils/losses.ppo_loss`` composes them.
* :mod:`~ratiokl.harness.targets.openrlhf`: OpenRLHF 0.11.2 ``PolicyLoss`` and
  ``compute_approx_kl``.
* :mod:`~ratiokl.harness.targets.trl`: TRL 1.16 ``GRPOTrainer``'s per-token loss.
"""
