"""Group-relative advantages (GRPO, batch-std, Dr. GRPO, RLOO)."""

from __future__ import annotations

import math

import pytest
import torch

import softtrust as st

pytestmark = pytest.mark.numerics  # closed forms: the outcome depends on float paths

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 0.0, 1.0], dtype=torch.float64)  # groups of 4


def test_group_scale_is_zscore_within_each_group():
    adv = st.group_advantages(REWARDS, 4, scale="group", eps=0.0).view(2, 4)
    grouped = REWARDS.view(2, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / grouped.std(1, keepdim=True)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(adv.sum(1), torch.zeros(2, dtype=torch.float64))


def test_group_scale_matches_hand_computed_values():
    adv = st.group_advantages(torch.tensor([1.0, 0.0]), 2, eps=0.0)
    # mean 0.5, unbiased std sqrt(0.5)
    assert adv.tolist() == pytest.approx([0.5 / 0.5**0.5, -0.5 / 0.5**0.5])


def test_batch_scale_divides_by_batch_std():
    adv = st.group_advantages(REWARDS, 4, scale="batch", eps=1e-4)
    grouped = REWARDS.view(2, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)).reshape(-1) / (REWARDS.std() + 1e-4)
    torch.testing.assert_close(adv, expected)


def test_none_scale_only_centres():
    adv = st.group_advantages(REWARDS, 4, scale="none")
    torch.testing.assert_close(
        adv, (REWARDS.view(2, 4) - REWARDS.view(2, 4).mean(1, keepdim=True)).reshape(-1)
    )


def test_constant_group_gets_zero_advantage():
    adv = st.group_advantages(torch.ones(6), 3)
    assert torch.all(adv == 0)


def test_rloo_is_reward_minus_mean_of_the_others():
    adv = st.rloo_advantages(REWARDS, 4)
    grouped = REWARDS.view(2, 4)
    others = (grouped.sum(1, keepdim=True) - grouped) / 3
    torch.testing.assert_close(adv, (grouped - others).reshape(-1))


def test_error_group_size_below_two():
    with pytest.raises(ValueError, match=r"group_size must be an integer >= 2, got 1"):
        st.group_advantages(REWARDS, 1)


def test_error_length_not_multiple_of_group_size():
    with pytest.raises(ValueError, match=r"rewards length 8 must be a multiple of group_size=3"):
        st.group_advantages(REWARDS, 3)


def test_error_rewards_not_1d():
    with pytest.raises(ValueError, match=r"rewards must be a 1-D tensor of shape \(B,\), got \(2, 4\)"):
        st.group_advantages(REWARDS.view(2, 4), 4)


def test_error_unknown_scale():
    with pytest.raises(ValueError, match=r"scale must be one of \['group', 'batch', 'none'\], got 'std'"):
        st.group_advantages(REWARDS, 4, scale="std")


def test_error_negative_eps():
    with pytest.raises(ValueError, match=r"eps must be >= 0.0, got -1"):
        st.group_advantages(REWARDS, 4, eps=-1)


# ---------------------------------------------------------------------- RLOO scaled
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_rloo_scaled_divides_by_the_std_as_group_advantages_does(scale):
    scaled = st.rloo_advantages(REWARDS, 4, scale=scale, eps=1e-4)
    grpo = st.group_advantages(REWARDS, 4, scale=scale, eps=1e-4)
    torch.testing.assert_close(scaled, grpo * 4 / 3)  # RLOO = G/(G-1)·(R - mean)


# ---------------------------------------------------------------------- REINFORCE++ (group baseline)
def ragged_mask(rows: int, width: int = 6, seed: int = 0) -> torch.Tensor:
    lengths = torch.randint(0, width + 1, (rows,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = width  # some row is full
    return torch.arange(width) < lengths[:, None]


def test_reinforce_pp_equals_verl_reinforce_plus_plus_baseline():
    pytest.importorskip("verl")
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_reinforce_plus_plus_baseline_outcome_advantage

    generator = torch.Generator().manual_seed(4)
    rewards = torch.rand(12, generator=generator, dtype=torch.float64).round(decimals=1)
    mask = ragged_mask(12, seed=4)
    mask[5] = False  # a row without tokens: verl zeroes it
    token_rewards = torch.zeros(12, 6, dtype=torch.float64)
    token_rewards[:, -1] = rewards  # an outcome reward: its row sum is the reward
    index = np.array([row // 3 for row in range(12)])  # G = 3
    expected, _ = compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards, mask.double(), index)
    advantages = st.reinforce_pp_advantages(rewards, 3, mask)
    # verl's masked_mean divides by (count + 1e-8), twice: relative differences of a few 1e-9
    torch.testing.assert_close(advantages.unsqueeze(1).expand(-1, 6)[mask], expected[mask], rtol=1e-7, atol=0)
    assert advantages[5] == 0
    # token-weighted: not the batch-std scale of group_advantages (the check can fail)
    assert not torch.allclose(advantages, st.group_advantages(rewards, 3, scale="batch"), atol=1e-3)


def test_reinforce_pp_whitens_over_tokens_in_closed_form():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # groups of 2: A = ±0.5, 0, 0
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]])  # n = 3, 1, 2, 2 (N = 8)
    centred = torch.tensor([0.5, -0.5, 0.0, 0.0], dtype=torch.float64)
    n = torch.tensor([3.0, 1.0, 2.0, 2.0], dtype=torch.float64)
    mean = (n * centred).sum() / 8  # 0.125
    variance = (n * (centred - mean) ** 2).sum() / 7
    expected = (centred - mean) / torch.sqrt(variance + 1e-8)
    torch.testing.assert_close(st.reinforce_pp_advantages(rewards, 2, mask), expected)
    weighted = (n * st.reinforce_pp_advantages(rewards, 2, mask)).sum()
    assert weighted.item() == pytest.approx(0.0, abs=1e-12)  # token-weighted mean 0


