"""Trust-region and importance-weight shaping methods: one small frozen dataclass each.

A method turns the importance ratio (at its level, see :mod:`softtrust.ratios`) and
the advantage into a per-token loss ℓ, to be minimised after aggregation. It knows
nothing of masks' reductions, corrections, KL or normalisers: :class:`softtrust.PolicyLoss`
composes those. Every method gives the plain policy gradient ``A·∇logp`` on-policy
(r = 1), except PSPO, whose gradient is ``(1-α)·A·∇logp``: they differ only off-policy.

Adding a method: write a frozen dataclass with ``name``, ``default_level``,
``levels`` and ``loss(inputs)``, decorate it with :func:`register_method`. Nothing
else changes. Optionally give ``surrogate(log_ratio, advantages, with_stats)`` (ℓ and
its closed-form slope ∂ℓ/∂log r) so that :class:`~softtrust.PolicyLoss` can take its
fused path; ``loss`` stays the autograd reference the fused path is tested against.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from softtrust._validation import check_number, constant, constants
from softtrust.ratios import LEVELS


class MethodInputs(NamedTuple):
    """What :class:`PolicyLoss` hands a method; all float tensors share one dtype.

    Attributes:
        logprobs: [B, T] current-policy log-probs, 0 at masked positions, differentiable.
        log_ratio: [B, T] (token level) or [B, 1] (sequence levels) clamped log-ratio
            at the method's level, differentiable; for methods that fold a behaviour
            correction, the correction's log-weight is already added.
        token_log_ratio: [B, T] clamped token log-ratio, 0 at masked positions.
        advantages: [B, 1] (one per sequence) or [B, T], 0 at masked positions.
        mask: [B, T] 0/1 float completion mask (every masked input entry is already 0).
        num_active: [B, 1] number of active tokens per row.
        with_stats: whether the caller wants ``MethodOutput.stats`` (metrics); methods
            skip computing them otherwise.
    """

    logprobs: torch.Tensor
    log_ratio: torch.Tensor
    token_log_ratio: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    num_active: torch.Tensor
    with_stats: bool = True


class MethodOutput(NamedTuple):
    """A method's per-token loss (broadcastable to [B, T]) and its diagnostics.

    ``stats`` maps a metric name to a tensor broadcastable to [B, T]: bool tensors
    are reported as the fraction of active positions where they hold (e.g. clip
    fractions), float tensors as their mean/min/max over active positions.
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]


METHODS: dict[str, type[Method]] = {}


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: add ``cls`` to :data:`METHODS` under ``cls.name``."""
    if cls.name in METHODS:
        raise ValueError(f"a method named {cls.name!r} is already registered ({METHODS[cls.name].__name__})")
    METHODS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class Method:
    """Base class: the contract every method follows."""

    name: ClassVar[str] = "method"
    #: level used when PolicyLoss(level=None)
    default_level: ClassVar[str] = "token"
    #: levels the method accepts; others are refused at construction with a reason
    levels: ClassVar[tuple[str, ...]] = LEVELS
    #: why the other levels are refused (shown in the error)
    level_note: ClassVar[str] = ""
    #: True: a behaviour correction's log-weight is added to the log-ratio (VESPO);
    #: False: the correction weight multiplies the per-token loss
    folds_correction: ClassVar[bool] = False

    def loss(self, inputs: MethodInputs) -> MethodOutput:  # pragma: no cover - interface
        raise NotImplementedError

    def surrogate(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor, with_stats: bool
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]] | None:
        """The per-element loss ``ℓ(log r, A)``, its slope ``∂ℓ/∂log r`` and the stats, all detached.

        A method whose loss depends on ``logp`` only through its log-ratio at its
        level can give both in closed form; :class:`~softtrust.PolicyLoss` then
        evaluates it in one fused pass whose backward is a single multiply (see
        ``PolicyLoss._fused_loss``). ``log_ratio`` is [B, T] or [B, 1], ``advantages``
        [B, 1] or [B, T]; the outputs broadcast like them. The slope must be the
        derivative autograd takes through :meth:`loss` (tests check it, ties included).
        None (the default): no closed form, the reference path is used.
        """
        return None

    @property
    def fusable(self) -> bool:
        """True when :class:`~softtrust.PolicyLoss` can take its fused path (no autograd through ℓ)."""
        return type(self).surrogate is not Method.surrogate


@dataclass(frozen=True)
class DetachedWeightMethod(Method):
    """REINFORCE-style methods: ``ℓ = -sg(w)·A·logp`` with a detached weight w.

    The loss is linear in ``logp`` with a coefficient that carries no gradient, so
    :class:`~softtrust.PolicyLoss` can evaluate it in one fused pass (see
    ``loss._with_gradient``). Subclasses only define :meth:`weight`.
    """

    @property
    def fusable(self) -> bool:
        return True

    def weight(
        self, log_ratio: torch.Tensor, advantages: torch.Tensor, with_stats: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # pragma: no cover - interface
        """The detached weight (broadcastable to [B, T]) and its diagnostics."""
        raise NotImplementedError

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        with torch.no_grad():
            weight, stats = self.weight(inputs.log_ratio, inputs.advantages, inputs.with_stats)
        loss = -(weight * inputs.advantages) * inputs.logprobs  # [B, T]; the [B, 1] factor first
        return MethodOutput(loss, stats)


def _select(condition: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor) -> torch.Tensor:
    """``where(condition, a, b)`` for two Python floats, in ``like``'s dtype (a bare float pair gives float32)."""
    return torch.where(
        condition, constant(if_true, like.dtype, like.device), constant(if_false, like.dtype, like.device)
    )


