"""``Problem``: one prompt with its reference answer, what tasks, datasets, rewards and the
rollout all speak of (its own module, so that none of them imports another for it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    Attributes:
        prompt: plain text, or a conversation as a tuple of ``(role, content)`` pairs (rendered
            with the tokenizer's chat template when encoded, ``rollout.prompt_texts``).
        answer: the reference answer as text (``""`` when a dataset has none).
        columns: a dataset record's other columns (the answer column included), passed to a
            custom reward as keyword arguments; not part of the problem's identity.
    """

    prompt: str | tuple
    answer: str
    columns: dict = field(default_factory=dict, compare=False, hash=False)
