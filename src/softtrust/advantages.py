"""Group-relative advantages from scalar rewards.

Rewards come as a flat [B] tensor where each run of ``group_size`` consecutive
entries holds the G completions of one prompt.

| scale     | advantage                               | used by |
| --------- | --------------------------------------- | ------- |
| ``group`` | ``(R - mean_group) / (std_group + ε)``  | GRPO (DeepSeekMath) |
| ``batch`` | ``(R - mean_group) / (std_batch + ε)``  | Lite-PPO / TRL ``scale_rewards="batch"`` |
| ``none``  | ``R - mean_group``                      | Dr. GRPO |

Standard deviations are the unbiased (n - 1) estimate, as TRL uses. RLOO:
``A_i = R_i - mean_{j≠i} R_j = G/(G-1)·(R_i - mean_group)``.
"""

from __future__ import annotations

import torch

from softtrust._validation import check_choice, check_number

ADVANTAGE_SCALES = ("group", "batch", "none")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-D tensor of shape (B,), got {shape}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an integer >= 2, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards length {rewards.numel()} must be a multiple of group_size={group_size} "
            "(each run of group_size entries is one prompt's group)"
        )
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    return rewards.to(dtype).view(-1, group_size)  # [num_groups, G]


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """GRPO-style advantages: rewards centred on their group's mean, optionally scaled.

    Args:
        rewards: [B] rewards, B a multiple of ``group_size``, groups consecutive.
        group_size: G >= 2 completions per prompt.
        scale: ``"group"`` (GRPO), ``"batch"`` (std over the whole batch) or ``"none"`` (Dr. GRPO).
        eps: ε added to the standard deviation (>= 0).

    Returns:
        [B] advantages (float32, or float64 for float64 rewards). A group whose
        rewards are all equal gets advantage 0.

    References:
        Shao et al., arXiv:2402.03300; Liu et al., Dr. GRPO, arXiv:2503.20783.
    """
    check_choice("scale", scale, ADVANTAGE_SCALES)
    check_number("eps", eps, low=0.0)
    grouped = _grouped(rewards, group_size)  # [num_groups, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # [num_groups, G]
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (grouped.std() + eps)
    return centred.reshape(-1)  # [B]


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other G-1 rewards of its group.

    Returns:
        [B] advantages, ``G/(G-1)·(R_i - mean_group)``.

    References:
        Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization", arXiv:2402.14740.
    """
    grouped = _grouped(rewards, group_size)  # [num_groups, G]
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred * (group_size / (group_size - 1))).reshape(-1)  # [B]
