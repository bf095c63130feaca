"""KL penalty to a reference policy, per token.

With ``d = ref - logp`` (clamped to ``[-c, c]`` before ``exp``; TRL's unclamped k3
overflows, TRL #3015):

| estimator | value                 | notes |
| --------- | --------------------- | ----- |
| ``k1``    | ``logp - ref = -d``   | unbiased for KL(π_θ‖π_ref), high variance, can be negative |
| ``k2``    | ``½·d²``              | biased, low variance |
| ``k3``    | ``e^d - d - 1``       | unbiased, always >= 0 (Schulman 2020); GRPO's choice |

With ``importance_corrected=True`` the estimate is multiplied by the token ratio
``r = π_θ/π_old`` (with gradient), which makes it an unbiased estimate of
KL(π_θ‖π_ref) on samples drawn from π_old (DeepSeek-V3.2).

References:
    Schulman, "Approximating KL divergence" (2020); Shao et al., arXiv:2402.03300.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from softtrust._validation import check_choice, check_number
from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP, clamped_log_ratio

KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass(frozen=True)
class KL:
    """A KL term ``coef · k(logp, ref)`` added to every token's loss before aggregation.

    Args:
        coef: β >= 0.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        importance_corrected: multiply by the token ratio r (with gradient).
    """

    coef: float
    estimator: str = "k3"
    importance_corrected: bool = False

    def __post_init__(self) -> None:
        check_number("coef", self.coef, low=0.0)
        check_choice("estimator", self.estimator, KL_ESTIMATORS)


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """Per-token KL estimate, [B, T] -> [B, T] (see the module docstring)."""
    check_choice("estimator", estimator, KL_ESTIMATORS)
    log_ratio = -clamped_log_ratio(
        logprobs, ref_logprobs, clamp
    )  # [B, T]; d = ref - logp (NaN for a bad ref)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(log_ratio) - log_ratio  # e^d - 1 - d, with expm1 accurate near d = 0
