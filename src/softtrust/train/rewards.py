"""Rewards of a ``--dataset`` run: built-in ones, user functions in two signatures, weights.

``--reward`` names one or more rewards separated by commas: ``exact``, ``numeric``, ``math``,
``task`` (a reasoning-gym generator's verifier, ``reasoning_gym_task``) or ``module:function``.
A user function is called in one of two ways, told apart by its parameters:

- per sample: ``f(completion, answer, **columns) -> float`` (a parameter named ``completion``
  or the first two positional parameters); the record's other columns are passed as keyword
  arguments when ``f`` accepts them (by name, or all with ``**kwargs``);
- batched, TRL's signature, unchanged: ``f(prompts, completions, completion_ids, **columns)
  -> list[float | None]`` (a parameter named ``completions``, or, as TRL calls every reward
  with keywords only, ``**kwargs`` without a ``completion`` parameter and fewer than two
  positional ones: ``f(**kwargs)``, ``f(*args, **kwargs)``): ``prompts`` as in the data (a
  string or a list of messages), ``completions`` a string each, or for conversational prompts
  ``[{"role": "assistant", "content": text}]`` as TRL passes them, ``completion_ids`` lists of
  token ids, and each other column as a list over the batch.

``None`` means "not applicable" (as in TRL): it adds nothing to the weighted sum
``r = Σ_k w_k r_k`` (TRL's ``nansum``). ``--reward-weights`` gives ``w_k`` (default 1 each);
``--correctness-reward`` names the reward whose value ≥ 1 counts as correct in held-out
accuracy (default: the first).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from softtrust._validation import FLOAT32_MAX

from .problem import Problem

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution: the last ``\\boxed{...}`` (nested braces kept),
    else what follows the last ``####``, else the last number; ``None`` if there is none."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, position = 0, start + len("\\boxed")
        for index in range(position, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                return text[position + 1 : index].strip()
    if "####" in text:
        tail = text.rpartition("####")[2].strip()
        if tail:
            return tail.split("\n")[0].strip()
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1] if numbers_found else None


def _as_number(text: str) -> float | None:
    cleaned = text.strip().strip("$").replace(",", "").rstrip(".").strip()
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1]
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def math_reward(completion: str, answer: str) -> float:
    """1 if the completion's final answer (``extract_final_answer``) equals ``answer``, else 0.

    Numbers compare with ``math.isclose`` (relative 1e-6; ``1,000`` and ``$5`` are read as
    numbers); other answers with ``math_verify`` (``verify(parse(answer), parse(boxed))``) when
    it is installed, else as stripped strings.
    """
    extracted = extract_final_answer(completion)
    if extracted is None:
        return 0.0
    got, want = _as_number(extracted), _as_number(answer)
    if got is not None and want is not None:
        return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))
    try:
        from math_verify import parse, verify
    except ImportError:
        return float(extracted.strip() == answer.strip())
    return float(verify(parse(answer), parse("\\boxed{" + extracted + "}")))


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


BUILT_IN = {"exact": exact_reward, "numeric": numeric_reward, "math": math_reward}


@dataclass
class Reward:
    """One reward function with its weight and calling convention."""

    name: str
    function: Callable
    weight: float = 1.0
    batched: bool = False
    keywords: frozenset | None = None  # the column names it accepts; None: all (**kwargs)

    def __call__(self, problems, completions: Sequence[str], completion_ids: Sequence[list]) -> list:
        """One value per completion, each a finite float or ``None``; ``TypeError`` otherwise."""
        if self.batched:
            conversational = bool(problems) and not isinstance(problems[0].prompt, str)
            prompts = [raw_prompt(problem.prompt) for problem in problems]
            texts = (
                [[{"role": "assistant", "content": text}] for text in completions]
                if conversational
                else list(completions)
            )
            names = {name for problem in problems for name in problem.columns}
            columns = {name: [problem.columns.get(name) for problem in problems] for name in sorted(names)}
            values = self.function(
                prompts=prompts,
                completions=texts,
                completion_ids=list(completion_ids),
                **self._accepted(columns),
            )
            if not isinstance(values, (list, tuple)) or len(values) != len(problems):
                raise TypeError(
                    f"reward {self.name!r} returned {type(values).__name__} "
                    f"{'of length ' + str(len(values)) if hasattr(values, '__len__') else ''}, "
                    f"expected a list of {len(problems)} floats or None"
                )
        else:
            values = [
                self.function(text, problem.answer, **self._accepted(problem.columns))
                for problem, text in zip(problems, completions, strict=True)
            ]
        return [check_value(value, self.name) for value in values]

    def _accepted(self, columns: dict) -> dict:
        if self.keywords is None:
            return dict(columns)
        return {key: value for key, value in columns.items() if key in self.keywords}


def check_value(value, name: str = "reward") -> float | None:
    """``value`` as a float, ``None`` kept; ``TypeError`` unless a finite real number (a bool, a
    string, a tensor, inf or NaN are refused)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"reward function {name!r} returned {value!r}, expected a finite number")
    return float(value)


