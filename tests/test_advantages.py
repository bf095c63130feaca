"""Group-relative advantages (GRPO, batch-std, Dr. GRPO, RLOO)."""

from __future__ import annotations

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
