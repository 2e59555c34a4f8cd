"""The rollout-correction test cases both frameworks' tests run (``tests/torch/test_rollout.py``
and ``tests/jax/test_rollout.py``): option sets and inputs whose inactive rows hold NaN
logits / old / rollout log-probs / weights and bad ids."""

from __future__ import annotations

import numpy as np

from ratiokl import spec

B, T, V = 3, 8, 17
#: The float32 loss and metrics (sums of B*T per-token terms) against the float64 spec.
LOSS_TOL = spec.reduction_tolerance(B * T)
#: ``max |logits|``: normal(0, 2) draws of B*T*V entries stay below it.
LOGIT_SCALE = 10.0


def grad_tolerance(expected: np.ndarray) -> spec.Tolerance:
    """The float32 policy-logit gradient's tolerance against the spec's ``expected``."""
    return spec.grad_tolerance("float32", LOGIT_SCALE, float(np.abs(expected).max()))

#: name -> options; the rollout correction on top of the loss's other options.
CASES = {
    "token_truncate": dict(rollout_correction="token-truncate", kl_coef=0.2),
    "token_mask_icepop": dict(rollout_correction="token-mask", rollout_bounds=(0.5, 5.0)),
    "sequence_truncate": dict(rollout_correction="sequence-truncate", rollout_bounds=(0.0, 1.5),
                              loss_agg="seq-mean-token-mean"),
    "sequence_mask": dict(rollout_correction="sequence-mask", rollout_bounds=(0.4, 2.5),
                          kl_coef=0.1, kl_estimator="k3-is"),
    "sequence_mask_packed": dict(rollout_correction="sequence-mask", rollout_bounds=(0.5, 1.8),
                                 loss_agg="seq-mean-token-sum", packed=True),
    "sequence_truncate_packed_iw": dict(rollout_correction="sequence-truncate", packed=True,
                                        importance=True, rollout_bounds=(0.0, 1.2)),
    "token_truncate_iw_bound": dict(rollout_correction="token-truncate", importance=True,
                                    log_ratio_bound=0.5, rollout_bounds=(0.0, 1.4)),
    "metrics_only": dict(kl_coef=0.1),
    "gspo_token_mask": dict(rollout_correction="token-mask", rollout_bounds=(0.6, 1.7),
                            ratio_level="sequence", loss_agg="seq-mean-token-mean"),
    "cispo_sequence_truncate": dict(rollout_correction="sequence-truncate", objective="cispo"),
}


def make_inputs(seed=0, active=0.75, lead=(B, T)):
    """NumPy inputs; inactive rows hold NaN logits / old / rollout / weights and bad ids."""
    rng = np.random.default_rng(seed)
    mask = rng.random(lead) < active
    logits = rng.normal(0.0, 2.0, (*lead, V))
    ids = rng.integers(0, V, lead)
    old = spec.selected_logprobs(logits, ids, mask) + rng.normal(0.0, 0.4, lead)
    x = {
        "policy_logits": logits, "ref_logits": logits + rng.normal(0.0, 0.5, logits.shape),
        "action_ids": np.where(mask, ids, -3), "mask": mask, "old_logps": old,
        "advantages": rng.normal(size=lead[:-1]),
        "rollout_logps": old + rng.normal(0.0, 0.5, lead),
        "importance_weights": rng.uniform(0.5, 1.5, lead),
        "segment_ids": np.sort(rng.integers(0, 3, lead), axis=-1),
    }
    for key in ("old_logps", "rollout_logps", "importance_weights"):
        x[key] = np.where(mask, x[key], np.nan)
    x["policy_logits"][~mask] = np.nan
    return x