_SUM_LEVEL_NOTE = (
    "at 'sequence-sum' the ratio W_i (a product of n_i token ratios) sits in the graph, so the per-token "
    "gradient is n_i times the on-policy one; use 'token' or 'sequence-mean' (GSPO), or a REINFORCE-style "
    "method with a detached weight (VESPO, CISPO)"
)


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
    levels: ClassVar[tuple[str, ...]] = ("token", "sequence-mean")
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

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        advantages = inputs.advantages  # [B, 1] or [B, T]
        ratio = torch.exp(inputs.log_ratio)  # [B, T] or [B, 1]; finite: log-ratio is clamped
        clipped = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        unclipped = ratio if self.delta is None else ratio.clamp(max=self.delta)
        loss = -torch.minimum(unclipped * advantages, clipped * advantages)  # [B, T] or [B, 1]
        stats = self._clip_stats(ratio, advantages) if inputs.with_stats else {}
        if self.dual_clip is not None:
            is_capped = self._dual_capped(loss, advantages)
            loss = torch.where(is_capped, -self.dual_clip * advantages, loss)
            stats["clip/dual"] = is_capped
        return MethodOutput(loss, stats)

    def surrogate(self, log_ratio, advantages, with_stats):
        """``ℓ = -min(r̃·A, clip(r)·A)``; slope ``-A·r`` where the chosen branch follows r, else 0.

        The chosen branch is the one ``torch.minimum`` passes its gradient to; on a
        tie (``r̃·A = clip(r)·A`` with A ≠ 0, so both branches equal r or both are
        constant) the two slopes agree, so its half-and-half split changes nothing.
        ``clamp`` passes gradient on its closed interval, as here.
        """
        ratio = torch.exp(log_ratio)  # [B, T] or [B, 1]
        bounded = ratio.clamp(1.0 - self.eps_low, 1.0 + self.eps_high)
        scaled, clipped = ratio * advantages, bounded * advantages  # r·A, clip(r)·A
        # ``x.clamp(...) == x`` exactly where x lies in the closed interval (clamp returns x itself)
        if self.delta is None:
            follows = (scaled <= clipped) | (bounded == ratio)
            loss = torch.minimum(scaled, clipped).neg_()
        else:
            capped_ratio = ratio.clamp(max=self.delta)
            capped = capped_ratio * advantages
            take_unclipped = capped <= clipped
            loss = torch.where(take_unclipped, capped, clipped).neg_()
            follows = torch.where(take_unclipped, capped_ratio == ratio, bounded == ratio)
        slope = torch.where(follows, scaled, 0.0).neg_()  # -A·r where the chosen branch follows r
        stats = self._clip_stats(ratio, advantages) if with_stats else {}
        if self.dual_clip is not None:
            is_capped = self._dual_capped(loss, advantages)
            loss = torch.where(is_capped, -self.dual_clip * advantages, loss)
            slope = slope.masked_fill(is_capped, 0.0)
            stats["clip/dual"] = is_capped
        return loss, slope, stats

    def _clip_stats(self, ratio: torch.Tensor, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            "clip/low": (ratio < 1.0 - self.eps_low) & (advantages < 0),
            "clip/high": (ratio > 1.0 + self.eps_high) & (advantages > 0),
        }

    def _dual_capped(self, loss: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """Where the dual clip caps the loss at ``c·|A|`` (A < 0 only)."""
        return (advantages < 0) & (loss > -self.dual_clip * advantages)


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

    def weight(self, log_ratio, advantages, with_stats):
        ratio = torch.exp(log_ratio.detach())  # [B, T] or [B, 1]
        stats = {}
        if with_stats:
            stats["clip/high"] = ratio > self.ratio_high
            if self.ratio_low is not None:
                stats["clip/low"] = ratio < self.ratio_low
        return ratio.clamp(min=self.ratio_low, max=self.ratio_high), stats


@register_method
@dataclass(frozen=True)
class SAPO(Method):
    """SAPO: a soft, temperature-controlled gate in place of the hard clip.

    ``ℓ = -(4/τ)·σ(τ·(r-1))·A`` with ``τ = τ_pos`` if ``A > 0`` else ``τ_neg``.
    Gradient w.r.t. ``logp``: ``-sech²(τ(r-1)/2)·r·A``, which is ``-A`` at r = 1
    and decays smoothly as r leaves 1. Note the loss **value** at r = 1 is
    ``-(2/τ)·A``, not ``-A``: an offset with no gradient.

    Args:
        tau_pos: τ > 0 for positive advantages.
        tau_neg: τ > 0 for non-positive advantages (larger: negative samples fade faster).

    References:
        Qwen team, Soft Adaptive Policy Optimization, arXiv:2511.20347.
    """

    name: ClassVar[str] = "sapo"
    levels: ClassVar[tuple[str, ...]] = ("token", "sequence-mean")
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        check_number("tau_pos", self.tau_pos, low=0.0, low_inclusive=False)
        check_number("tau_neg", self.tau_neg, low=0.0, low_inclusive=False)

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        advantages = inputs.advantages
        ratio = torch.exp(inputs.log_ratio)  # [B, T] or [B, 1]
        tau = _select(advantages > 0, self.tau_pos, self.tau_neg, advantages)  # [B, 1] or [B, T]
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        return MethodOutput(-gate * advantages, {})

    def surrogate(self, log_ratio, advantages, with_stats):
        """``ℓ = -(4/τ)·σ·A`` with ``σ = sigmoid(τ(r-1))``; slope ``-4·σ(1-σ)·r·A``."""
        ratio = torch.exp(log_ratio)
        tau = _select(advantages > 0, self.tau_pos, self.tau_neg, advantages)
        sig = torch.sigmoid(tau * (ratio - 1.0))
        scaled = sig * advantages  # σ·A
        loss = scaled * tau.reciprocal().mul_(-4.0)  # -(4/τ)·σ·A
        slope = torch.addcmul(sig, sig, sig, value=-1.0).mul_(ratio * advantages).mul_(-4.0)  # -4·σ(1-σ)·r·A
        return loss, slope, {}


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
    levels: ClassVar[tuple[str, ...]] = ("token", "sequence-mean")
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    alpha: float = 0.1

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low=0.0, high=1.0)

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        ratio = torch.exp(inputs.log_ratio)  # [B, T] or [B, 1]
        smoothed = (1.0 - self.alpha) * ratio + self.alpha
        return MethodOutput(-smoothed * inputs.advantages, {})

    def surrogate(self, log_ratio, advantages, with_stats):
        """``ℓ = -((1-α)·r + α)·A``; slope ``-(1-α)·r·A``."""
        scaled = (1.0 - self.alpha) * torch.exp(log_ratio)
        return -(scaled + self.alpha) * advantages, -scaled * advantages, {}


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
    samples slightly below 1 are up-weighted. ``log φ = λ + k·log W - λ·W`` is
    evaluated in log space; ``log W`` is clamped to ``[log 1e-8, clamp]`` as in the
    official code and a non-finite φ becomes 0.

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

    def phi(self, log_w: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
        """φ(W) from ``log W`` and the advantage sign (no gradient), broadcast of both inputs."""
        zero, floor, k_pos, k_neg, lam_pos, lam_neg = constants(
            (0.0, VESPO_LOG_W_FLOOR, self.k_pos, self.k_neg, self.lambda_pos, self.lambda_neg),
            advantages.dtype,
            advantages.device,
        )  # one cached lookup: at small shapes this function is per-op overhead, not arithmetic
        log_w = torch.clamp_min(log_w.detach() if log_w.requires_grad else log_w, floor)
        nonneg = torch.ge(advantages, zero)
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lam_pos, lam_neg)
        # log φ = k·log W - λ·(W - 1), in log space (W^k underflows, e^{λW} overflows), with
        # W - 1 = expm1(log W): exact near W = 1, and one op (a Python-scalar subtraction
        # costs twice a tensor op at the small shapes where this is overhead-bound)
        log_phi = torch.addcmul(k * log_w, lam, torch.expm1(log_w), value=-1.0)
        return torch.exp(log_phi).nan_to_num_(0.0, 0.0, 0.0)  # NaN, ±inf -> 0 (in place: a fresh tensor)

    def weight(self, log_ratio, advantages, with_stats):
        phi = self.phi(log_ratio, advantages)  # [B, 1] (or [B, T] with token advantages)
        return phi, ({"phi": phi} if with_stats else {})


