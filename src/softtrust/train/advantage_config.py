"""The advantages a ``softtrust train`` config describes: ``--advantages``, ``--advantage-scale``
and ``--passk-k``, computed over a whole rollout (``trainer.rollout_advantages`` gathers every
rank's rows first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import softtrust as st

if TYPE_CHECKING:
    from .config import TrainConfig


def advantages_of(rewards: torch.Tensor, lengths: torch.Tensor, config: TrainConfig) -> torch.Tensor:
    """``[rows]`` advantages of a whole rollout's ``rewards`` (``[rows]``, groups of
    ``config.group_size`` consecutive rows) with ``lengths`` (``[rows]``, each row's completion
    tokens: REINFORCE++ whitens over them):

    | ``--advantages`` | function | scale |
    | --- | --- | --- |
    | ``group`` | ``st.group_advantages`` | ``--advantage-scale`` (default ``group``: GRPO; ``none``: Dr. GRPO) |
    | ``rloo`` | ``st.rloo_advantages`` | ``--advantage-scale`` (default ``none``: RLOO) |
    | ``reinforce++`` | ``st.reinforce_pp_advantages`` | its own token-weighted whitening |
    | ``passk`` | ``st.passk_advantages(k=--passk-k)`` | its own subsets' std |
    """
    group_size, scale = config.group_size, config.effective_advantage_scale
    if config.advantages == "group":
        return st.group_advantages(rewards, group_size, scale=scale)
    if config.advantages == "rloo":
        return st.rloo_advantages(rewards, group_size, scale=scale)
    if config.advantages == "reinforce++":
        width = int(lengths.max()) if lengths.numel() else 0
        mask = torch.arange(width) < lengths[:, None]  # [rows, width]: only its row sums are read
        return st.reinforce_pp_advantages(rewards, group_size, mask)
    return st.passk_advantages(rewards, group_size, config.passk_k)
