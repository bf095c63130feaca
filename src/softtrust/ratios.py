"""Importance ratios at the three levels a policy loss can use.

Notation (METHODS.md): ``logp = log π_θ``, ``old = log μ`` (the behaviour policy),
``m`` the completion mask, ``log r_t = logp_t - old_t``.

| level           | value                                   | shape   | used by            |
| --------------- | --------------------------------------- | ------- | ------------------ |
| ``token``         | ``log r_t``                             | [B, T]  | PPO/GRPO, CISPO, SAPO, PSPO, CFPO |
| ``sequence-mean`` | ``log s_i = Σ_t m·log r_t / Σ_t m``     | [B, 1]  | GSPO, GMPO         |
| ``sequence-sum``  | ``log W_i = Σ_t m·log r_t``             | [B, 1]  | VESPO              |

Sequence levels are kept as [B, 1] and broadcast against [B, T] tensors, so a
sequence-level method does O(B) work for its ratio. The gradient flows through the
sum or the mean: ``∂ log s_i / ∂ logp_t = m_t / Σ m`` and ``∂ log W_i / ∂ logp_t = m_t``.

Every log-ratio is clamped to ``[-clamp, clamp]`` before any ``exp`` (default 20,
``e^20 ≈ 4.9e8``): beyond it the ratio is astronomically off-policy, every method
has already saturated, and the clamp keeps ``exp`` finite in float32. Inside the
clamp the gradient is exact; outside it is zero.

Masks here are float tensors of 0.0/1.0 (``PolicyLoss`` converts bool masks once).
Multiplying by them is safe because :class:`~softtrust.PolicyLoss` has already
replaced every masked input entry by exactly 0, so every value computed at a masked
position is finite (``0 * inf`` cannot occur); a float multiply is also several
times faster than ``torch.where`` with a bool condition on CPU.
"""

from __future__ import annotations

import torch

from softtrust._validation import check_choice

LEVELS = ("token", "sequence-mean", "sequence-sum")
DEFAULT_LOG_RATIO_CLAMP = 20.0


def masked_sequence_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_t m·x`` per row, [B, T] -> [B, 1], for ``x`` finite at masked positions and a 0/1 float mask."""
    return (x * mask).sum(dim=-1, keepdim=True)  # [B, 1]


def token_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    clamp: float = DEFAULT_LOG_RATIO_CLAMP,
) -> torch.Tensor:
    """``clamp(logp - old, -c, c)``: the clamped token log-ratio.

    Args:
        logprobs: [B, T] current-policy log-probs (differentiable), 0 at masked positions.
        old_logprobs: [B, T] behaviour log-probs, 0 at masked positions.
        mask: [B, T] 0/1 float completion mask (unused: zeroed inputs give 0 there already).
        clamp: the bound ``c`` applied before any ``exp``.

    Returns:
        [B, T] clamped log-ratio, exactly 0 at masked positions (both inputs are 0
        there), so masked positions never reach a sum and get zero gradient.
    """
    del mask  # masked positions are already 0 - 0
    return (logprobs - old_logprobs).clamp(-clamp, clamp)  # [B, T]


def level_log_ratio(
    token_log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    clamp: float = DEFAULT_LOG_RATIO_CLAMP,
    num_active: torch.Tensor | None = None,
) -> torch.Tensor:
    """The log-ratio at ``level`` from the (clamped, masked) token log-ratio.

    Args:
        token_log_ratio: [B, T] from :func:`token_log_ratio` (0 at masked positions).
        mask: [B, T] 0/1 float mask.
        level: ``"token"``, ``"sequence-mean"`` or ``"sequence-sum"``.
        clamp: bound applied to the sequence sum, so ``exp(log W)`` stays finite.
        num_active: optional [B, 1] count of active tokens per row (saves a pass).

    Returns:
        [B, T] for ``token``; [B, 1] for the sequence levels. A row with no active
        token gets log-ratio 0 (ratio 1), never 0/0.
    """
    check_choice("level", level, LEVELS)
    if level == "token":
        return token_log_ratio
    total = token_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
    if level == "sequence-sum":
        return total.clamp(-clamp, clamp)  # [B, 1]; a product of T ratios can overflow exp
    if num_active is None:
        num_active = mask.sum(dim=-1, keepdim=True)  # [B, 1]
    return total / num_active.clamp(min=1)  # [B, 1]; clamp(min=1): empty rows give 0, not NaN


def sequence_log_weight(token_log_ratio: torch.Tensor) -> torch.Tensor:
    """``log W_i = Σ_t m·log r_t`` (the log of the product of token ratios), [B, T] -> [B, 1].

    Unclamped at the sequence level: used for diagnostics (staleness shows up here
    first) and for the effective sample size.
    """
    return token_log_ratio.sum(dim=-1, keepdim=True)  # [B, 1]
