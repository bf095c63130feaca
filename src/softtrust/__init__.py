"""softtrust: trust-region and importance-weighting policy losses for off-policy RL of LLMs.

The public API, re-exported names only. See DESIGN.md / docs/ for the architecture.
"""

from softtrust import methods
from softtrust.advantages import (
    ADVANTAGE_SCALES,
    group_advantages,
    passk_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from softtrust.aggregation import AGGREGATIONS, aggregate, aggregation_weights
from softtrust.compiling import compile_loss
from softtrust.corrections import MIS, OPSM, TIS, Reject
from softtrust.kl import KL, KL_ESTIMATORS, AdaptiveKLController, kl_estimate
from softtrust.logprobs import completion_logprobs, token_logprobs
from softtrust.loss import LossOutput, PolicyLoss
from softtrust.methods import *  # noqa: F403  (softtrust.methods.__all__: the methods and their interface)
from softtrust.ratios import LEVELS
from softtrust.truncation import sample_truncated, truncated_log_softmax, truncation_mask

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_SCALES",
    "AGGREGATIONS",
    "KL",
    "KL_ESTIMATORS",
    "LEVELS",
    "MIS",
    "OPSM",
    "TIS",
    "AdaptiveKLController",
    "LossOutput",
    "PolicyLoss",
    "Reject",
    "aggregate",
    "aggregation_weights",
    "compile_loss",
    "completion_logprobs",
    "group_advantages",
    "kl_estimate",
    "passk_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sample_truncated",
    "token_logprobs",
    "truncated_log_softmax",
    "truncation_mask",
    *methods.__all__,
]
