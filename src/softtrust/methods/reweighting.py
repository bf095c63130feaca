"""REINFORCE-style methods: ``ℓ = -sg(w)·A·logp`` with a detached importance weight w.

No ratio enters the graph, so the gradient is ``-w·A·∇logp`` at any level; w = 1 on-policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import SCALE_MAX, check_choice, check_number
from softtrust.methods.base import (
    DetachedWeightMethod,
    LossContext,
    MethodOutput,
    choose,
    register_method,
    token_level_note,
)

__all__ = ["CISPO", "DPPO", "REINFORCE", "TOPR", "VESPO"]


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
        k_neg, lambda_neg: kernel for ``A < 0``. Paper: (3, 2). Each kernel's peak φ
            (:func:`vespo_log_phi_peak`) must be at most 1e12: φ multiplies the loss.

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
        for sign in ("pos", "neg"):
            k, lam = getattr(self, f"k_{sign}"), getattr(self, f"lambda_{sign}")
            peak = vespo_log_phi_peak(k, lam)
            if peak > math.log(SCALE_MAX):
                raise ValueError(
                    f"k_{sign}={k!r}, lambda_{sign}={lam!r}: VESPO's weight φ(W) = W^k·e^(λ(1-W)) peaks at "
                    f"φ = e^{peak:.4g}, must stay <= {SCALE_MAX:g} (φ multiplies the loss; beyond that it "
                    f"overflows float32): lower k_{sign} or raise lambda_{sign} toward k_{sign}"
                )

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


def vespo_log_phi_peak(k: float, lam: float) -> float:
    """``max log φ(W)`` over ``W >= 1e-8`` (VESPO's floor), for any clamp: ``d log φ / dW = k/W - λ``,
    so ``log φ = k·log W - λ(W - 1)`` rises up to ``W* = k/λ`` and falls after; ``W*`` below the
    floor puts the peak at the floor. ``k·log(k/λ) - k + λ`` for ``k/λ >= 1e-8``."""
    at = max(k / lam, math.exp(VESPO_LOG_W_FLOOR))
    return k * math.log(at) - lam * (at - 1.0)


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


# DPPO's divergence thresholds when none are given: the values of the reference recipe
# (verl 0.9.1 examples/dppo_trainer/run_qwen30b_dppo.sh: clip_ratio 0.15 for dppo_tv, 0.05 for dppo_kl).
DPPO_DEFAULT_DELTA = {"tv": 0.15, "binary-kl": 0.05}


@register_method
@dataclass(frozen=True)
class DPPO(DetachedWeightMethod):
    """DPPO: REINFORCE with a truncated detached ratio, masked by a divergence trust region.

    Per token, with ``p = π_θ(token) = e^logp`` and ``p_old = e^old``::

        ℓ = -sg(min(r, cap))·valid·A·logp

    ``valid`` (detached) drops a token whose probability has already moved too far *in
    the direction the update pushes it*:

    - ``divergence="tv"`` (DPPO-Binary-TV): ``D = p - p_old``; valid when
      ``D <= δ_high`` for ``A > 0`` and ``D >= -δ_low`` for ``A <= 0``.
    - ``divergence="binary-kl"`` (DPPO-Binary-KL): ``D = KL(Bern(p_old) ‖ Bern(p))
      = p_old·log(p_old/p) + (1-p_old)·log((1-p_old)/(1-p))`` (``0·log 0 = 0``);
      valid when ``D <= δ_high or p <= p_old`` for ``A > 0`` and
      ``D <= δ_low or p >= p_old`` for ``A <= 0``. The KL is symmetric in direction,
      so the direction test keeps every token that moved *against* the update.

    The gradient is ``-min(r, cap)·valid·A·∇logp``: a valid token keeps its full
    (importance-weighted) gradient, an invalid one gets none. On-policy ``r = 1``,
    ``D = 0``: every token is valid and the gradient is REINFORCE's.

    Args:
        divergence: ``"tv"`` or ``"binary-kl"``.
        delta_low: threshold for ``A <= 0`` (> 0); None: 0.15 (TV) or 0.05 (binary KL),
            the reference recipe's values.
        delta_high: threshold for ``A > 0``; None as for ``delta_low``.
        cap: truncation of the detached ratio (>= 1; 20 as in the paper's section 5.4).

    References:
        Rethinking the Trust Region in LLM Reinforcement Learning (DPPO), arXiv:2602.04879;
        verl 0.9.1 ``dppo_tv`` / ``dppo_kl``.
    """

    name: ClassVar[str] = "dppo"
    levels: ClassVar[tuple[str, ...]] = ("token",)
    level_note: ClassVar[str] = token_level_note("DPPO", "bounds a per-token divergence between p and p_old")

    divergence: str = "tv"
    delta_low: float | None = None
    delta_high: float | None = None
    cap: float = 20.0

    def __post_init__(self) -> None:
        check_choice("divergence", self.divergence, tuple(DPPO_DEFAULT_DELTA))
        for name in ("delta_low", "delta_high"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low=0.0, low_inclusive=False)
        check_number("cap", self.cap, low=1.0)

    @property
    def thresholds(self) -> tuple[float, float]:
        """``(δ_low, δ_high)`` with the divergence's default for a threshold left None."""
        default = DPPO_DEFAULT_DELTA[self.divergence]
        low = default if self.delta_low is None else self.delta_low
        return low, default if self.delta_high is None else self.delta_high

    def weight(self, ctx: LossContext) -> MethodOutput:
        ratio = torch.exp(ctx.token_log_ratio)  # [B, T]; NaN where old is not finite
        prob, old_prob = torch.exp(ctx.logprobs), torch.exp(ctx.old_logprobs)  # [B, T]
        up = ctx.advantages > 0  # [B, 1] or [B, T]
        low, high = self.thresholds
        if self.divergence == "tv":
            moved = prob - old_prob
            valid = torch.where(up, moved <= high, moved >= -low)
        else:
            kl = binary_kl(ctx.old_logprobs, ctx.logprobs)
            valid = torch.where(up, (kl <= high) | (prob <= old_prob), (kl <= low) | (prob >= old_prob))
        stats = {}
        if ctx.with_stats:
            stats["dppo/masked"] = ~valid
            stats["clip/high"] = ratio > self.cap
        return MethodOutput(ratio.clamp(max=self.cap) * valid, stats)


def binary_kl(old_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(p_old) ‖ Bern(p))`` from log-probs, with ``0·log 0 = 0``; [B, T], >= 0 or +inf.

    ``p_old·(log p_old - log p) + (1-p_old)·(log(1-p_old) - log(1-p))``, with
    ``log(1-p) = log(-expm1(logp))`` exact for p near 1. A term whose weight is 0
    is 0; ``p = 1 > p_old`` (all mass moved onto the token) gives +inf.
    """
    old_prob = torch.exp(old_logprobs)
    log_rest = torch.log(-torch.expm1(logprobs))  # log(1 - p); -inf at p = 1
    log_rest_old = torch.log(-torch.expm1(old_logprobs))
    first = old_prob * (old_logprobs - logprobs)
    second = torch.where(old_prob < 1.0, (1.0 - old_prob) * (log_rest_old - log_rest), 0.0)
    return first + second


@register_method
@dataclass(frozen=True)
class TOPR(DetachedWeightMethod):
    """TOPR: tapered off-policy REINFORCE.

    ``ℓ = -sg(w)·A·logp`` with ``w = 1`` for ``A >= 0`` and ``w = clip(r, 0, 1)`` for
    ``A < 0``, r the ratio at the level (default ``sequence-sum``: the product of the
    sequence's token ratios, as in the paper). Positive samples keep the plain
    REINFORCE gradient (no importance weight, so they never vanish); negative samples
    are tapered by their ratio, which bounds how hard an off-policy failure pushes
    probability down. On-policy (r = 1) the gradient is REINFORCE's.

    References:
        Le Roux et al., Tapered Off-Policy REINFORCE, arXiv:2503.14286.
    """

    name: ClassVar[str] = "topr"
    default_level: ClassVar[str] = "sequence-sum"

    def weight(self, ctx: LossContext) -> MethodOutput:
        negative = ctx.advantages < 0  # [B, 1] or [B, T]
        tapered = ctx.ratio.clamp(0.0, 1.0)  # [B, 1] or [B, T]; NaN stays NaN
        weight = torch.where(negative, tapered, torch.ones_like(tapered))
        return MethodOutput(weight, {"clip/low": negative & (ctx.ratio < 1.0)} if ctx.with_stats else {})
