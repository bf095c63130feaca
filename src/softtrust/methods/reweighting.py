"""REINFORCE-style methods: ``ℓ = -sg(w)·A·logp`` with a detached importance weight w.

No ratio enters the graph, so the gradient is ``-w·A·∇logp`` at any level; w = 1 on-policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import check_number
from softtrust.methods.base import DetachedWeightMethod, LossContext, MethodOutput, choose, register_method


@register_method
@dataclass(frozen=True)
class CISPO(DetachedWeightMethod):
    """CISPO: REINFORCE with a clipped, detached importance weight.

    ``ℓ = -sg(clip(r, ratio_low, ratio_high))·A·logp``. The weight carries no
    gradient, so every token keeps a gradient ``-w·A`` (clipping bounds its size
    instead of dropping it).

    The bound is the **raw ratio value**, not an ε. Peers read "ε_high"
    differently: TRL and Liger cap at ``r <= epsilon_high`` (recommended 5.0), which
    maps to ``ratio_high = epsilon_high``; verl and the paper clip to ``1 ± ε``,
    which maps to ``ratio_high = 1 + ε_high``, ``ratio_low = 1 - ε_low``.

    Args:
        ratio_high: upper bound on the weight (>= 1 so that r = 1 is never clipped).
        ratio_low: lower bound (in [0, 1]), or None for no lower bound (the paper's and TRL's choice).

    References:
        MiniMax, MiniMax-M1, arXiv:2506.13585.
    """

    name: ClassVar[str] = "cispo"

    ratio_high: float = 5.0
    ratio_low: float | None = None

    def __post_init__(self) -> None:
        check_number("ratio_high", self.ratio_high, low=1.0)
        if self.ratio_low is not None:
            check_number("ratio_low", self.ratio_low, low=0.0, high=1.0)

    def weight(self, ctx: LossContext) -> MethodOutput:
        ratio = ctx.ratio  # [B, T] or [B, 1]
        stats = {}
        if ctx.with_stats:
            stats["clip/high"] = ratio > self.ratio_high
            if self.ratio_low is not None:
                stats["clip/low"] = ratio < self.ratio_low
        return MethodOutput(ratio.clamp(min=self.ratio_low, max=self.ratio_high), stats)


# VESPO's official code floors W at 1e-8 before the power: log W >= log(1e-8) ≈ -18.42.
VESPO_LOG_W_FLOOR = math.log(1e-8)


@register_method
@dataclass(frozen=True)
class VESPO(DetachedWeightMethod):
    """VESPO: a variational, sequence-level reshaping of the importance weight.

    With ``W_i = Π_t r_t`` (the product over the sequence, not length-normalised)::

        φ(W) = W^k · e^{λ(1-W)},   (k, λ) = (k_pos, λ_pos) if A_i >= 0 else (k_neg, λ_neg)
        ℓ_t = -sg(φ(W_i))·A_i·logp_t

    so the gradient is ``φ·A·∇logp`` and no ratio enters the graph. φ(1) = 1 for any
    (k, λ); it rises to a peak at ``W = k/λ`` and then decays exponentially, so
    it is **non-monotone**: very stale samples (W far above 1) are suppressed,
    samples slightly below 1 are up-weighted. ``log φ = k·log W - λ·(W - 1)`` is
    evaluated in log space; ``log W`` is clamped to ``[log 1e-8, clamp]`` as in the
    official code, which keeps φ finite (at ``log W = 20``, ``e^{-λW}`` underflows to
    exactly 0), so a non-finite φ can only come from non-finite input and is kept
    (the trainer's guard then skips the step).

    A behaviour correction (TIS/MIS) is folded into W (``log W += Σ_t m·log w_t``),
    as the official implementation does, instead of multiplying the loss.

    Levels: ``sequence-sum`` (the paper); ``sequence-mean`` is allowed on purpose as
    the paper's length-normalisation ablation (reported unstable).

    Args:
        k_pos, lambda_pos: kernel for ``A >= 0`` (k >= 0, λ > 0). Paper: (2, 3).
        k_neg, lambda_neg: kernel for ``A < 0``. Paper: (3, 2).

    References:
        Shen et al., VESPO: Variational Sequence-Level Soft Policy Optimization,
        arXiv:2602.10693.
    """

    name: ClassVar[str] = "vespo"
    default_level: ClassVar[str] = "sequence-sum"
    levels: ClassVar[tuple[str, ...]] = ("sequence-sum", "sequence-mean")
    level_note: ClassVar[str] = (
        "VESPO weights whole sequences: use 'sequence-sum' (the paper) or 'sequence-mean' "
        "(the length-normalisation ablation)"
    )
    folds_correction: ClassVar[bool] = True

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        check_number("k_pos", self.k_pos, low=0.0)
        check_number("lambda_pos", self.lambda_pos, low=0.0, low_inclusive=False)
        check_number("k_neg", self.k_neg, low=0.0)
        check_number("lambda_neg", self.lambda_neg, low=0.0, low_inclusive=False)

    def weight(self, ctx: LossContext) -> MethodOutput:
        phi = self.phi(ctx.log_ratio, ctx.advantages)  # [B, 1] (or [B, T] with token advantages)
        return MethodOutput(phi, {"phi": phi} if ctx.with_stats else {})

    def phi(self, log_w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """φ(W) from ``log W`` and the advantage sign (detached), broadcast of both inputs."""
        log_w = log_w.clamp(min=VESPO_LOG_W_FLOOR)
        nonneg = advantages >= 0
        k = choose(nonneg, self.k_pos, self.k_neg, log_w)
        lam = choose(nonneg, self.lambda_pos, self.lambda_neg, log_w)
        # log φ = k·log W - λ·(W - 1), in log space (W^k underflows, e^{λW} overflows),
        # with W - 1 = expm1(log W): exact near W = 1
        return torch.exp(torch.addcmul(k * log_w, lam, torch.expm1(log_w), value=-1.0))


@register_method
@dataclass(frozen=True)
class REINFORCE(DetachedWeightMethod):
    """REINFORCE / GPG: ``ℓ = -A·logp``; no ratio, no trust region.

    The on-policy reference every other method reduces to at r = 1.

    References:
        Williams (1992); Chu et al., GPG, arXiv:2504.02546.
    """

    name: ClassVar[str] = "reinforce"

    def weight(self, ctx: LossContext) -> MethodOutput:
        return MethodOutput(torch.ones((), dtype=ctx.advantages.dtype, device=ctx.advantages.device))
