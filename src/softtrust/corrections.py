"""Behaviour corrections: when the sampler is not the policy the trainer scores.

The rollout engine (vLLM, a bf16 sampler, an asynchronous worker) produced the
tokens with log-probs ``rollout``, while the trainer's behaviour log-probs are
``old``. The correction ratio is ``ρ = π_old / π_rollout = exp(old - rollout)``,
per token or per sequence (the product, ``exp(Σ_t m·(old - rollout))``).

| correction | weight on ℓ                       | notes |
| ---------- | --------------------------------- | ----- |
| TIS        | ``min(ρ, C)``                     | truncated IS; C = 2 (verl), 3 (TRL) |
| MIS        | ``ρ·1[lo <= ρ <= hi]``            | masked IS / IcePop; a sequence ρ is a product, so long sequences are masked more often |
| OPSM       | drop a sequence if ``A < 0`` and ``mean_t(rollout - logp) > δ`` | DeepSeek-V3.2's off-policy sequence mask |
| Reject     | drop a token/sequence whose divergence ``D(log ρ)`` (k1, k2, k3, ratio) leaves ``[low, high]`` | rejection sampling (verl ``rollout_rs``) |

``self_normalize=True`` on TIS or MIS divides the weights by their mean over the batch
(:func:`is_weight_mean`, verl's ``rollout_is_batch_normalize``); a trainer that splits the
batch passes the whole batch's mean as ``state=`` (``PolicyLoss.batch_state``).

Weights carry no gradient. For most methods an IS weight multiplies the per-token
loss; VESPO instead folds ``log w`` into its sequence log-weight (see
:func:`fold_log_weight`), as its official implementation does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from softtrust._validation import check_choice, check_number
from softtrust.methods import VESPO_LOG_W_FLOOR
from softtrust.ratios import DEFAULT_LOG_RATIO_CLAMP, clamped_log_ratio, masked_sequence_sum

CORRECTION_LEVELS = ("token", "sequence")


def rollout_log_ratio(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    level: str,
    clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """``log ρ``: [B, T] (token) or [B, 1] (sequence: Σ_t m·log ρ_t), clamped, detached.

    Both inputs are 0 at masked positions, so ``log ρ`` is 0 there; a non-finite
    sampler log-prob at an active position gives NaN (see
    :func:`~softtrust.ratios.clamped_log_ratio`).
    """
    log_rho = clamped_log_ratio(old_logprobs, rollout_logprobs, clamp).detach()  # [B, T]
    if level == "token":
        return log_rho
    return log_rho.sum(dim=-1, keepdim=True).clamp(-clamp, clamp)  # [B, 1]


@dataclass(frozen=True)
class ImportanceCorrection:
    """Base class of the IS corrections (TIS, MIS): a detached log-weight per token or sequence.

    Subclasses declare the fields ``level`` (``"token"`` or ``"sequence"``) and
    ``self_normalize`` (divide the weights by their batch mean, :func:`is_weight_mean`)
    after their own parameters, so ``TIS(2.0)`` is ``TIS(cap=2.0)``.
    """

    kind: ClassVar[str] = "is"

    def log_weight(self, log_rho: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``log w`` from ``log ρ`` (same shape); ``-inf`` means weight 0."""
        raise NotImplementedError

    def _check(self) -> None:
        check_choice("level", self.level, CORRECTION_LEVELS)
        if not isinstance(self.self_normalize, bool):
            raise ValueError(f"self_normalize must be True or False, got {self.self_normalize!r}")


@dataclass(frozen=True)
class TIS(ImportanceCorrection):
    """Truncated importance sampling: ``w = min(ρ, cap)``.

    Args:
        cap: C > 0 (verl: 2, TRL: 3).
        level: ``"token"`` (ρ per token) or ``"sequence"`` (ρ = product over the sequence).
        self_normalize: divide the truncated weights by their mean over the batch
            (:func:`is_weight_mean`; verl's ``rollout_is_batch_normalize``).

    References:
        Yao et al., "Your efficient RL framework secretly brings you off-policy RL training" (2025).
    """

    cap: float = 2.0
    level: str = "token"
    self_normalize: bool = False

    def __post_init__(self) -> None:
        check_number("cap", self.cap, low=0.0, low_inclusive=False)
        self._check()

    def log_weight(self, log_rho: torch.Tensor) -> torch.Tensor:
        return log_rho.clamp(max=math.log(self.cap))


