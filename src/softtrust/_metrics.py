"""How a metric is combined across data-parallel ranks: one rule for the trainer and the TRL adapter."""

from __future__ import annotations


def reduction_of(name: str) -> str:
    """``"max"`` for ``.../max``, ``"min"`` for ``.../min``, ``"mean"`` for every other metric
    (means, fractions, effective sample sizes)."""
    if name.endswith("/max"):
        return "max"
    if name.endswith("/min"):
        return "min"
    return "mean"
