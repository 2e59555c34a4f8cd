"""The policy-loss test cases both frameworks' tests run (``tests/torch/test_policy_loss.py``
and ``tests/jax/test_policy_loss.py``): option sets, packed-row options and the inputs,
whose inactive rows hold NaN logits, NaN old log-probs / advantages / weights and
out-of-range ids."""

from __future__ import annotations

import numpy as np

from ratiokl import spec

B, T, V = 3, 7, 19
#: The loss and metrics sum up to B*T float32 per-token terms.
LOSS_TOL = spec.reduction_tolerance(B * T)

#: name -> policy_loss options; each pins one behaviour down.
OPTIONS = {
    "ppo_default": {},
    "clip_higher": {"clip_eps_high": 0.28},
    "dual_clip": {"dual_clip": 1.3},
    "ratio_cap": {"ratio_cap": 1.2, "clip_eps": 0.1},
    "kl_k1": {"kl_coef": 0.3, "kl_estimator": "k1"},
    "kl_k2": {"kl_coef": 0.3, "kl_estimator": "k2"},
    "kl_k3": {"kl_coef": 0.3, "kl_estimator": "k3"},
    "kl_k1_straight_through": {"kl_coef": 0.3, "kl_estimator": "k1+"},
    "kl_k3_straight_through": {"kl_coef": 0.3, "kl_estimator": "k3+"},
    "kl_k3_ratio_weighted": {"kl_coef": 0.3, "kl_estimator": "k3-is"},
    "agg_token_sum": {"loss_agg": "token-sum"},
    "agg_seq_mean_token_mean": {"loss_agg": "seq-mean-token-mean"},
    "agg_seq_mean_token_sum": {"loss_agg": "seq-mean-token-sum"},
    "agg_seq_mean_token_sum_norm": {"loss_agg": "seq-mean-token-sum-norm"},
    "global_normalizer": {"loss_normalizer": 37.0},
    "gspo": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean"},
    "gspo_token_mean_kl": {"ratio_level": "sequence", "kl_coef": 0.2, "kl_estimator": "k3-is"},
    "log_ratio_bound_active": {"log_ratio_bound": 0.3, "kl_coef": 0.5},
    "no_log_ratio_bound": {"log_ratio_bound": None, "dual_clip": 3.0},
    "temperature": {"temperature": 0.7, "kl_coef": 0.1},
    "entropy_bonus": {"entropy_coef": 0.2, "kl_coef": 0.1},
    "entropy_penalty_seq_mean_token_mean": {"entropy_coef": -0.1,
                                            "loss_agg": "seq-mean-token-mean"},
    "entropy_gspo": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-mean",
                     "entropy_coef": 0.2},
    "entropy_cispo_temperature": {"objective": "cispo", "entropy_coef": 0.2, "temperature": 0.7},
    "agg_none": {"loss_agg": "none", "kl_coef": 0.2, "entropy_coef": 0.1, "dual_clip": 2.0},
    "gspo_none": {"ratio_level": "sequence", "loss_agg": "none", "entropy_coef": 0.1},
}
#: Options that read packed-row segments.
PACKED = {
    "packed_seq_mean_token_mean": {"loss_agg": "seq-mean-token-mean"},
    "packed_gspo": {"ratio_level": "sequence", "loss_agg": "seq-mean-token-sum"},
    "packed_gspo_none": {"ratio_level": "sequence", "loss_agg": "none", "kl_coef": 0.1},
}


def per_token_upstream(mask: np.ndarray) -> np.ndarray:
    """A non-unit upstream gradient of a ``loss_agg="none"`` loss: float32 ``[...]``, a
    different value per active token and NaN on inactive ones (which must stay out)."""
    g = np.linspace(-1.5, 2.0, num=mask.size).reshape(mask.shape)
    return np.where(mask, g, np.nan).astype(np.float32)


def make_inputs(seed=0, active=0.75, per_token_adv=False, lead=(B, T)):
    """NumPy inputs; inactive rows hold NaN logits/old/advantages/weights and bad ids."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (*lead, V))
    mask = rng.random(lead) < active
    ids = rng.integers(0, V, lead)
    logp = spec.selected_logprobs(logits, ids, mask)
    old = np.where(mask, logp + rng.normal(0.0, 0.5, lead), np.nan)
    adv = rng.normal(0.0, 1.0, lead if per_token_adv else lead[:-1])
    if per_token_adv:
        adv = np.where(mask, adv, np.nan)
    x = {
        "policy_logits": np.where(mask[..., None], logits, np.nan),
        "ref_logits": logits + rng.normal(0.0, 0.5, logits.shape),
        "action_ids": np.where(mask, ids, np.where(rng.random(lead) < 0.5, -1, V + 3)),
        "mask": mask,
        "old_logps": old,
        "advantages": adv,
        "importance_weights": np.where(mask, rng.uniform(0.5, 1.5, lead), np.nan),
        "segment_ids": np.sort(rng.integers(0, 3, lead), axis=-1),
    }
    return {k: np.asarray(v, np.float32) if v.dtype.kind == "f" else v for k, v in x.items()}
