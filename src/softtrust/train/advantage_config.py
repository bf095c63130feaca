"""The advantages a ``softtrust train`` config describes: ``--advantages``, ``--advantage-scale``
and ``--passk-k``, computed over a whole rollout (``trainer.rollout_advantages`` gathers every
rank's rows first)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import softtrust as st

if TYPE_CHECKING:
    from .config import TrainConfig

ADVANTAGE_SCALES = ("group", "batch", "none")
ADVANTAGE_ESTIMATORS = ("group", "rloo", "reinforce++", "passk")


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


def check_advantage_options(config: TrainConfig, need) -> None:
    """``--advantages``, ``--advantage-scale`` and ``--passk-k`` together: known names, a scale only
    for the estimators it scales, ``--passk-k`` exactly with ``passk`` and below the group size.
    ``need(condition, field, message)`` raises the config's ``ValueError`` naming the field."""
    need(config.advantages in ADVANTAGE_ESTIMATORS, "advantages", f"choose one of {ADVANTAGE_ESTIMATORS}")
    scaled = config.advantages in ("group", "rloo")
    need(
        config.advantage_scale is None or config.advantage_scale in ADVANTAGE_SCALES,
        "advantage_scale",
        f"choose one of {ADVANTAGE_SCALES}",
    )
    need(
        config.advantage_scale is None or scaled,
        "advantage_scale",
        f"--advantages {config.advantages} normalises its advantages itself (reinforce++: whitened over the "
        "rollout's tokens; passk: by its subsets' std); drop --advantage-scale",
    )
    need(
        (config.passk_k is not None) == (config.advantages == "passk"),
        "passk_k",
        "--advantages passk needs --passk-k, and --passk-k is for --advantages passk only",
    )
    need(
        config.passk_k is None or config.passk_k < config.group_size,
        "passk_k",
        f"must be below --group-size {config.group_size} (k = G leaves one subset: every advantage 0)",
    )
