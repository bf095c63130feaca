"""DAPO's rules for what a rollout holds (Yu et al., "DAPO: An Open-Source LLM Reinforcement
Learning System at Scale", arXiv 2503.14476), applied to each generation pass before advantages:

- ``overlong_penalty`` (``--overlong-penalty L_cache,penalty``): the soft overlong punishment,
  a reward that falls linearly over the last ``L_cache`` tokens before ``--max-new-tokens``.
- ``mask_truncated`` (``--mask-truncated``): a completion cut at ``--max-new-tokens`` gets a zero
  completion mask, so it adds no loss (DAPO's overlong filtering; TRL's
  ``mask_truncated_completions``). Its reward still counts in its group's advantages.
- ``GroupFilter`` (``--filter-groups``): dynamic sampling. A group whose G rewards are all equal
  has zero advantage everywhere; it is dropped and more groups are drawn until the rollout is
  full (verl's ``algorithm.filter_groups``).

``shape_rollout`` applies the first two to one pass, so the filter sees the rewards the
advantages are computed from (verl's default ``filter_groups.metric: reward``, which includes
its overlong penalty).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from .distributed import World
from .rollout import RolloutBatch, sampled_lengths, truncated_rows

if TYPE_CHECKING:
    from .config import TrainConfig


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, cache: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (its eq. 13), as verl's ``DAPORewardManager`` adds it.

    With ``L_max = max_new_tokens`` and ``L = lengths`` (tokens sampled, the end token included)::

        0                                          L <= L_max - L_cache
        -penalty * (L - (L_max - L_cache)) / L_cache    L_max - L_cache < L <= L_max

    so ``-penalty`` at the limit (the paper's -1 with ``penalty = 1``; verl's
    ``overlong_buffer.len`` and ``penalty_factor``). Written as verl writes it,
    ``min(-(L - (L_max - L_cache)) / L_cache * penalty, 0)``.

    Args:
        lengths: ``[B]`` completion lengths (<= ``max_new_tokens``).

    Returns:
        ``[B]`` float32 rewards to add (<= 0).
    """
    excess = lengths.to(torch.float64) - (max_new_tokens - cache)  # [B] tokens into the buffer
    return torch.clamp(-excess / cache * penalty, max=0.0).to(torch.float32)  # [B]


def mask_truncated(batch: RolloutBatch, end_ids: Sequence[int], max_new_tokens: int) -> RolloutBatch:
    """``batch`` with a zero completion mask on the completions cut at ``max_new_tokens``
    (``rollout.truncated_rows``: the limit reached without an end token), so they add no loss.

    TRL 1.16.0 (``mask_truncated_completions``) masks a completion whose last token is neither an
    end token nor the pad token; softtrust's sampler stops only at an end token, so a sampled pad
    token at the limit is a cut completion here (the one case where the two differ).
    ``attention_mask`` keeps the tokens (the forward is unchanged; only the loss ignores them)."""
    cut = truncated_rows(batch, end_ids, max_new_tokens)  # [B]
    kept = batch.completion_mask * (~cut).unsqueeze(1).to(batch.completion_mask.dtype)  # [B, T]
    return replace(batch, completion_mask=kept)


def shape_rollout(batch: RolloutBatch, config: TrainConfig, end_ids: Sequence[int]) -> RolloutBatch:
    """One generation pass with ``--overlong-penalty`` added to its rewards and ``--mask-truncated``
    applied to its completion mask (each only when set)."""
    limit = config.effective_max_new_tokens
    if config.overlong_penalty:
        cache, penalty = config.overlong_penalty
        shaped = batch.rewards + overlong_penalty(sampled_lengths(batch), limit, int(cache), penalty)
        batch = replace(batch, rewards=shaped)
    if config.mask_truncated:
        batch = mask_truncated(batch, end_ids, limit)
    return batch


def equal_rewards(rewards: torch.Tensor) -> bool:
    """Whether one group's ``[G]`` rewards are all equal (its advantages are then all 0)."""
    return bool((rewards == rewards[0]).all())


class GroupFilter:
    """DAPO's dynamic sampling: a rollout of groups whose rewards are not all equal.

    ``fill(draw, num_groups)`` asks ``draw`` for generation passes of ``num_groups`` new groups
    each (pass ``i``'s sampling keys are its own: ``trainer.rollout_generator``), drops every
    group whose G rewards are all equal, and stops once ``num_groups`` groups are kept, taking the
    first ones in draw order, or after ``max_draws`` passes. Then the rollout is filled up with the
    first dropped groups (zero advantage: as if unfiltered) and the trainer warns; with
    ``max_draws = 1`` the rollout is the first pass unchanged.

    Under ``torchrun`` every rank samples its own groups of each pass (``World.local_groups``);
    every rank's rows are gathered, so all ranks see every group's rewards and keep the same
    groups, and each takes its share of the kept ones in the same layout (whole groups, ``m / P``
    of each mini-batch). The problem draws and sampling keys are the same on every rank and on
    resume (the problem sampler's state is in the checkpoint, the keys are (seed, rollout, pass,
    group)), so a filtered rollout is the same whatever the number of processes.
    """

    def __init__(self, max_draws: int, group_size: int, groups_per_step: int, world: World | None = None):
        self.max_draws = max_draws
        self.group_size = group_size
        self.groups_per_step = groups_per_step  # m: the layout of World.local_groups
        self.world = world or World()

    def fill(self, draw: Callable[[int], RolloutBatch], num_groups: int) -> RolloutBatch:
        """This rank's rows of a rollout of ``num_groups`` groups; ``draw(i)`` returns this rank's
        rows of pass ``i`` (its ``World.local_groups`` of ``num_groups``, in that order).
        ``sampling`` on the result counts the passes and the groups drawn, dropped and filled."""
        kept, dropped, passes = [], [], 0
        while len(kept) < num_groups and passes < self.max_draws:
            for index, group in enumerate(self.every_group(draw(passes), num_groups)):
                (dropped if equal_rewards(group.rewards) else kept).append((passes, index, group))
            passes += 1
        filled = max(num_groups - len(kept), 0)
        chosen = sorted(kept[:num_groups] + dropped[:filled], key=lambda item: item[:2])  # draw order
        mine = self.world.local_groups(num_groups, self.groups_per_step)
        batch = RolloutBatch.concat([chosen[group][2] for group in mine])
        batch.sampling = {
            "draws": passes,
            "groups_drawn": passes * num_groups,
            "groups_dropped": len(dropped),
            "groups_filled": filled,
        }
        return batch

    def every_group(self, local: RolloutBatch, num_groups: int) -> list[RolloutBatch]:
        """Every rank's groups of one pass, in global order (one process: this rank's own)."""
        size = self.group_size
        groups: list = [None] * num_groups
        for rank, batch in enumerate(self.world.gather_objects(local)):
            owned = self.world.local_groups(num_groups, self.groups_per_step, rank=rank)
            for position, group in enumerate(owned):
                groups[group] = batch.rows(position * size, (position + 1) * size)
        return groups


def check_group_filter(config: TrainConfig, world: World) -> None:
    """``--filter-groups`` under ``torchrun`` gathers every rank's groups, a collective; the
    concurrent async worker would run it from its own thread beside the learner's collectives."""
    if config.filter_groups and world.distributed and config.mode == "async" and not config.lag_schedule:
        raise ValueError(
            "filter_groups: under torchrun dynamic sampling gathers every rank's rewards, which the "
            "concurrent async worker would do from its own thread beside the learner's collectives; "
            "use --mode sync, --lag-schedule (async without concurrency) or one process"
        )
