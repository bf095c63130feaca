"""Verifiable tasks: prompts with checkable answers, a reward, and supervised targets.

A task is a small object with three jobs:

- ``sample(rng)`` draws one ``Problem`` (a prompt and its reference answer);
- ``reward(completion, answer)`` scores a decoded completion in [0, 1];
- ``target(problem)`` is the completion a supervised warm start teaches.

Built-in tasks live in the ``TASKS`` registry (``--task NAME``); a JSONL file of
``{"prompt": ..., "answer": ...}`` lines becomes a ``DatasetTask`` (``--dataset``)
scored by ``exact``, ``numeric`` or a user ``module:function`` reward; ``--task
reasoning-gym:NAME`` is a reasoning-gym generator scored by its own verifier
(``reasoning_gym_task.ReasoningGymTask``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path


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


def exact_reward(completion: str, answer: str) -> float:
    """1 if the completion equals the answer after stripping whitespace, else 0."""
    return float(completion.strip() == answer.strip())


def numeric_reward(completion: str, answer: str) -> float:
    """1 if both parse as numbers and agree to 1e-6 (relative), else 0."""
    try:
        got, want = float(completion.strip()), float(answer.strip())
    except ValueError:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def digit_partial_reward(completion: str, answer: str, partial_weight: float = 0.2) -> float:
    """1 for an exact answer, otherwise ``partial_weight`` x the fraction of correct positions.

    The partial credit gives a small model a gradient before it gets whole answers
    right: with a pure 0/1 reward and few prompts per step, learning stalls.
    """
    completion = completion.strip()
    if completion == answer:
        return 1.0
    correct = sum(a == b for a, b in zip(completion, answer, strict=False))
    return partial_weight * correct / max(len(answer), 1)


class AdditionTask:
    """``aaa+bbb=`` -> the zero-padded sum (``digits + 1`` characters), then end of sequence.

    The reward is 1 for the exact sum and 0.2 x the fraction of correct digits otherwise.
    """

    name = "addition"

    def __init__(self, digits: int = 3):
        self.digits = digits

    @property
    def num_problems(self) -> int:
        """Distinct problems: every ordered pair of ``digits``-digit operands."""
        return 10 ** (2 * self.digits)

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        width = self.digits
        return Problem(f"{a:0{width}d}+{b:0{width}d}=", f"{a + b:0{width + 1}d}")

    def reward(self, completion: str, answer: str) -> float:
        return digit_partial_reward(completion, answer)

    def target(self, problem: Problem) -> str:
        return problem.answer


class ScratchpadAdditionTask(AdditionTask):
    """Addition with a written carry scratchpad: long completions (tens of tokens).

    ``123+459=`` -> ``3+9=12,2+5+1=8,1+4=5|0582``: each column's sum from the right,
    then ``|`` and the zero-padded answer. Only the part after ``|`` is graded.
    """

    name = "scratchpad"

    def target(self, problem: Problem) -> str:
        a_text, b_text = problem.prompt[:-1].split("+")
        carry, steps = 0, []
        for a_digit, b_digit in zip(reversed(a_text), reversed(b_text), strict=True):
            total = int(a_digit) + int(b_digit) + carry
            steps.append(f"{a_digit}+{b_digit}" + (f"+{carry}" if carry else "") + f"={total}")
            carry = total // 10
        return ",".join(steps) + "|" + problem.answer

    def reward(self, completion: str, answer: str) -> float:
        _, _, final = completion.rpartition("|")
        return digit_partial_reward(final, answer)


class DatasetTask:
    """Problems drawn uniformly from a dataset (``data.read_records``: JSONL, JSON, CSV, Parquet
    or a ``datasets`` directory), scored by ``rewards.RewardSet``."""

    name = "dataset"

    def __init__(
        self,
        path: str | Path,
        reward: str = "exact",
        *,
        prompt_column: str = "prompt",
        answer_column: str = "answer",
        system_prompt: str | None = None,
        reward_weights: list | None = None,
        correctness_reward: str | None = None,
    ):
        from .data import problems_from_records, read_records
        from .rewards import RewardSet

        self.path = Path(path)
        self.rewards = RewardSet.parse(reward, reward_weights, correctness_reward)
        self.problems = problems_from_records(
            read_records(self.path),
            prompt_column,
            answer_column,
            system_prompt,
            need_answer=self.rewards.needs_answer,
        )

    @property
    def num_problems(self) -> int:
        """Distinct prompts in the dataset."""
        return len({problem.prompt for problem in self.problems})

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]

    def reward(self, completion: str, answer: str) -> float:
        """The correctness reward of one completion (per-sample rewards only; see ``RewardSet``)."""
        return self.rewards.single(completion, answer)

    def target(self, problem: Problem) -> str:
        return problem.answer


def read_jsonl_problems(path: Path) -> list[Problem]:
    """``{"prompt", "answer"}`` records of a JSONL file (``data.read_records``)."""
    from .data import problems_from_records, read_records

    return problems_from_records(read_records(path))


class SingleDigitAdditionTask(AdditionTask):
    """``a+b=`` -> two digits: an easy task that a tiny model learns from scratch in seconds."""

    name = "addition-1digit"

    def __init__(self):
        super().__init__(digits=1)


TASKS = {
    "addition": AdditionTask,
    "addition-1digit": SingleDigitAdditionTask,
    "scratchpad": ScratchpadAdditionTask,
}
REASONING_GYM = "reasoning-gym:"  # --task reasoning-gym:NAME names a reasoning-gym generator


def build_task(task: str, dataset: str | None = None, reward: str | None = "exact", **options):
    """The task a config names: a ``dataset`` if given (``options``: ``DatasetTask``'s keyword
    arguments; ``reward`` default ``exact``), a reasoning-gym generator for ``reasoning-gym:NAME``
    (``options``: ``ReasoningGymTask``'s; ``reward`` default ``task``), else the built-in ``task``."""
    if dataset is not None:
        return DatasetTask(dataset, reward or "exact", **options)
    if task is not None and task.startswith(REASONING_GYM):
        from .reasoning_gym_task import ReasoningGymTask

        return ReasoningGymTask(task[len(REASONING_GYM) :], reward=reward, **options)
    if task not in TASKS:
        raise ValueError(
            f"task: unknown task {task!r}; built-in tasks: {sorted(TASKS)}, or {REASONING_GYM}NAME"
        )
    return TASKS[task]()


def held_out_problems(task, count: int, seed: int) -> list[Problem]:
    """A fixed evaluation set (distinct problems when the task has enough of them); a task with its
    own ``held_out(count, seed)`` (a reasoning-gym generator) draws it itself."""
    if hasattr(task, "held_out"):
        return task.held_out(count, seed)
    rng = random.Random(seed)
    if isinstance(task, DatasetTask):
        pool = list(task.problems)
        rng.shuffle(pool)
        return pool[:count]
    seen, problems = set(), []
    for _ in range(count * 20):
        problem = task.sample(rng)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            problems.append(problem)
        if len(problems) == count:
            break
    return problems


def check_training_pool(task, held_out: list[Problem]) -> None:
    """Refuse a task whose every problem is held out (training would draw only evaluation problems).

    Raises ``ValueError`` naming ``eval_size`` with the task's number of distinct problems; a task
    with its own ``check_training_pool`` (a reasoning-gym generator) checks itself.
    """
    if hasattr(task, "check_training_pool"):
        task.check_training_pool(held_out)
        return
    distinct = task.num_problems
    held = len({problem.prompt for problem in held_out})
    if distinct - held < 1:
        raise ValueError(
            f"eval_size: the task has {distinct} distinct problems and the held-out set takes {held} of them, "
            f"leaving none to train on; pass --eval-size below {distinct} (or a larger dataset)"
        )
