"""KL penalty to a reference policy, per token, and the adaptive coefficient that targets a KL.

With ``d = ref - logp`` (clamped to ``[-c, c]`` before ``exp``; TRL's unclamped k3
overflows, TRL #3015):

| estimator | value                 | gradient (w.r.t. ``logp``) | notes |
| --------- | --------------------- | -------------------------- | ----- |
| ``k1``    | ``logp - ref = -d``   | 1                          | unbiased for KL(π_θ‖π_ref), high variance, can be negative |
| ``k2``    | ``½·d²``              | ``-d``                     | biased value, low variance |
| ``k3``    | ``e^d - d - 1``       | ``1 - e^d``                | unbiased, always >= 0 (Schulman 2020); GRPO's choice |
| ``abs``   | ``|d|``               | ``-sign(d)``               | verl's ``abs`` |
| ``k1+``   | k1's                  | k2's, ``-d``               | straight-through (verl ``k1+``) |
| ``k3+``   | k3's                  | k2's, ``-d``               | straight-through (verl ``k3+``, ``low_var_kl+``) |

The expected gradient of ``k1`` and ``k3`` is not the gradient of the KL: on samples from π_θ,
``∇KL(π_θ‖π_ref) = E[(logp - ref)·∇logp] = E[∇k2]``. The ``+`` estimators keep the named
estimator's value (what is reported and what an adaptive controller reads) and take k2's
gradient: ``k2 - sg(k2) + sg(k)``, so the value is exactly ``k``.

With ``importance_corrected=True`` the estimate is multiplied by the token ratio
``r = π_θ/π_old``, which makes its value an unbiased estimate of KL(π_θ‖π_ref) on samples
drawn from π_old (DeepSeek-V3.2). For ``k1``, ``k2``, ``k3``, ``abs`` the ratio carries its
gradient (for k3 the product's gradient is exactly ``r·(logp - ref)·∇logp``, the
importance-weighted KL gradient). For the ``+`` estimators it is a detached weight:
value ``r·k``, gradient ``sg(r)·(logp - ref)·∇logp``, that same importance-weighted gradient
(so ``k3+`` and ``k3`` agree in value and gradient when corrected; ``k1+`` drops k1's
``r·∇logp`` term, zero in expectation).

:class:`AdaptiveKLController` moves the coefficient β towards a target KL (Ziegler et al.).

References:
    Schulman, "Approximating KL divergence" (2020); Shao et al., arXiv:2402.03300;
    Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from softtrust._validation import check_choice, check_number, check_scale
from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP, clamped_log_ratio

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+")


@dataclass(frozen=True)
class KL:
    """A KL term ``coef · k(logp, ref)`` added to every token's loss before aggregation.

    Args:
        coef: β in [0, 1e12] (a larger factor overflows float32; ``_validation.check_scale``).
        estimator: one of :data:`KL_ESTIMATORS` (``"k1"``, ``"k2"``, ``"k3"``, ``"abs"``,
            and the straight-through ``"k1+"``, ``"k3+"``: the value of k1/k3, the gradient of k2).
        importance_corrected: multiply by the token ratio r (with gradient; a detached
            weight for the ``+`` estimators, see the module docstring).
    """

    coef: float
    estimator: str = "k3"
    importance_corrected: bool = False

    def __post_init__(self) -> None:
        check_scale("coef", self.coef, low_inclusive=True)
        check_choice("estimator", self.estimator, KL_ESTIMATORS)

    @property
    def straight_through(self) -> bool:
        """True for the ``+`` estimators: k2's gradient under another estimator's value."""
        return self.estimator.endswith("+")


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
    name = estimator.rstrip("+")
    if name == "k1":
        value = -log_ratio
    elif name == "k2":
        value = 0.5 * log_ratio.square()
    elif name == "abs":
        value = log_ratio.abs()
    else:
        value = torch.expm1(log_ratio) - log_ratio  # e^d - 1 - d, with expm1 accurate near d = 0
    if not estimator.endswith("+"):
        return value
    k2 = 0.5 * log_ratio.square()  # [B, T]: the gradient's estimator
    return k2 - k2.detach() + value.detach()  # k2 - k2 is exactly 0: the value is exactly k's


@dataclass
class AdaptiveKLController:
    """The KL coefficient β steered towards a target KL (PPO's adaptive KL penalty).

    After a step that measured the KL estimate ``kl`` on ``n`` samples::

        β ← β · (1 + clip(kl / target - 1, -0.2, 0.2) · n / horizon)

    so β grows while the KL is above the target and shrinks while it is below, by at most
    ``0.2·n/horizon`` a step. A non-finite ``kl`` leaves β as it is.

    Args:
        coef: the initial β in (0, 1e12] (a multiplicative rule never leaves 0).
        target: the target KL > 0.
        horizon: > 0; with ``n`` samples a step, ``horizon / n`` steps move β by e^{±0.2} at most.

    References:
        Ziegler et al., arXiv:1909.08593, section 2.2 (verl's ``AdaptiveKLController``).
    """

    coef: float
    target: float
    horizon: float = 10_000

    def __post_init__(self) -> None:
        check_scale("coef", self.coef)
        check_number("target", self.target, low=0.0, low_inclusive=False)
        check_number("horizon", self.horizon, low=0.0, low_inclusive=False)

    def update(self, kl: float, n: int) -> float:
        """Move β for a step that measured ``kl`` on ``n`` samples; returns the new β."""
        if math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * n / self.horizon
        return self.coef

    def state_dict(self) -> dict[str, float]:
        """The controller's state (a plain number: a checkpoint stores it exactly)."""
        return {"coef": self.coef}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["coef"])