@pytest.mark.parametrize(
    ("mask", "message"),
    [
        (torch.ones(4), "mask must have shape"),
        (torch.ones(3, 2), "mask must have shape"),
        ([[1]], "mask must"),
    ],
)
def test_error_reinforce_pp_bad_mask(mask, message):
    with pytest.raises(ValueError, match=message):
        st.reinforce_pp_advantages(torch.zeros(4), 2, mask)


def test_error_reinforce_pp_bad_eps():
    with pytest.raises(ValueError, match="eps must be > 0"):
        st.reinforce_pp_advantages(torch.zeros(4), 2, torch.ones(4, 2), eps=0.0)


# ---------------------------------------------------------------------- Pass@k
def passk_by_enumeration(group: list[float], k: int) -> list[float]:
    """The definition: every k-subset scores its max; normalise over subsets; average per response."""
    import itertools
    import statistics

    subsets = list(itertools.combinations(range(len(group)), k))
    scores = {subset: max(group[i] for i in subset) for subset in subsets}
    mean = statistics.fmean(scores.values())
    std = statistics.pstdev(scores.values())
    if std == 0:
        return [0.0] * len(group)
    return [statistics.fmean((scores[s] - mean) / std for s in subsets if i in s) for i in range(len(group))]


@pytest.mark.parametrize(("size", "k"), [(4, 2), (8, 3), (8, 7), (6, 1), (16, 4)])
def test_passk_binary_rewards_follow_the_papers_analytical_form(size, k):
    rewards = (torch.rand(5 * size, generator=torch.Generator().manual_seed(size + k)) < 0.4).double()
    rewards[:size] = 0.0  # a group that never passes
    rewards[size : 2 * size] = 1.0  # one that always does
    advantages = st.passk_advantages(rewards, size, k).view(5, size)
    for group, adv in zip(rewards.view(5, size), advantages, strict=True):
        negatives = int((group == 0).sum())
        mean = 1 - math.comb(negatives, k) / math.comb(size, k)
        std = math.sqrt(mean * (1 - mean))
        if std == 0:
            assert torch.all(adv == 0)
            continue
        positive = (1 - mean) / std
        negative = (1 - mean - math.comb(negatives - 1, k - 1) / math.comb(size - 1, k - 1)) / std
        as64 = lambda value: torch.tensor(value, dtype=torch.float64)  # noqa: E731
        expected = torch.where(group == 1, as64(positive), as64(negative))
        torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("group", "k"), [([0.2, 1.0, 0.0, 0.6, 0.6], 2), ([3.0, -1.0, 0.5, 0.5, 2.0, 0.0], 3)]
)
def test_passk_graded_rewards_equal_the_subset_enumeration(group, k):
    rewards = torch.tensor(group, dtype=torch.float64)
    expected = torch.tensor(passk_by_enumeration(group, k), dtype=torch.float64)
    torch.testing.assert_close(st.passk_advantages(rewards, len(group), k), expected, rtol=1e-12, atol=1e-12)


def test_passk_at_one_is_grpo_with_the_population_std():
    grouped = REWARDS.view(2, 4)
    expected = (grouped - grouped.mean(1, keepdim=True)) / grouped.std(1, unbiased=False, keepdim=True)
    torch.testing.assert_close(st.passk_advantages(REWARDS, 4, 1), expected.reshape(-1))


@pytest.mark.parametrize("k", [0, 4, 2.0, True, -1])
def test_error_passk_k_out_of_range(k):
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, group_size - 1\] = \[1, 3\]"):
        st.passk_advantages(REWARDS, 4, k)