def raw_prompt(prompt):
    """A ``Problem.prompt`` as the dataset held it: the string, or a list of message dicts."""
    if isinstance(prompt, str):
        return prompt
    return [{"role": role, "content": content} for role, content in prompt]


def current_directory_importable() -> None:
    """Put the current directory first on ``sys.path`` when it is not there, as ``python -m``
    and ``python script.py``'s directory do: the installed ``softtrust`` command starts with
    its own ``bin/`` there instead, so ``--reward my_rewards:f`` could not import
    ``./my_rewards.py`` from it (it could with ``python -m softtrust``)."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def load_function(spec: str, own: dict[str, Callable] | None = None) -> Callable:
    """A built-in reward by name, one of the task's ``own`` (``task``: a reasoning-gym
    generator's score), or ``module:function``."""
    named = {**BUILT_IN, **(own or {})}
    if spec in named:
        return named[spec]
    if ":" not in spec:
        hint = "" if own else " ('task' is a reasoning-gym generator's score, for --task reasoning-gym:NAME)"
        raise ValueError(f"reward: expected {', '.join(named)} or 'module:function', got {spec!r}{hint}")
    module_name, _, function_name = spec.partition(":")
    current_directory_importable()
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"reward: cannot import {spec!r} ({error})") from error
    if not callable(function):
        raise ValueError(f"reward: {spec!r} is not callable")
    return function


