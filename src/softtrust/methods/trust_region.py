"""Trust-region methods: the ratio r (at the loss's level) sits in the graph and is bounded or damped.

Every method here gives the plain policy gradient ``A·∇logp`` at r = 1 (PSPO: ``(1-α)·A·∇logp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import check_number, check_scale
from softtrust.methods.base import (
    LossContext,
    Method,
    MethodOutput,
    choose,
    register_method,
    token_level_note,
)

__all__ = ["CFPO", "DRO", "GMPO", "GSPO", "PSPO", "SAPO", "Clip"]

# the levels of a method whose ratio sits in the graph: token, GSPO's mean, and GSPO-token
_RATIO_LEVELS = ("token", "sequence-mean", "sequence-mean-token")
_SUM_LEVEL_NOTE = (
    "at 'sequence-sum' the ratio W_i (a product of n_i token ratios) sits in the graph, so the per-token "
    "gradient is n_i times the on-policy one; use 'token' or 'sequence-mean' (GSPO), or a REINFORCE-style "
    "method with a detached weight (VESPO, CISPO)"
)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    low: float | torch.Tensor,
    high: float | torch.Tensor,
    with_stats: bool = True,
    unclipped: torch.Tensor | None = None,
) -> MethodOutput:
    """The PPO clipped surrogate ``ℓ = -min(r̃·A, clip(r, low, high)·A)`` with ``r̃ = unclipped or r``.

    The one place the clip is written: :class:`Clip` (``low = 1-ε_low``, ``high = 1+ε_high``),
    :class:`~softtrust.methods.covariance.ClipCov` (the same bounds, some tokens zeroed) and
    :class:`~softtrust.methods.selection.BAPO` (bounds searched per batch, 0-dim tensors)
    call it. Stats: ``clip/low`` is ``r < low and A < 0``, ``clip/high`` is ``r > high and
    A > 0`` (the tokens whose gradient the clip zeroes).

    Args:
        ratio: [B, T] or [B, 1] ratio, differentiable.
        advantages: [B, 1] or [B, T].
        low, high: the ratio bounds (Python numbers or 0-dim tensors), low <= 1 <= high.
        with_stats: whether to return the clip fractions.
        unclipped: the unclipped branch r̃ (default: ``ratio``).
    """
    negative = -advantages  # the sign rides on the [B, 1] advantages, not on a [B, T] pass
    if unclipped is None:
        # -min(r·A, clip(r, low, high)·A) = -A·clamp(r, low_A, high_A): for A > 0 only the
        # upper bound binds (min(r, high)), for A <= 0 only the lower one (max(r, low))
        positive = advantages > 0
        low_a = choose(positive, -math.inf, low, ratio)
        high_a = choose(positive, high, math.inf, ratio)
        loss = ratio.clamp(low_a, high_a) * negative  # [B, T] or [B, 1]
    else:  # -min(x, y) = max(-x, -y)
        loss = torch.maximum(unclipped * negative, ratio.clamp(low, high) * negative)
    stats = {}
    if with_stats:
        stats["clip/low"] = (ratio < low) & (advantages < 0)
        stats["clip/high"] = (ratio > high) & (advantages > 0)
    return MethodOutput(loss, stats)


@register_method
@dataclass(frozen=True)
class Clip(Method):
    """PPO/GRPO/DAPO clipped surrogate, with optional dual-clip and delta.

    ``ℓ = -min(r̃·A, clip(r, 1-ε_low, 1+ε_high)·A)`` with ``r̃ = min(r, δ)`` when
    ``delta`` is set (INTELLECT-2) and ``r̃ = r`` otherwise. With ``dual_clip = c``,
    for ``A < 0``: ``ℓ = min(ℓ, c·|A|)``, which caps the loss (and zeroes the pull)
    of negative samples whose ratio exceeds c.

    Gradient w.r.t. ``logp`` where unclipped: ``-r·A``; 0 where clipped.
    Clip fractions follow the convention "clipped when the clip zeroes the
    gradient": ``clip/low`` is ``r < 1-ε_low and A < 0``, ``clip/high`` is
    ``r > 1+ε_high and A > 0``.

    Args:
        eps_low: lower clip ε (>= 0, < 1). DAPO uses 0.2.
        eps_high: upper clip ε (>= 0). DAPO uses 0.28.
        dual_clip: c > 1, or None.
        delta: δ > 1 capping the unclipped ratio, or None.

    References:
        Shao et al., DeepSeekMath (GRPO), arXiv:2402.03300; Yu et al., DAPO,
        arXiv:2503.14476; Ye et al., dual-clip PPO, arXiv:1912.09729;
        Prime Intellect, INTELLECT-2, arXiv:2505.07291.
    """

    name: ClassVar[str] = "clip"
    levels: ClassVar[tuple[str, ...]] = _RATIO_LEVELS
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    delta: float | None = None

    def __post_init__(self) -> None:
        check_number("eps_low", self.eps_low, low=0.0, high=1.0, high_inclusive=False)
        check_number("eps_high", self.eps_high, low=0.0)
        if self.dual_clip is not None:
            check_number("dual_clip", self.dual_clip, low=1.0, low_inclusive=False)
        if self.delta is not None:
            check_number("delta", self.delta, low=1.0, low_inclusive=False)

    def loss(self, ctx: LossContext) -> MethodOutput:
        advantages = ctx.advantages  # [B, 1] or [B, T]
        ratio = ctx.ratio  # [B, T] or [B, 1]
        unclipped = None if self.delta is None else ratio.clamp(max=self.delta)
        loss, stats = clipped_surrogate(
            ratio, advantages, 1.0 - self.eps_low, 1.0 + self.eps_high, ctx.with_stats, unclipped
        )
        if self.dual_clip is not None:
            cap = -self.dual_clip * advantages  # c·|A| for A < 0
            capped = (advantages < 0) & (loss > cap)
            loss = torch.where(capped, cap, loss)
            if ctx.with_stats:
                stats["clip/dual"] = capped
        return MethodOutput(loss, stats)


@register_method
@dataclass(frozen=True)
class GSPO(Clip):
    """GSPO: :class:`Clip` on the sequence-mean (geometric mean) ratio.

    ``s_i = exp(Σ_t m·log r_t / Σ_t m)``, ``ℓ_i = -min(s_i·A_i, clip(s_i, 1-ε_low, 1+ε_high)·A_i)``,
    the same for every token of sequence i. Its tiny default ε reflects that a
    geometric mean of many ratios stays close to 1.

    References:
        Zheng et al., Group Sequence Policy Optimization, arXiv:2507.18071.
    """

    name: ClassVar[str] = "gspo"
    default_level: ClassVar[str] = "sequence-mean"

    eps_low: float = 3e-4
    eps_high: float = 4e-4


@register_method
@dataclass(frozen=True)
class SAPO(Method):
    """SAPO: a soft, temperature-controlled gate in place of the hard clip.

    ``ℓ = -(4/τ)·σ(τ·(r-1))·A`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``.
    Gradient w.r.t. ``logp``: ``-sech²(τ(r-1)/2)·r·A``, which is ``-A`` at r = 1
    and decays smoothly as r leaves 1. Note the loss **value** at r = 1 is
    ``-(2/τ)·A``, not ``-A``: an offset with no gradient.

    Args:
        tau_pos: τ in [1e-12, 1e12] for positive advantages (it scales the gate and 4/τ).
        tau_neg: τ > 0 for non-positive advantages (larger: negative samples fade faster).

    References:
        Qwen team, Soft Adaptive Policy Optimization, arXiv:2511.20347.
    """

    name: ClassVar[str] = "sapo"
    levels: ClassVar[tuple[str, ...]] = _RATIO_LEVELS
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        check_scale("tau_pos", self.tau_pos, divides=True)  # the gate σ(τ(r-1)) and the factor 4/τ
        check_scale("tau_neg", self.tau_neg, divides=True)

    def loss(self, ctx: LossContext) -> MethodOutput:
        advantages = ctx.advantages  # [B, 1] or [B, T]
        tau = choose(advantages > 0, self.tau_pos, self.tau_neg, advantages)  # [B, 1] or [B, T]
        # σ(τ·r - τ) · (-(4/τ)·A): the constants ride on the advantages' shape, one fused τ·r - τ
        gate = torch.sigmoid(torch.addcmul(-tau, tau, ctx.ratio))  # [B, T] or [B, 1]
        return MethodOutput(gate * (-4.0 * advantages / tau))


@register_method
@dataclass(frozen=True)
class PSPO(Method):
    """PSPO: the ratio of the smoothed policy ``(1-α)·π_θ + α·π_old`` to ``π_old``.

    ``ℓ = -((1-α)·r + α)·A``: no min, no clip. Its gradient is exactly ``(1-α)``
    times the unclipped ratio gradient, ``-(1-α)·r·A``: smoothing shrinks the step
    uniformly rather than bounding the ratio.

    Args:
        alpha: smoothing α in [0, 1] (0 gives the unclipped importance-sampled loss).

    References:
        Dwyer et al., Probability Smoothing Policy Optimisation, arXiv:2509.21282.
    """

    name: ClassVar[str] = "pspo"
    levels: ClassVar[tuple[str, ...]] = _RATIO_LEVELS
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    alpha: float = 0.1

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low=0.0, high=1.0)

    def loss(self, ctx: LossContext) -> MethodOutput:
        smoothed = (1.0 - self.alpha) * ctx.ratio + self.alpha  # [B, T] or [B, 1]
        return MethodOutput(-smoothed * ctx.advantages)


@register_method
@dataclass(frozen=True)
class CFPO(Method):
    """CFPO: clipping-free surrogate with a quadratic penalty on the ratio.

    ``ℓ = -(r·A - |A|·(r-1)²/(2ε))``. Its gradient w.r.t. ``logp`` is
    ``-(A - |A|·(r-1)/ε)·r``: ``-A`` at r = 1, and 0 at the stationary point
    ``r = 1 + sign(A)·ε``, past which the penalty pulls the ratio back.

    Args:
        eps: ε >= 1e-12, where the objective stops rewarding further ratio change.

    References:
        Clipping-free policy optimization, arXiv:2601.22801.
    """

    name: ClassVar[str] = "cfpo"
    levels: ClassVar[tuple[str, ...]] = _RATIO_LEVELS
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    eps: float = 0.2

    def __post_init__(self) -> None:
        check_scale("eps", self.eps, multiplies=False, divides=True)  # the penalty's 1/(2ε)

    def loss(self, ctx: LossContext) -> MethodOutput:
        advantages, ratio = ctx.advantages, ctx.ratio
        penalty = advantages.abs() * (ratio - 1.0).square() / (2.0 * self.eps)
        return MethodOutput(-(ratio * advantages - penalty))


@register_method
@dataclass(frozen=True)
class GMPO(Method):
    """GMPO: geometric mean of sign-aware, log-space clipped token ratios.

    Per token, ``c_t = sign(A)·min(sign(A)·log r_t, sign(A)·clip(log r_t, -ε, ε))``
    (for ``A > 0`` only large ratios are capped, for ``A < 0`` only small ones),
    then ``ℓ_i = -A_i·exp(Σ_t m·c_t / Σ_t m)`` for every token of sequence i.
    It always works on the token ratios and reduces them itself, so its level is
    ``sequence-mean``.

    Args:
        eps: ε > 0, the log-space clip range (paper: 0.4, i.e. ratios in [e^-0.4, e^0.4]).

    References:
        Zhao et al., Geometric-Mean Policy Optimization, arXiv:2507.20673.
    """

    name: ClassVar[str] = "gmpo"
    default_level: ClassVar[str] = "sequence-mean"
    levels: ClassVar[tuple[str, ...]] = ("sequence-mean",)
    level_note: ClassVar[str] = "GMPO is defined on the geometric mean of clipped token ratios"
    engine_token_weights: ClassVar[str] = (
        "geometric-mean"  # its ratio is a geometric mean: so are the weights
    )

    eps: float = 0.4

    def __post_init__(self) -> None:
        check_number("eps", self.eps, low=0.0, low_inclusive=False)

    def loss(self, ctx: LossContext) -> MethodOutput:
        advantages, log_ratio = ctx.advantages, ctx.token_log_ratio  # [B, 1] or [B, T]; [B, T]
        sign = torch.sign(advantages)
        clipped = log_ratio.clamp(-self.eps, self.eps)
        sign_aware = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T]; 0 at masked positions
        mean_log = sign_aware.sum(dim=-1, keepdim=True) / ctx.num_active.clamp(min=1)  # [B, 1]
        stats = {}
        if ctx.with_stats:
            stats["clip/low"] = (log_ratio < -self.eps) & (advantages < 0)
            stats["clip/high"] = (log_ratio > self.eps) & (advantages > 0)
        return MethodOutput(-advantages * torch.exp(mean_log), stats)  # [B, 1] or [B, T]


@register_method
@dataclass(frozen=True)
class DRO(Method):
    """DRO: the policy gradient with a quadratic penalty on the token log-ratio.

    ``ℓ = -(A·logp - (β/2)·(log r)²)`` with ``log r = logp - old`` (clamped). Its
    gradient w.r.t. ``logp`` is ``-(A - β·log r)``: ``-A`` on-policy, and the penalty
    pulls a token back toward the old policy in proportion to how far it moved. Token
    level only: the penalty is on each token's log-ratio.

    Args:
        beta: penalty weight β in (0, 1e12]. The gradient vanishes at ``log r = A/β``, so with
            group-normalised advantages (``|A| ≈ 1``) β bounds how far a token's ratio
            drifts: β = 0.05 allows ``log r ≈ 20`` (the clamp: no trust region at all),
            the default β = 0.5 about ``log r ≈ 2``. On the main job at N = 8, β = 0.05
            collapses and β = 0.5 trains (docs/methods.md); verl has no default.

    References:
        Richemond et al., Offline Regularised Reinforcement Learning for LLM Alignment
        (Direct Reward Optimisation), arXiv:2405.19107; verl 0.9.1 ``dro``.
    """

    name: ClassVar[str] = "dro"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note("DRO", "penalises each token's log-ratio")

    beta: float = 0.5

    def __post_init__(self) -> None:
        check_scale("beta", self.beta)

    def loss(self, ctx: LossContext) -> MethodOutput:
        penalty = (0.5 * self.beta) * ctx.token_log_ratio.square()  # [B, T]
        return MethodOutput(-(ctx.advantages * ctx.logprobs - penalty))