@register_method
@dataclass(frozen=True)
class CFPO(Method):
    """CFPO: clipping-free surrogate with a quadratic penalty on the ratio.

    ``ℓ = -(r·A - |A|·(r-1)²/(2ε))``. Its gradient w.r.t. ``logp`` is
    ``-(A - |A|·(r-1)/ε)·r``: ``-A`` at r = 1, and 0 at the stationary point
    ``r = 1 + sign(A)·ε``, past which the penalty pulls the ratio back.

    Args:
        eps: ε > 0, where the objective stops rewarding further ratio change.

    References:
        Clipping-free policy optimization, arXiv:2601.22801.
    """

    name: ClassVar[str] = "cfpo"
    levels: ClassVar[tuple[str, ...]] = ("token", "sequence-mean")
    level_note: ClassVar[str] = _SUM_LEVEL_NOTE

    eps: float = 0.2

    def __post_init__(self) -> None:
        check_number("eps", self.eps, low=0.0, low_inclusive=False)

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        advantages = inputs.advantages
        ratio = torch.exp(inputs.log_ratio)  # [B, T] or [B, 1]
        penalty = advantages.abs() * (ratio - 1.0).square() / (2.0 * self.eps)
        return MethodOutput(-(ratio * advantages - penalty), {})

    def surrogate(self, log_ratio, advantages, with_stats):
        """``ℓ = -(r·A - |A|·(r-1)²/(2ε))``; slope ``-(A - |A|·(r-1)/ε)·r``."""
        ratio = torch.exp(log_ratio)
        excess = advantages.abs() * (ratio - 1.0) / self.eps  # |A|·(r-1)/ε
        loss = -(ratio * advantages - excess * (ratio - 1.0) / 2.0)
        return loss, -(advantages - excess) * ratio, {}


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

    eps: float = 0.4

    def __post_init__(self) -> None:
        check_number("eps", self.eps, low=0.0, low_inclusive=False)

    def loss(self, inputs: MethodInputs) -> MethodOutput:
        advantages = inputs.advantages
        sign = torch.sign(advantages)  # [B, 1] or [B, T]
        log_ratio = inputs.token_log_ratio  # [B, T]
        clipped = log_ratio.clamp(-self.eps, self.eps)
        sign_aware = sign * torch.minimum(sign * log_ratio, sign * clipped)  # [B, T]; 0 at masked positions
        mean_log = sign_aware.sum(dim=-1, keepdim=True) / inputs.num_active.clamp(min=1)  # [B, 1]
        loss = -advantages * torch.exp(mean_log)  # [B, 1] or [B, T]
        stats = {}
        if inputs.with_stats:
            stats["clip/low"] = (log_ratio < -self.eps) & (advantages < 0)
            stats["clip/high"] = (log_ratio > self.eps) & (advantages > 0)
        return MethodOutput(loss, stats)