def as_reward(name: str, function: Callable, weight: float = 1.0) -> Reward:
    """``function`` with its calling convention read from its signature."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: per sample, no columns
        return Reward(name, function, weight, batched=False, keywords=frozenset())
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    keywords = None if any_keyword else frozenset(parameters)
    if "completions" in parameters:
        return Reward(name, function, weight, batched=True, keywords=keywords)
    positional = [
        p
        for p in parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 2 and "completion" not in parameters and any_keyword:
        # TRL calls every reward with keywords only: f(**kwargs) or f(*args, **kwargs) is written for it
        return Reward(name, function, weight, batched=True, keywords=None)
    if len(positional) < 2:
        raise ValueError(
            f"reward: {name!r} takes neither (completion, answer, **columns) nor TRL's "
            "(prompts, completions, completion_ids, **columns) (or TRL's **kwargs alone)"
        )
    if keywords is not None:
        keywords = keywords - {positional[0].name, positional[1].name}
    return Reward(name, function, weight, batched=False, keywords=keywords)


class RewardSet:
    """The rewards of a run: ``total = Σ_k w_k r_k`` over the values that are not ``None``, and
    ``correct`` from the correctness reward (``r_c ≥ 1``)."""

    def __init__(self, rewards: list[Reward], correctness: int = 0):
        self.rewards = rewards
        self.correctness = correctness

    @classmethod
    def parse(
        cls,
        spec: str,
        weights: Sequence[float] | None = None,
        correctness: str | None = None,
        own: dict[str, Callable] | None = None,
    ) -> RewardSet:
        """The rewards ``spec`` names (``load_function``; ``own``: the task's named rewards)."""
        names = [part.strip() for part in spec.split(",") if part.strip()]
        if not names:
            raise ValueError(f"reward: expected at least one reward, got {spec!r}")
        weights = list(weights or [1.0] * len(names))
        if len(weights) != len(names):
            raise ValueError(
                f"reward_weights: {len(weights)} weight(s) {weights} for {len(names)} reward(s) {names}"
            )
        rewards = [
            as_reward(name, load_function(name, own), float(w))
            for name, w in zip(names, weights, strict=True)
        ]
        if correctness is None:
            index = 0
        elif correctness in names:
            index = names.index(correctness)
        else:
            raise ValueError(f"correctness_reward: {correctness!r} is not one of the rewards {names}")
        return cls(rewards, index)

    @classmethod
    def of_task(cls, task) -> RewardSet:
        """A dataset task's own set, or its ``reward(completion, answer)`` as the only reward."""
        own = getattr(task, "rewards", None)
        if isinstance(own, RewardSet):
            return own
        return cls([Reward("reward", task.reward, 1.0, batched=False, keywords=frozenset())])

    @property
    def needs_answer(self) -> bool:
        return any(reward.function in BUILT_IN.values() for reward in self.rewards)

    @property
    def names(self) -> list[str]:
        return [reward.name for reward in self.rewards]

    @property
    def correctness_name(self) -> str:
        """The name of the reward that decides correctness (and is the held-out score)."""
        return self.rewards[self.correctness].name

    def single(self, completion: str, answer: str) -> float:
        """The correctness reward of one completion, for a per-sample reward (the ``Task`` protocol)."""
        reward = self.rewards[self.correctness]
        value = reward([Problem("", answer)], [completion], [[]])[0]
        return 0.0 if value is None else value


class RewardScorer:
    """Scores completions with a task's rewards (``rewards.RewardSet``), the same way in RL and in
    evaluation: a reward function that raises or returns an invalid value (a bool, a string, a
    tensor, inf, NaN) scores 0 for the completions it was called on, which are counted in
    ``failures``; with ``strict=True`` the exception (``TypeError`` for an invalid value) propagates."""

    def __init__(self, task, strict: bool = False):
        self.rewards = RewardSet.of_task(task)
        self.strict = strict
        self.failures = 0

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[str],
        completion_ids: Sequence[list],
    ) -> tuple[torch.Tensor, list[bool], dict[str, list]]:
        """``(total [B] float32, correct [B], {reward name: [B] values or None})``.

        ``completion_ids``: each completion's token ids (``rollout.completion_token_ids``), given
        by RL and evaluation alike: a batched reward reading them scores both the same way.
        ``total = Σ_k w_k r_k`` over the values that are not ``None``; ``correct``: the
        correctness reward is not ``None`` and ``>= 1``.
        """
        parts = {}
        for reward in self.rewards.rewards:
            calls = (
                [slice(0, len(problems))]
                if reward.batched
                else [slice(i, i + 1) for i in range(len(problems))]
            )
            values = []
            for rows in calls:
                try:
                    values += reward(problems[rows], completions[rows], completion_ids[rows])
                except Exception:
                    if self.strict:
                        raise
                    self.failures += len(problems[rows])
                    values += [0.0] * len(problems[rows])
            parts[reward.name] = values
        total = [
            sum(r.weight * parts[r.name][i] for r in self.rewards.rewards if parts[r.name][i] is not None)
            for i in range(len(problems))
        ]
        self.check_range(total, parts)
        deciding = parts[self.rewards.correctness_name]
        correct = [value is not None and value >= 1.0 for value in deciding]
        return torch.tensor(total, dtype=torch.float32), correct, parts

    def check_range(self, total: list[float], parts: dict[str, list]) -> None:
        """A total beyond float32 (``|Σ_k w_k r_k| > 3.4e38``, e.g. from weights such as
        ``1e38,1e38``) is a ``ValueError`` naming ``reward_weights`` and the values, not an
        infinite reward whose advantages would be NaN."""
        for i, value in enumerate(total):
            if not abs(value) <= FLOAT32_MAX:
                terms = ", ".join(
                    f"{r.weight:g} * {r.name} {parts[r.name][i]!r}" for r in self.rewards.rewards
                )
                raise ValueError(
                    f"reward_weights: a completion's total reward {terms} = {value:g} is beyond float32 "
                    f"(magnitude at most {FLOAT32_MAX:.4g}); use smaller --reward-weights (or rewards)"
                )

    def __call__(self, completion: str, answer: str) -> float:
        """The total reward of one completion of a plain problem (text only: no token ids)."""
        return float(self.score([Problem("", answer)], [completion], [[]])[0][0])
