"""reasoning-gym generators as tasks: ``--task reasoning-gym:NAME`` (the ``tasks`` extra).

A generator (``reasoning_gym.create_dataset(NAME, **options, seed=..., size=...)``) yields
entries ``{"question", "answer", "metadata"}``; entry ``i`` of a generator seeded ``s`` is drawn
from its own stream (most generators seed it with ``s + i``). Two generators with the same options
make a run's problems:

- the held-out set: the first ``eval_size`` distinct questions of the generator seeded with the
  trainer's evaluation seed (``trainer.EVAL_SEED``), in entry order;
- the training stream: entries of the generator seeded ``TRAINING_SEED`` (2^31, so its per-entry
  seeds never meet the held-out generator's), drawn at random by the run's seed, skipping every
  question of the held-out set (``rollout.ProblemSampler``): generators repeat questions.

Both hold ``size`` entries (``--task-config size=N``, default ``DEFAULT_SIZE``). A prompt is the
question alone for a model without a chat template (the embedded character model), or, for a
chat model, a conversation: reasoning-gym's own system prompt (``SYSTEM_PROMPTS["default"]``,
which asks for ``<answer>...</answer>``) or ``--system-prompt``, then the question.

The reward named ``task`` is the generator's verifier, as reasoning-gym scores a completion:
``dataset.score_answer(extract_answer(completion), entry)``. It gives partial credit (a long
answer that contains the right one scores ``len(right) / len(answer)``), so held-out accuracy
counts the completions scoring 1 and the mean score is reported beside it (``eval/score``).
"""

from __future__ import annotations

import dataclasses
import difflib
import random

from .problem import Problem
from .rewards import RewardSet

REASONING_GYM = "reasoning-gym:"  # --task reasoning-gym:NAME names a reasoning-gym generator
INSTALL = 'pip install -e ".[tasks]"'
TRAINING_SEED = 2**31  # the training generator's seed; held-out generators get the evaluation seed
DEFAULT_SIZE = 10_000  # entries per generator unless --task-config size=N


def import_reasoning_gym():
    """The ``reasoning_gym`` package, or a ``ValueError`` naming ``task`` and the extra to install."""
    try:
        import reasoning_gym
        import reasoning_gym.utils
    except ImportError as error:
        raise ValueError(
            f"task: {REASONING_GYM}NAME needs the reasoning-gym package, which is not installed "
            f"({error}); install it with {INSTALL} (reasoning-gym==0.1.25)"
        ) from error
    return reasoning_gym


