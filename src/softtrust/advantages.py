"""Group-relative advantages from scalar rewards.

Rewards come as a flat [B] tensor where each run of ``group_size`` consecutive
entries holds the G completions of one prompt.

| scale     | advantage                               | used by |
| --------- | --------------------------------------- | ------- |
| ``group`` | ``(R - mean_group) / (std_group + ε)``  | GRPO (DeepSeekMath) |
| ``batch`` | ``(R - mean_group) / (std_batch + ε)``  | Lite-PPO / TRL ``scale_rewards="batch"`` |
| ``none``  | ``R - mean_group``                      | Dr. GRPO |

Standard deviations are the unbiased (n - 1) estimate, as TRL uses. The other estimators:

| function                     | advantage | paper |
| ---------------------------- | --------- | ----- |
| :func:`rloo_advantages`      | ``R_i - mean_{j≠i} R_j = G/(G-1)·(R_i - mean_group)`` (then scaled as above) | RLOO, 2402.14740 |
| :func:`reinforce_pp_advantages` | ``R - mean_group``, whitened over the batch's tokens | REINFORCE++, 2501.03262 |
| :func:`passk_advantages`     | the k-subset max reward's group advantage, averaged over the subsets holding the response | Pass@k Training, 2508.10751 |
"""

from __future__ import annotations

import math

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


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, scale: str = "none", eps: float = 1e-4
) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other G-1 rewards of its group.

    Args:
        rewards: [B] rewards, B a multiple of ``group_size``, groups consecutive.
        group_size: G >= 2.
        scale: ``"none"`` (RLOO as published), or ``"group"`` / ``"batch"``: divided by the
            group's / the batch's reward std + ε, as :func:`group_advantages` scales.
        eps: ε >= 0.

    Returns:
        [B] advantages, ``G/(G-1)·(R_i - mean_group)`` (divided by ``std + ε`` when scaled).

    References:
        Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization", arXiv:2402.14740.
    """
    check_choice("scale", scale, ADVANTAGE_SCALES)
    check_number("eps", eps, low=0.0)
    grouped = _grouped(rewards, group_size)  # [num_groups, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)) * (group_size / (group_size - 1))
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    elif scale == "batch":
        centred = centred / (grouped.std() + eps)
    return centred.reshape(-1)  # [B]


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, mask: torch.Tensor, eps: float = 1e-8
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: rewards centred on their group's mean, then whitened
    over the batch's tokens.

    With ``A_i = R_i - mean_group`` and ``n_i`` the active tokens of row i (``N = Σ n_i``), every
    token of a row carries ``A_i``, and the batch's token statistics whiten it::

        μ = Σ n_i·A_i / N,   σ² = Σ n_i·(A_i - μ)² / (N - 1),   Â_i = (A_i - μ) / sqrt(σ² + ε)

    Long rows weigh more in μ and σ (a token-weighted whitening over the global batch, not
    ``group_advantages(scale="batch")``'s std over rows without re-centring). Pass the whole
    batch the advantages are normalised over (a trainer's rollout, every rank's rows).

    Args:
        rewards: [B] rewards, B a multiple of ``group_size``, groups consecutive.
        group_size: G >= 2.
        mask: [B, T] bool or 0/1: each row's completion tokens (only its row sums are read).
        eps: ε > 0 under the square root (verl's 1e-8).

    Returns:
        [B] advantages, one per row (0 for a row without active tokens); ``N - 1`` is taken
        as at least 1.

    References:
        Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        arXiv:2501.03262; verl's ``reinforce_plus_plus_baseline`` (``masked_whiten``).
    """
    check_number("eps", eps, low=0.0, low_inclusive=False)
    grouped = _grouped(rewards, group_size)  # [num_groups, G]
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != rewards.shape[0]:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must have shape (B, T) with B = {rewards.shape[0]} rows, got {shape}")
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)  # [B]
    tokens = (mask != 0).sum(dim=1).to(centred.dtype)  # [B] n_i
    total = tokens.sum()
    mean = (tokens * centred).sum() / total.clamp(min=1)
    variance = (tokens * (centred - mean).square()).sum() / (total - 1).clamp(min=1)
    whitened = (centred - mean) * torch.rsqrt(variance + eps)  # [B]
    return torch.where(tokens > 0, whitened, 0.0)


