"""``TrainState``: everything a training run changes as it goes, i.e. what a checkpoint saves."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from .learner import Learner
from .rollout import ProblemSampler
from .staleness import RolloutSource

COUNTERS = (
    "nonfinite_skips",
    "nonfinite_in_a_row",
    "reward_failures",
    "completion_tokens",
    "accuracy_before",
    "score_before",
)


@dataclass
class TrainState:
    """The learner (weights, optimizer, scheduler), the rollout source, the problem sampler's
    random stream, the step and the running counters. ``checkpoint.save_state`` writes it and
    ``checkpoint.restore_state`` reads it back."""

    learner: Learner
    rollouts: RolloutSource
    sampler: ProblemSampler
    step: int = 0
    nonfinite_skips: int = 0
    nonfinite_in_a_row: int = 0
    reward_failures: int = 0
    completion_tokens: int = 0
    accuracy_before: float = math.nan
    score_before: float = math.nan

    def count_update(self, skipped: bool) -> None:
        """Count an update: a skipped one (non-finite loss or gradient) adds to both skip counters,
        a taken one resets the run of skips."""
        self.nonfinite_skips += int(skipped)
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0

    def counters(self) -> dict:
        """The running totals (plain numbers: a checkpoint stores them as they are)."""
        return {name: getattr(self, name) for name in COUNTERS}

    def load_counters(self, counters: dict) -> None:
        known = {f.name for f in fields(self)}
        for name, value in counters.items():
            if name in known and name in COUNTERS:
                setattr(self, name, value)
