"""Importance ratios at the three levels a policy loss can use.

Notation (METHODS.md): ``logp = log π_θ``, ``old = log μ`` (the behaviour policy),
``m`` the completion mask, ``log r_t = logp_t - old_t``.

| level           | value                                   | shape   | used by            |
| --------------- | --------------------------------------- | ------- | ------------------ |
| ``token``         | ``log r_t``                             | [B, T]  | PPO/GRPO, CISPO, SAPO, PSPO, CFPO |
| ``sequence-mean`` | ``log s_i = Σ_t m·log r_t / Σ_t m``     | [B, 1]  | GSPO, GMPO         |
| ``sequence-sum``  | ``log W_i = Σ_t m·log r_t``             | [B, 1]  | VESPO              |
| ``sequence-mean-token`` | ``log s_i`` in value; ``∂/∂logp_t = 1`` | [B, T] | GSPO-token (verl's ``gspo``) |

Sequence levels are kept as [B, 1] and broadcast against [B, T] tensors, so a
sequence-level method does O(B) work for its ratio. The gradient flows through the
sum or the mean: ``∂ log s_i / ∂ logp_t = m_t / Σ m`` and ``∂ log W_i / ∂ logp_t = m_t``.

``sequence-mean-token`` is GSPO-token (Zheng et al., arXiv:2507.18071, eq. 13):
``log s_i,t = sg(log s_i) + logp_t - sg(logp_t)``, the sequence-mean value on every token
with the gradient of the token's own log-prob. With a per-sequence advantage and no
per-token factor it gives GSPO's value and gradient; with a per-token factor (token
advantages, a token-level behaviour weight) token t's gradient carries its own factor,
where ``sequence-mean`` gives every token of the row the row's mean factor.

Every log-ratio is clamped to ``[-clamp, clamp]`` before any ``exp`` (default 20,
``e^20 ≈ 4.9e8``): beyond it the ratio is astronomically off-policy, every method
has already saturated, and the clamp keeps ``exp`` finite in float32. Inside the
clamp the gradient is exact; outside it is zero.

Inputs here are already zero at masked positions (:class:`~softtrust.PolicyLoss`
selects them with ``torch.where``, so a masked inf or NaN never reaches a value).

A recorded log-prob that is not finite at an active position (a NaN or inf in
``old_logprobs`` or ``rollout_logprobs``) is invalid input. Clamping it would turn it
into a finite, wrong ratio of e^±20, so :func:`clamped_log_ratio` makes that log-ratio
NaN instead: the loss comes out non-finite and the trainer's guard skips the step.
(With value checks on, :class:`~softtrust.PolicyLoss` raises a ``ValueError`` first.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from softtrust._validation import check_choice

#: sequence levels that keep one log-ratio per sequence, [B, 1]
SEQUENCE_LEVELS = ("sequence-mean", "sequence-sum")
LEVELS = ("token", *SEQUENCE_LEVELS, "sequence-mean-token")
DEFAULT_LOG_RATIO_CLAMP = 20.0


def masked_sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t m·x`` per row, [B, T] -> [B, 1], for ``x`` finite at masked positions and a 0/1 float mask."""
    return (x * mask).sum(dim=-1, keepdim=True)  # [B, 1]


def clamp_log_ratio(log_ratio: torch.Tensor, clamp: float = DEFAULT_LOG_RATIO_CLAMP) -> torch.Tensor:
    """``log_ratio`` clamped to ``[-c, c]``, with one fused backward kernel.

    The value is ``torch.clamp``'s. The gradient is 1 strictly inside the bounds and 0
    at and beyond them (``torch.clamp``'s is also 1 at the bounds; a set of measure zero).
    It is ``hardtanh``: on the CPU ``torch.clamp``'s backward runs four passes over bool
    tensors, which made it the largest single cost of a ratio method's loss (fwd + bwd
    of [128, 1024]: 658 µs against 77 µs, one thread).
    """
    return F.hardtanh(log_ratio, -clamp, clamp)


def clamped_log_ratio(
    logprobs: torch.Tensor, recorded: torch.Tensor, clamp: float = DEFAULT_LOG_RATIO_CLAMP
) -> torch.Tensor:
    """``clamp(logprobs - recorded, -c, c)``, and NaN where ``recorded`` is not finite.

    Args:
        logprobs: [B, T] log-probs (differentiable or not), 0 at masked positions.
        recorded: [B, T] recorded log-probs (behaviour, sampler or reference), 0 at masked positions.
        clamp: the bound ``c`` applied before any ``exp``.

    Returns:
        [B, T]. Exactly 0 at masked positions. Inside the clamp the gradient is exact,
        outside it is 0. A non-finite ``logprobs`` entry passes through the clamp as
        usual (-inf becomes -c: the current policy gives the token no mass); a
        non-finite ``recorded`` one gives NaN (see the module docstring).
    """
    return torch.where(torch.isfinite(recorded), clamp_log_ratio(logprobs - recorded, clamp), math.nan)


def level_log_ratio(
    token_log_ratio: torch.Tensor,
    level: str,
    num_active: torch.Tensor,
    clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """The log-ratio at ``level`` from the clamped token log-ratio (0 at masked positions).

    Args:
        token_log_ratio: [B, T] from :func:`clamped_log_ratio`.
        level: one of :data:`LEVELS`.
        num_active: [B, 1] count of active tokens per row.
        clamp: bound applied to the sequence sum, so ``exp(log W)`` stays finite.

    Returns:
        [B, T] for ``token`` and ``sequence-mean-token``; [B, 1] for the sequence
        levels. A row with no active token gets log-ratio 0 (ratio 1), never 0/0.
    """
    check_choice("level", level, LEVELS)
    if level == "token":
        return token_log_ratio
    total = token_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    if level == "sequence-sum":
        return clamp_log_ratio(total, clamp)  # [B, 1]; a product of T ratios can overflow exp
    mean = total / num_active.clamp(min=1)  # [B, 1]; clamp(min=1): empty rows give 0, not NaN
    if level == "sequence-mean":
        return mean
    return token_log_ratio - token_log_ratio.detach() + mean.detach()  # [B, T]: GSPO-token