def passk_advantages(rewards: torch.Tensor, group_size: int, k: int) -> torch.Tensor:
    """Pass@k advantages: each response's share of the group advantage of the k-subsets holding it.

    A k-subset S of a group of G responses scores its best reward, ``R_S = max_{i∈S} R_i``.
    Over the ``C(G, k)`` subsets, equally likely, with ``R̄ = E[R_S]`` and ``σ = std(R_S)``
    (population), response i's advantage is the mean normalised advantage of the subsets that
    hold it::

        Â_i = (E[R_S | i ∈ S] - R̄) / σ        (0 when σ = 0)

    computed exactly from sorted rewards (``P(max = r_(j)) = C(j-1, k-1)/C(G, k)``). For 0/1
    rewards with ``N_neg`` failures this is the paper's analytical form::

        R̄ = 1 - C(N_neg, k)/C(G, k),   σ = sqrt(R̄(1 - R̄)),
        Â_pos = (1 - R̄)/σ,   Â_neg = (1 - R̄ - C(N_neg - 1, k - 1)/C(G - 1, k - 1))/σ

    so a failure in a group that passes at k is pushed down less than under GRPO, and
    ``k = 1`` is GRPO with the population std. Graded rewards use the same max-of-k score.

    Args:
        rewards: [B] rewards, B a multiple of ``group_size``, groups consecutive.
        group_size: G >= 2.
        k: the subset size, an integer in [1, G - 1] (``k = G`` leaves one subset: σ = 0).

    Returns:
        [B] advantages (float32, or float64 for float64 rewards).

    References:
        Chen et al., "Pass@k Training for Adaptively Balancing Exploration and Exploitation of
        Large Reasoning Models", arXiv:2508.10751 (section 3, analytical derivation).
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= group_size - 1:
        raise ValueError(f"k must be an integer in [1, group_size - 1] = [1, {group_size - 1}], got {k!r}")
    grouped = _grouped(rewards, group_size)  # [num_groups, G]
    size, dtype = group_size, grouped.dtype
    # shifted by the group's minimum (the advantage is shift-invariant): a constant group is 0
    # exactly, so its σ is 0, not the rounding of Σ p = 1
    grouped = grouped - grouped.amin(dim=1, keepdim=True)
    ordered = grouped.sort(dim=1).values  # [num_groups, G] ascending
    # P(max of a random k-subset = the j-th smallest), j = 1..G
    p_max = torch.tensor(
        [math.comb(j - 1, k - 1) / math.comb(size, k) for j in range(1, size + 1)], dtype=dtype
    )
    mean = (ordered * p_max).sum(dim=1, keepdim=True)  # [num_groups, 1] R̄
    std = ((ordered - mean).square() * p_max).sum(dim=1, keepdim=True).sqrt()  # two-pass: no cancellation
    # E[max(R_i, max T)] for T a random (k-1)-subset of the other G-1 responses
    if k == 1:
        holding = grouped
    else:
        others = _others(grouped).sort(dim=2).values  # [num_groups, G, G-1] ascending
        p_rest = torch.tensor(
            [math.comb(j - 1, k - 2) / math.comb(size - 1, k - 1) for j in range(1, size)], dtype=dtype
        )
        holding = (torch.maximum(others, grouped.unsqueeze(2)) * p_rest).sum(dim=2)  # [num_groups, G]
    advantages = torch.where(std > 0, (holding - mean) / torch.where(std > 0, std, 1.0), 0.0)
    return advantages.reshape(-1)  # [B]


def _others(grouped: torch.Tensor) -> torch.Tensor:
    """[n, G] -> [n, G, G-1]: for each member, the other members of its group, in order."""
    size = grouped.shape[1]
    keep = ~torch.eye(size, dtype=torch.bool)  # [G, G]: row i drops column i
    return grouped.unsqueeze(1).expand(-1, size, -1)[:, keep].reshape(grouped.shape[0], size, size - 1)
