"""Verifiable tasks: prompts with checkable answers, a reward, and supervised targets.

A task is a small object with three jobs:

- ``sample(rng)`` draws one ``Problem`` (a prompt and its reference answer);
- ``reward(completion, answer)`` scores a decoded completion in [0, 1];
- ``target(problem)`` is the completion a supervised warm start teaches.

Built-in tasks live in the ``TASKS`` registry (``--task NAME``); a JSONL file of
``{"prompt": ..., "answer": ...}`` lines becomes a ``DatasetTask`` (``--dataset``)
scored by ``exact``, ``numeric`` or a user ``module:function`` reward; ``--task
reasoning-gym:NAME`` is a reasoning-gym generator scored by its own verifier
(``reasoning_gym_task.ReasoningGymTask``). ``check_task`` (``TrainConfig.validate``) and
``task_and_held_out`` (the trainer) are what a ``TrainConfig`` asks of this module.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from .data import problems_from_records, read_records
from .problem import Problem
from .prompt_fit import check_prompts
from .reasoning_gym_task import REASONING_GYM, ReasoningGymTask, check_options
from .rewards import RewardSet

if TYPE_CHECKING:
    from .config import TrainConfig


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

        self.path = Path(path)
        self.rewards = RewardSet.parse(reward, reward_weights, correctness_reward)
        records = read_records(self.path)
        self.sources = [where for where, _ in records]  # the file and line of each problem, for errors
        self.problems = problems_from_records(
            records,
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


def build_task(task: str, dataset: str | None = None, reward: str | None = "exact", **options):
    """The task a config names: a ``dataset`` if given (``options``: ``DatasetTask``'s keyword
    arguments; ``reward`` default ``exact``), a reasoning-gym generator for ``reasoning-gym:NAME``
    (``options``: ``ReasoningGymTask``'s; ``reward`` default ``task``), else the built-in ``task``."""
    if dataset is not None:
        return DatasetTask(dataset, reward or "exact", **options)
    if task is not None and task.startswith(REASONING_GYM):
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


# ---------------------------------------------------------------------- a TrainConfig's task
def check_task(config: TrainConfig) -> None:
    """The task the config trains on exists, and ``task_config`` applies to it: a reasoning-gym
    generator's name and options are checked here (``reasoning_gym_task.check_options``), before
    any work. Raises ``ValueError`` naming ``task`` or ``task_config``."""
    check_dataset_options(config)
    if config.dataset is None and config.task.startswith(REASONING_GYM):
        check_options(config.task[len(REASONING_GYM) :], config.task_config)
        return
    if config.task_config:
        used = "--dataset" if config.dataset is not None else f"task {config.task!r}"
        raise ValueError(
            f"task_config: options of a reasoning-gym generator, for --task {REASONING_GYM}NAME; this run "
            f"uses {used} (got {config.task_config!r})"
        )
    if config.dataset is None and config.task not in TASKS:
        raise ValueError(
            f"task: unknown task {config.task!r}; expected a built-in task {sorted(TASKS)} or "
            f"{REASONING_GYM}NAME (a reasoning-gym generator)"
        )


def check_dataset_options(config: TrainConfig) -> None:
    """A ``ValueError`` naming the first option the run's task would silently ignore: the column
    options on anything but ``--dataset``; the reward options and ``system_prompt`` also on a
    built-in task, which scores with its own reward (``reward: exact`` passes: it is what
    ``TrainConfig.resolved`` records for such a task)."""
    if config.dataset is not None:
        return
    generator = config.task.startswith(REASONING_GYM)
    unset = {"prompt_column": ("prompt",), "answer_column": ("answer",)}
    if not generator:
        unset |= {"system_prompt": (None,), "reward": (None, "exact"), "reward_weights": ([],)}
        unset |= {"correctness_reward": (None,)}
    for name, values in unset.items():
        value = getattr(config, name)
        if value not in values:
            kind = "reasoning-gym" if generator else "built-in"
            also = "" if name.endswith("_column") else " and reasoning-gym tasks"
            raise ValueError(
                f"{name}: applies to --dataset{also}; this run trains on the {kind} task {config.task!r}, "
                f"which would ignore it (got {value!r})"
            )


def default_reward(config: TrainConfig) -> str:
    """``--reward``'s default (``TrainConfig.resolved`` records it): ``task``, the generator's
    verifier, for a reasoning-gym task; else ``exact`` (what a ``--dataset`` run scores with)."""
    return "task" if config.dataset is None and config.task.startswith(REASONING_GYM) else "exact"


def task_and_held_out(config: TrainConfig, eval_seed: int) -> tuple:
    """The task and its held-out problems (drawn with ``eval_seed``, never drawn for training),
    checked before any file is written: some training problem is left, a reasoning-gym
    generator fits the embedded model, and the prompts fit the model's context and its chat
    template (``prompt_fit.check_prompts``)."""
    task = build_config_task(config)
    eval_problems = held_out_problems(task, config.eval_size, seed=eval_seed)
    check_training_pool(task, eval_problems)
    if config.uses_embedded_model and isinstance(task, ReasoningGymTask):
        task.check_embedded_model(eval_problems, config.effective_max_new_tokens)  # or refuse it
    check_prompts(config, task, eval_problems)
    return task, eval_problems


def build_config_task(config: TrainConfig):
    """The task the config names (``build_task``), with the dataset or reasoning-gym options."""
    if config.dataset is None and config.task.startswith(REASONING_GYM):
        return build_task(
            config.task,
            reward=config.reward,
            task_config=config.task_config,
            chat=has_chat_template(config),
            system_prompt=config.system_prompt,
            reward_weights=config.reward_weights or None,
            correctness_reward=config.correctness_reward,
        )
    if config.dataset is None:
        return build_task(config.task)
    return build_task(
        config.task,
        config.dataset,
        config.reward,
        prompt_column=config.prompt_column,
        answer_column=config.answer_column,
        system_prompt=config.system_prompt,
        reward_weights=config.reward_weights or None,
        correctness_reward=config.correctness_reward,
    )


def has_chat_template(config: TrainConfig) -> bool:
    """Whether the config's tokenizer renders conversations (never the embedded one's)."""
    if config.uses_embedded_model:
        return False
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    return bool(getattr(tokenizer, "chat_template", None))
