"""The shared numeric spec: float64 reference, option tables, tolerances.

Imports only NumPy. Every backend of both frameworks is tested against it.
"""

from ratiokl.spec.options import (
    BACKENDS,
    BackendName,
    Coefficient,
    KLEstimator,
    LossAgg,
    PolicyKLEstimator,
    RatioLevel,
    DEFAULT_LOG_RATIO_BOUND,
    KL_ESTIMATORS,
    LOSS_AGGS,
    POLICY_KL_ESTIMATORS,
    RATIO_LEVELS,
    PolicyLossOptions,
    kl_estimator_code,
    option_code,
    policy_loss_options,
)
from ratiokl.spec.policy_loss import (
    POLICY_LOSS_DEFAULTS,
    policy_loss,
    policy_loss_from_logps,
    policy_loss_grad,
    sequence_index,
)
from ratiokl.spec.reference import (
    check_action_ids,
    check_temperatures,
    kl_dlogp,
    kl_value,
    ratio_kl,
    ratio_kl_grad,
    selected_logprobs,
    selected_logprobs_grad,
)
from ratiokl.spec.tolerances import GRAD_ROUNDOFF, Tolerance, forward_tolerance, grad_tolerance

__all__ = [
    "BACKENDS",
    "BackendName",
    "Coefficient",
    "KLEstimator",
    "LossAgg",
    "PolicyKLEstimator",
    "RatioLevel",
    "DEFAULT_LOG_RATIO_BOUND",
    "LOSS_AGGS",
    "POLICY_LOSS_DEFAULTS",
    "POLICY_KL_ESTIMATORS",
    "PolicyLossOptions",
    "RATIO_LEVELS",
    "policy_loss",
    "policy_loss_from_logps",
    "policy_loss_grad",
    "policy_loss_options",
    "sequence_index",
    "GRAD_ROUNDOFF",
    "KL_ESTIMATORS",
    "Tolerance",
    "check_action_ids",
    "check_temperatures",
    "forward_tolerance",
    "grad_tolerance",
    "kl_dlogp",
    "kl_estimator_code",
    "kl_value",
    "option_code",
    "ratio_kl",
    "ratio_kl_grad",
    "selected_logprobs",
    "selected_logprobs_grad",
]