@register_method
@dataclass(frozen=True)
class REINFORCE(DetachedWeightMethod):
    """REINFORCE / GPG: ``ℓ = -A·logp``; no ratio, no trust region.

    The on-policy reference every other method reduces to at r = 1.

    References:
        Williams (1992); Chu et al., GPG, arXiv:2504.02546.
    """

    name: ClassVar[str] = "reinforce"

    def weight(self, log_ratio, advantages, with_stats):
        return advantages.new_ones(()), {}


def make_method(method: str | Method, **params: object) -> Method:
    """A method instance from a registry name (plus parameters) or an instance (plus overrides).

    >>> make_method("sapo", tau_neg=1.1)
    SAPO(tau_pos=1.0, tau_neg=1.1)
    """
    if isinstance(method, Method):
        if not params:
            return method
        cls = type(method)
        current = {f.name: getattr(method, f.name) for f in dataclasses.fields(cls)}
        method_cls, params = cls, {**current, **params}
    elif isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)} or a Method instance, got {method!r}")
        method_cls = METHODS[method]
    else:
        raise ValueError(f"method must be a registry name or a Method instance, got {type(method).__name__}")
    fields = {f.name for f in dataclasses.fields(method_cls)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for method {method_cls.name!r}; it takes {sorted(fields) or 'none'}"
        )
    return method_cls(**params)