def generator_names() -> list[str]:
    """Every generator reasoning-gym registers (``reasoning_gym.factory.DATASETS``), sorted."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_options(name: str, options: dict) -> dict:
    """``options`` as the generator's config takes them, checked without generating anything.

    Raises ``ValueError`` naming ``task`` (no reasoning-gym, an unknown generator) or
    ``task_config`` (a key the generator's config dataclass lacks, ``seed``, which the trainer
    sets, or a value its ``validate`` rejects).
    """
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        suggestion = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(
            f"task: reasoning-gym has no generator {name!r}; {suggestion}it has {len(DATASETS)}, e.g. "
            f'{", ".join(sorted(DATASETS)[:6])}; list them with python -c "import reasoning_gym; '
            f'print(sorted(reasoning_gym.factory.DATASETS))"'
        )
    config_class = DATASETS[name][1]
    fields = [field.name for field in dataclasses.fields(config_class) if field.name != "seed"]
    if "seed" in options:
        raise ValueError(
            f"task_config: 'seed' is set by the trainer (held-out and training generators get their own "
            f"seeds, --seed orders the training draws); drop it (got {options!r})"
        )
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ValueError(
            f"task_config: {unknown[0]!r} is not an option of {REASONING_GYM}{name}; its options: "
            f"{', '.join(fields)} (got {options!r})"
        )
    values = {"size": DEFAULT_SIZE, **options}
    try:
        config = config_class(**values, seed=TRAINING_SEED)
        if hasattr(config, "validate"):
            config.validate()
    except Exception as error:
        raise rejected(name, options, error) from error
    return values


def rejected(name: str, options: dict, error: Exception) -> ValueError:
    """The ``task_config`` error for options the generator refused (in its config or when generating)."""
    reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return ValueError(f"task_config: {REASONING_GYM}{name} rejects the options {options!r} ({reason})")


class ReasoningGymTask:
    """A reasoning-gym generator as a task (see the module docstring).

    Args:
        generator: the generator's registry name (``chain_sum``, ``basic_arithmetic``, ...).
        task_config: its config's fields (``size``: entries per generator); checked by ``check_options``.
        chat: render prompts as conversations (for a tokenizer with a chat template).
        system_prompt: the system message of a chat prompt (default: reasoning-gym's own);
            refused for plain prompts.
        reward, reward_weights, correctness_reward: as for ``--dataset`` (``rewards.RewardSet``),
            with ``task`` naming the generator's score; ``task`` must be among them and is the
            correctness reward (default: ``task`` alone).
    """

    def __init__(
        self,
        generator: str,
        task_config: dict | None = None,
        *,
        chat: bool = False,
        system_prompt: str | None = None,
        reward: str | None = None,
        reward_weights: list | None = None,
        correctness_reward: str | None = None,
    ):
        reasoning_gym = import_reasoning_gym()
        self.generator = generator
        self.name = REASONING_GYM + generator
        self.given_options = dict(task_config or {})
        self.options = check_options(generator, self.given_options)
        self.size = self.options["size"]
        if system_prompt is not None and not chat:
            raise ValueError(
                f"system_prompt: applies to chat prompts, and {self.name} gives this model plain ones (its "
                "tokenizer has no chat template, e.g. the embedded model); drop --system-prompt"
            )
        self.system_prompt = (
            (system_prompt or reasoning_gym.utils.SYSTEM_PROMPTS["default"]) if chat else None
        )
        self.extract_answer = reasoning_gym.utils.extract_answer
        self.training = self.generator_dataset(TRAINING_SEED)
        self.rewards = task_rewards(reward, reward_weights, correctness_reward, self.score)

    def generator_dataset(self, seed: int):
        """The generator seeded ``seed`` (its first entry generated, so a value it rejects fails here)."""
        import reasoning_gym

        try:
            dataset = reasoning_gym.create_dataset(self.generator, **self.options, seed=seed)
            dataset[0]
        except Exception as error:
            raise rejected(self.generator, self.given_options, error) from error
        return dataset

    def problem(self, entry: dict) -> Problem:
        """An entry as a ``Problem``: the prompt, the reference answer as text (``""`` when the
        generator has none: its verifier checks answers itself), and the entry, which the
        verifier needs, as the column ``entry``."""
        question = entry["question"]
        prompt = (
            question if self.system_prompt is None else (("system", self.system_prompt), ("user", question))
        )
        answer = "" if entry["answer"] is None else str(entry["answer"])
        return Problem(prompt, answer, {"entry": entry})

    def sample(self, rng: random.Random) -> Problem:
        """A training problem: an entry of the training generator at a random index."""
        return self.problem(self.training[rng.randrange(len(self.training))])

    def held_out(self, count: int, seed: int) -> list[Problem]:
        """The first ``count`` distinct questions of the generator seeded ``seed``, in entry order.

        Raises ``ValueError`` naming ``eval_size`` if its ``size`` entries hold fewer."""
        dataset = self.generator_dataset(seed)
        seen, problems = set(), []
        for index in range(len(dataset)):
            problem = self.problem(dataset[index])
            if problem.prompt not in seen:
                seen.add(problem.prompt)
                problems.append(problem)
                if len(problems) == count:
                    return problems
        raise ValueError(
            f"eval_size: {self.name} gave {len(problems)} distinct questions in the {len(dataset)} entries of "
            f"its held-out generator (seed {seed}); the held-out set needs {count} and training needs more: "
            "lower --eval-size, or widen the generator's options (--task-config, e.g. a larger size or range)"
        )

    def check_training_pool(self, held_out: list[Problem]) -> None:
        """Refuse a training generator whose every entry is a held-out question (the sampler would
        draw forever). Raises ``ValueError`` naming ``eval_size`` with the sizes."""
        held = {problem.prompt for problem in held_out}
        for index in range(len(self.training)):
            if self.problem(self.training[index]).prompt not in held:
                return
        raise ValueError(
            f"eval_size: every one of the {len(self.training)} entries of {self.name}'s training generator is "
            f"one of the {len(held)} held-out questions, leaving none to train on; lower --eval-size, or "
            "widen the generator's options (--task-config)"
        )

    def score(self, completion: str, answer: str, entry: dict) -> float:
        """The generator's verifier: ``score_answer(extract_answer(completion), entry)``, in [0, 1]."""
        return float(self.training.score_answer(self.extract_answer(completion), entry))

    def target(self, problem: Problem) -> str:
        """The warm-start completion: the reference answer in reasoning-gym's answer tags."""
        if not problem.answer:
            raise ValueError(
                f"sft_steps: {self.name}'s entries have no reference answer (its verifier checks answers "
                "itself), so there is no warm-start target; pass --sft-steps 0 and --model"
            )
        return f"<answer>{problem.answer}</answer>"

    def check_embedded_model(self, problems: list[Problem], max_new_tokens: int) -> None:
        """Refuse a generator whose ``problems`` the embedded character model cannot hold: characters
        outside its vocabulary (printable ASCII, no newline; ``tiny.CHARACTERS``), a prompt and
        completion longer than its positions, or answers in tags longer than ``max_new_tokens``."""
        from .tiny import CHARACTERS, TinyModelConfig

        allowed, positions = set(CHARACTERS), TinyModelConfig().max_position_embeddings
        targets = [self.target(problem) for problem in problems]
        for problem, target in zip(problems, targets, strict=True):
            outside = sorted(set(problem.prompt + target) - allowed)
            if outside:
                raise ValueError(
                    f"task: {self.name} writes characters the embedded model cannot encode ({outside[:5]} in "
                    f"{problem.prompt[:60]!r}...; it has printable ASCII only, no newline): use --model with a "
                    "tokenizer that has them, or another generator"
                )
        needed = max(len(target) for target in targets) + 1  # + the end of sequence
        if needed > max_new_tokens:
            raise ValueError(
                f"max_new_tokens: {self.name}'s answers in <answer>...</answer> take up to {needed} tokens "
                f"with the end of sequence; pass --max-new-tokens {needed} or more (got {max_new_tokens})"
            )
        longest = max(len(problem.prompt) for problem in problems)
        if longest + max_new_tokens > positions:
            raise ValueError(
                f"task: {self.name}'s questions run to {longest} characters, and with {max_new_tokens} new "
                f"tokens exceed the embedded model's {positions} positions: use --model, or options "
                "(--task-config) that make shorter questions"
            )


def task_rewards(spec: str | None, weights, correctness: str | None, score) -> RewardSet:
    """The rewards of a reasoning-gym run: ``spec`` (default ``task``) with ``task`` = ``score``,
    which must be among them and is the correctness reward."""
    spec = spec or "task"
    if correctness not in (None, "task"):
        raise ValueError(
            f"correctness_reward: a reasoning-gym task's correctness is its verifier's score, 'task' "
            f"(got {correctness!r})"
        )
    rewards = RewardSet.parse(spec, weights, None, own={"task": score})
    if "task" not in rewards.names:
        raise ValueError(
            "reward: a reasoning-gym task is scored by its generator's verifier, named 'task' in --reward; "
            f"include it, e.g. 'task,my_rewards:fmt' with --reward-weights 1,0.1 (got {spec!r})"
        )
    rewards.correctness = rewards.names.index("task")
    return rewards