@dataclass(frozen=True)
class MIS(ImportanceCorrection):
    """Masked importance sampling (IcePop): ``w = ρ·1[low <= ρ <= high]``.

    Args:
        low: lower bound (>= 0, < high).
        high: upper bound (> low).
        level: ``"sequence"`` (default) or ``"token"``.
        self_normalize: divide the weights by their mean over the batch, the masked (zero)
            weights counted (:func:`is_weight_mean`; verl's ``rollout_is_batch_normalize``).
    """

    low: float = 0.5
    high: float = 2.0
    level: str = "sequence"
    self_normalize: bool = False

    def __post_init__(self) -> None:
        check_number("low", self.low, low=0.0)
        check_number("high", self.high)
        if not self.low < self.high:
            raise ValueError(f"MIS needs low < high, got low={self.low!r}, high={self.high!r}")
        self._check()

    def log_weight(self, log_rho: torch.Tensor) -> torch.Tensor:
        rho = torch.exp(log_rho)
        outside = (rho < self.low) | (rho > self.high)  # False for NaN: a NaN weight stays NaN
        return torch.where(outside, -math.inf, log_rho)


@dataclass(frozen=True)
class OPSM:
    """Off-policy sequence mask (DeepSeek-V3.2): drop negative samples that drifted too far.

    A sequence is dropped when ``A < 0`` and ``mean_t(rollout_t - logp_t) > δ``,
    where ``rollout`` is the sampler's log-prob (the behaviour log-prob when no
    rollout log-probs are given): both staleness and engine mismatch count.

    Args:
        delta: δ >= 0.

    References:
        DeepSeek-AI, DeepSeek-V3.2, arXiv:2512.02556.
    """

    kind: ClassVar[str] = "mask"
    delta: float = 0.5

    def __post_init__(self) -> None:
        check_number("delta", self.delta, low=0.0)

    def weight(
        self,
        logprobs: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        num_active: torch.Tensor,
    ) -> torch.Tensor:
        """[B, 1] (or [B, T] with token advantages), detached: 0 where the sequence is dropped, else 1 (NaN where its drift is NaN).

        Inputs are 0 at masked positions; ``mask`` is 0/1 float. A NaN drift (non-finite
        input) keeps NaN, so the loss comes out non-finite instead of silently dropping
        or keeping the sequence.
        """
        # a non-finite sampler log-prob at an active position is invalid input: NaN, not a drift of ±inf
        token_drift = torch.where(
            torch.isfinite(sampler_logprobs), sampler_logprobs - logprobs.detach(), math.nan
        )
        drift = masked_sequence_sum(token_drift, mask)  # [B, 1]
        mean_drift = drift / num_active.clamp(min=1)  # [B, 1]
        dropped = (advantages < 0) & (mean_drift > self.delta)  # [B, 1] or [B, T]
        return torch.where(torch.isnan(mean_drift), math.nan, (~dropped).to(drift.dtype))


REJECT_DIVERGENCES = ("k1", "k2", "k3", "ratio")
REJECT_LEVELS = ("token", "sequence-sum", "sequence-mean", "sequence-max")


