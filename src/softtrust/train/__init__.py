"""The off-policy GRPO trainer behind ``softtrust train`` (see docs/training.md).

``train(TrainConfig(...))`` runs a whole job and returns its summary; the modules hold
the parts: ``config``, ``tasks``, ``tiny``, ``rollout``, ``staleness`` (the ``RolloutSource``
schedules), ``learner``, ``state`` (``TrainState``), ``checkpoint``, ``runlog``, ``warmstart``,
``distributed`` (torchrun, DDP, FSDP2), ``trainer`` (the loop).
"""

from softtrust.train.config import TrainConfig
from softtrust.train.tasks import TASKS
from softtrust.train.trainer import TrainingStopped, train

__all__ = ["TASKS", "TrainConfig", "TrainingStopped", "train"]
