"""Verifiable tasks: prompts with checkable answers, a reward, and supervised targets.

A task is a small object with three jobs:

- ``sample(rng)`` draws one ``Problem`` (a prompt and its reference answer);
- ``reward(completion, answer)`` scores a decoded completion in [0, 1];
- ``target(problem)`` is the completion a supervised warm start teaches.

Built-in tasks live in the ``TASKS`` registry (``--task NAME``); a JSONL file of
``{"prompt": ..., "answer": ...}`` lines becomes a ``DatasetTask`` (``--dataset``)
scored by ``exact``, ``numeric`` or a user ``module:function`` reward.
"""

from __future__ import annotations

import importlib
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RewardFn = Callable[[str, str], float]


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer (both plain text)."""

    prompt: str
    answer: str


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


def load_reward(spec: str) -> RewardFn:
    """``exact`` | ``numeric`` | ``module:function`` (a callable ``(completion, answer) -> float``)."""
    if spec == "exact":
        return exact_reward
    if spec == "numeric":
        return numeric_reward
    if ":" not in spec:
        raise ValueError(f"reward: expected 'exact', 'numeric' or 'module:function', got {spec!r}")
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward: cannot import {spec!r} ({error})") from error
    if not callable(function):
        raise ValueError(f"reward: {spec!r} is not callable")
    return function


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
    """Problems drawn uniformly from a JSONL file with ``prompt`` and ``answer`` fields."""

    name = "dataset"

    def __init__(self, path: str | Path, reward: str = "exact"):
        self.path = Path(path)
        self.problems = read_jsonl_problems(self.path)
        self.reward_fn = load_reward(reward)

    @property
    def num_problems(self) -> int:
        """Distinct prompts in the file."""
        return len({problem.prompt for problem in self.problems})

    def sample(self, rng: random.Random) -> Problem:
        return self.problems[rng.randrange(len(self.problems))]

    def reward(self, completion: str, answer: str) -> float:
        return self.reward_fn(completion, answer)

    def target(self, problem: Problem) -> str:
        return problem.answer


def read_jsonl_problems(path: Path) -> list[Problem]:
    """Read ``{"prompt", "answer"}`` lines; fail with the line number on a bad one.

    The prompt must be a non-empty string; the answer a string or a finite number (written as
    text). Anything else (null, a list, an object, a bool) is refused rather than stringified.
    """
    if not path.is_file():
        raise ValueError(f"dataset: {str(path)!r} is not a file")
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"dataset: {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error})") from error
        if not isinstance(record, dict) or "prompt" not in record or "answer" not in record:
            raise ValueError(f"{where}: expected a JSON object with 'prompt' and 'answer', got {line[:80]!r}")
        prompt, answer = record["prompt"], record["answer"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
        if isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer):
            answer = str(answer)
        if not isinstance(answer, str):
            raise ValueError(f"{where}: 'answer' must be a string or a finite number, got {answer!r}")
        problems.append(Problem(prompt, answer))
    if not problems:
        raise ValueError(f"dataset: {path} holds no problems")
    return problems


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


def build_task(task: str, dataset: str | None = None, reward: str = "exact"):
    """The task a config names: a JSONL ``dataset`` if given, else the built-in ``task``."""
    if dataset is not None:
        return DatasetTask(dataset, reward)
    if task not in TASKS:
        raise ValueError(f"task: unknown task {task!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[task]()


def held_out_problems(task, count: int, seed: int) -> list[Problem]:
    """A fixed evaluation set (distinct problems when the task has enough of them)."""
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

    Raises ``ValueError`` naming ``eval_size`` with the task's number of distinct problems.
    """
    distinct = task.num_problems
    held = len({problem.prompt for problem in held_out})
    if distinct - held < 1:
        raise ValueError(
            f"eval_size: the task has {distinct} distinct problems and the held-out set takes {held} of them, "
            f"leaving none to train on; pass --eval-size below {distinct} (or a larger dataset)"
        )