@dataclass(frozen=True)
class Reject:
    """Rejection sampling: drop tokens or sequences whose sampler diverged from the old policy.

    With ``log ρ_t = old_t - rollout_t`` (ρ = π_old/μ, clamped as every log-ratio), the
    per-token statistic is

    | divergence | ``D_t``                        | bounds are on                  |
    | ---------- | ------------------------------ | ------------------------------ |
    | ``k1``     | ``-log ρ_t``                   | D (signed)                     |
    | ``k2``     | ``½·(log ρ_t)²``               | D (>= 0)                       |
    | ``k3``     | ``ρ_t - 1 - log ρ_t``          | D (>= 0)                       |
    | ``ratio``  | ``log ρ_t``                    | ``exp`` of the aggregate: a ratio |

    aggregated at ``level``: ``token`` (each token alone), ``sequence-sum`` (``Σ_t m·D_t``),
    ``sequence-mean`` (``Σ_t m·D_t / Σ_t m``) or ``sequence-max`` (``max_t`` over active
    tokens). A token (or every token of a sequence) is kept iff
    ``low <= S <= high`` (a bound that is None is absent); for ``ratio`` the test is
    ``low <= exp(S) <= high``, so ``Reject("ratio", "sequence-mean", 0.999, 1.001)`` is the
    geometric-mean ratio bound (verl's Geo-RS) and ``Reject("ratio", "sequence-sum", 0.5, 2)``
    bounds the sequence ratio. ``veto`` additionally drops a whole sequence when any
    active token has ``ρ_t < veto``.

    Like :class:`OPSM` it is a mask: a detached 0/1 weight on the per-token loss (never
    folded into VESPO's W), NaN where the statistic is NaN (a non-finite sampler
    log-prob at an active position), so invalid input gives a non-finite loss. It
    needs ``rollout_logprobs`` and combines with one IS correction
    (``correction=[st.TIS(), st.Reject(...)]``).

    Args:
        divergence: ``"k1"``, ``"k2"``, ``"k3"`` or ``"ratio"``.
        level: ``"token"``, ``"sequence-sum"``, ``"sequence-mean"`` or ``"sequence-max"``.
        low: lower bound on the statistic (for ``ratio``: a ratio > 0), or None.
        high: upper bound (for ``ratio``: a ratio > 0), or None; default 0.01 (verl's K3-RS).
        veto: a ratio in (0, 1), or None.

    References:
        Yao et al., "Your efficient RL framework secretly brings you off-policy RL
        training" (2025); verl ``rollout_rs`` (``verl/trainer/ppo/rollout_corr_helper.py``);
        the k1/k2/k3 estimators: J. Schulman, "Approximating KL divergence" (2020).
    """

    kind: ClassVar[str] = "mask"
    divergence: str = "k3"
    level: str = "sequence-mean"
    low: float | None = None
    high: float | None = 0.01
    veto: float | None = None

    def __post_init__(self) -> None:
        check_choice("divergence", self.divergence, REJECT_DIVERGENCES)
        check_choice("level", self.level, REJECT_LEVELS)
        # a ratio bound is > 0, a k2/k3 bound >= 0 (both are >= 0 everywhere), a k1 bound any number
        floor = None if self.divergence == "k1" else 0.0
        for name in ("low", "high"):
            value = getattr(self, name)
            if value is not None:
                check_number(name, value, low=floor, low_inclusive=self.divergence != "ratio")
        if self.low is not None and self.high is not None and not self.low < self.high:
            raise ValueError(f"Reject needs low < high, got low={self.low!r}, high={self.high!r}")
        if self.veto is not None:
            check_number("veto", self.veto, low=0.0, high=1.0, low_inclusive=False, high_inclusive=False)
        if self.low is None and self.high is None and self.veto is None:
            raise ValueError(
                "Reject needs at least one of low, high or veto, got none (it would keep everything)"
            )

    def weight(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        mask: torch.Tensor,
        num_active: torch.Tensor,
    ) -> torch.Tensor:
        """[B, T] (``token``) or [B, 1] (sequence levels), detached: 1 kept, 0 rejected, NaN where the statistic is NaN.

        Inputs are finite at masked positions (they never count: reductions weight by ``mask``); ``mask`` is 0/1 float;
        ``num_active`` [B, 1].
        """
        log_rho = rollout_log_ratio(
            old_logprobs, rollout_logprobs, "token"
        )  # [B, T], NaN for a bad sampler value
        if self.divergence == "k1":
            token_stat = -log_rho
        elif self.divergence == "k2":
            token_stat = 0.5 * log_rho.square()
        elif self.divergence == "k3":
            token_stat = torch.expm1(log_rho) - log_rho
        else:
            token_stat = log_rho
        active = mask > 0
        if self.level == "token":
            stat = token_stat  # [B, T]
        elif self.level == "sequence-max":
            largest = torch.where(active, token_stat, -math.inf).amax(dim=-1, keepdim=True)  # [B, 1]
            stat = torch.where(num_active > 0, largest, 0.0)
        else:
            stat = masked_sequence_sum(token_stat, mask)  # [B, 1]
            if self.level == "sequence-mean":
                stat = stat / num_active.clamp(min=1)
        if self.divergence == "ratio":
            low = None if self.low is None else math.log(self.low)
            high = None if self.high is None else math.log(self.high)
        else:
            low, high = self.low, self.high
        rejected = torch.zeros_like(stat, dtype=torch.bool)
        if low is not None:
            rejected = rejected | (stat < low)
        if high is not None:
            rejected = rejected | (stat > high)
        if self.veto is not None:
            smallest = torch.where(active, log_rho, math.inf).amin(dim=-1, keepdim=True)  # [B, 1]
            rejected = rejected | (smallest < math.log(self.veto))
        return torch.where(torch.isnan(stat), math.nan, (~rejected).to(stat.dtype))


Correction = ImportanceCorrection | OPSM | Reject

#: the key of the IS weights' batch mean in ``PolicyLoss.batch_state`` / ``state=``
IS_WEIGHT_MEAN = "is_weight/batch_mean"
#: verl's guard: a batch mean at or below this is not divided by (the weights stay as they are)
SELF_NORMALIZE_FLOOR = 1e-8


def is_weight_mean(
    log_weight: torch.Tensor, level: str, mask: torch.Tensor, num_active: torch.Tensor
) -> torch.Tensor:
    """``Σ w / n`` over the batch: the divisor of a self-normalised IS weight, 0-dim, detached.

    ``w = exp(log w)`` after truncation or masking: a weight MIS masks out (``log w = -inf``)
    is 0 and counts in ``n``. ``n`` counts active tokens (``level="token"``, ``log_weight``
    [B, T]) or sequences with at least one active token (``"sequence"``, [B, 1]): verl's
    ``rollout_is_batch_normalize`` (``rollout_corr_helper.compute_rollout_correction_weights``,
    before any rejection mask). NaN stays NaN. Over micro-batches or ranks compute it once on
    the global batch (``PolicyLoss.batch_state``) and pass it as ``state=``.

    Args:
        log_weight: [B, T] or [B, 1], the correction's ``log_weight``.
        level: the correction's level.
        mask: [B, T] 0/1 float. num_active: [B, 1] active tokens per row.
    """
    where = mask > 0 if level == "token" else num_active > 0  # [B, T] or [B, 1]
    weight = torch.where(where, torch.exp(log_weight.detach()), 0.0)
    return weight.sum() / where.sum().clamp(min=1)


def self_normalized(log_weight: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``log(w / mean)``, or ``log w`` when ``mean <= 1e-8`` (verl's guard), without a host read.

    Args:
        log_weight: [B, T] or [B, 1]. mean: 0-dim, from :func:`is_weight_mean`.
    """
    divisor = torch.where(mean <= SELF_NORMALIZE_FLOOR, 1.0, mean)  # NaN stays NaN
    return log_weight - torch.log(divisor).to(log_weight.dtype)


def as_corrections(correction: object) -> tuple[Correction, ...]:
    """``PolicyLoss(correction=...)`` as a tuple: None, one correction or a sequence of them, at
    most one of each kind (one IS correction, one OPSM, one Reject)."""
    if correction is None:
        return ()
    items = tuple(correction) if isinstance(correction, (list, tuple)) else (correction,)
    for item in items:
        if not isinstance(item, (ImportanceCorrection, OPSM, Reject)):
            raise ValueError(
                f"correction must be TIS, MIS, OPSM, Reject or a list of them, got {type(item).__name__}"
            )
    if sum(isinstance(item, ImportanceCorrection) for item in items) > 1:
        raise ValueError(
            f"correction may hold at most one importance correction (TIS or MIS), got {list(items)}"
        )
    for kind in (OPSM, Reject):
        if sum(isinstance(item, kind) for item in items) > 1:
            raise ValueError(f"correction may hold at most one {kind.__name__}, got {list(items)}")
    return items


def fold_log_weight(
    log_ratio: torch.Tensor,
    log_weight: torch.Tensor,
    correction_level: str,
    mask: torch.Tensor,
    level: str,
    num_active: torch.Tensor,
) -> torch.Tensor:
    """Add a correction's log-weight into a sequence-level log-ratio (VESPO's folding).

    ``log W += Σ_t m·clamp(log w_t, log 1e-8, ·)`` for a token correction, or
    ``+= log w_i`` for a sequence one (at ``sequence-mean`` level both are divided
    by the sequence length, the same normalisation as the ratio). The floor at
    ``log 1e-8`` (VESPO's W floor) turns a masked-out MIS token (``-inf``) into a
    finite, vanishing weight.

    Args:
        log_ratio: [B, 1] sequence-level log-ratio (differentiable).
        log_weight: [B, T] (token correction) or [B, 1] (sequence correction), detached.
        correction_level: ``"token"`` or ``"sequence"``, the correction's level.
        mask: [B, T] 0/1 float mask.
        level: the method's level, ``"sequence-sum"`` or ``"sequence-mean"``.
        num_active: [B, 1] active tokens per row.
    """
    log_weight = log_weight.clamp(min=VESPO_LOG_W_FLOOR)
    if correction_level == "token":
        log_weight = masked_sequence_sum(log_weight, mask)  # [B, 1]
    if level == "sequence-mean":
        log_weight = log_weight / num_active.clamp(min=1)
    return log_ratio + log_weight
