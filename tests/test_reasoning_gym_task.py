"""reasoning-gym generators as tasks (``--task reasoning-gym:NAME``): the verifier as the reward,
held-out questions never trained on, the embedded model's limits, and one-line errors.

The package itself is the oracle: rewards are compared with ``score_answer(extract_answer(c), entry)``
of a generator built here with ``reasoning_gym.create_dataset``, not with softtrust's own copy.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from softtrust.cli import build_parser
from softtrust.train import rollout as rollout_module
from softtrust.train import trainer as trainer_module
from softtrust.train.config import TrainConfig
from softtrust.train.rollout import ProblemSampler, RewardScorer, greedy_evaluation
from softtrust.train.tasks import build_config_task, build_task, check_training_pool, held_out_problems
from softtrust.train.tiny import build_char_tokenizer
from softtrust.train.trainer import EVAL_SEED, train
from test_data_rewards import TEMPLATE
from test_train import micro_config, model_parameters, read_metrics, write_micro_model

reasoning_gym = pytest.importorskip("reasoning_gym")
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from softtrust.train.reasoning_gym_task import TRAINING_SEED, ReasoningGymTask

# 1-digit a + b or a - b: 200 distinct questions, so 10,000 entries repeat each about 50 times
SMALL = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


def oracle_entries(seed: int, options: dict = SMALL, size: int = 10_000) -> tuple[object, dict]:
    """reasoning-gym's own chain_sum generator seeded ``seed``, and its entries by question."""
    dataset = reasoning_gym.create_dataset("chain_sum", **options, seed=seed, size=size)
    return dataset, {entry["question"]: entry for entry in (dataset[i] for i in range(size))}


def question_of(prompt) -> str:
    return prompt if isinstance(prompt, str) else prompt[-1][1]


def rg_config(model_dir: str, output_dir: Path, **overrides) -> TrainConfig:
    values = dict(dataset=None, reward=None, task="reasoning-gym:chain_sum", task_config=dict(SMALL))
    return micro_config(model_dir, output_dir, **{**values, **overrides})


# ---------------------------------------------------------------------- the verifier is the reward
def test_training_rewards_and_held_out_scores_are_the_generators_verifier(
    micro_model_dir, tmp_path, monkeypatch
):
    """Guards the reward path end to end: every training reward equals reasoning-gym's
    ``score_answer(extract_answer(completion), entry)`` for the entry its question came from (in the
    training generator), and the held-out accuracy / score are the share scoring 1 / the mean score
    of the greedy completions. A short warm start makes completions carry answer tags, so rewards
    are not all 0 (a wrong entry, a missed extraction or a lost partial credit would show)."""
    rollouts = []  # (problems, batch) of every rollout, as the trainer scored them
    real_generate = trainer_module.generate_rollout

    def spy(policy, tokenizer, problems, *args, **kwargs):
        rollouts.append((list(problems), real_generate(policy, tokenizer, problems, *args, **kwargs)))
        return rollouts[-1][1]

    monkeypatch.setattr(trainer_module, "generate_rollout", spy)
    config = rg_config(
        micro_model_dir,
        tmp_path / "run",
        task_config={**SMALL, "size": 500},
        max_new_tokens=20,
        sft_steps=60,
        sft_lr=1e-2,
        sft_batch_size=32,
        cache_dir=str(tmp_path / "cache"),
        eval_size=16,
        num_samples=16,
        max_steps=2,
    )
    summary = train(config)
    generator, by_question = oracle_entries(TRAINING_SEED, size=500)
    rewards = []
    for problems, batch in rollouts:
        for row, completion in enumerate(batch.completions):
            entry = by_question[question_of(problems[row // 4].prompt)]  # G = 4 rows a problem
            rewards.append(float(batch.rewards[row]))
            assert rewards[-1] == generator.score_answer(extract_answer(completion), entry), completion
    assert any(value > 0 for value in rewards) and any(value == 0 for value in rewards)
    held_out_generator, held = oracle_entries(EVAL_SEED, size=500)
    final = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    final = [sample for sample in final if sample["step"] == 2 and sample["kind"] == "eval"]
    scores = [
        held_out_generator.score_answer(extract_answer(sample["completion"]), held[sample["prompt"]])
        for sample in final
    ]
    assert len(final) == 16 and [sample["reward"] for sample in final] == scores
    assert summary["accuracy_after"] == sum(score == 1 for score in scores) / 16
    assert summary["score_after"] == pytest.approx(sum(scores) / 16, abs=1e-12)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["eval/score"] for e in events if "eval/score" in e][-1] == summary["score_after"]
    assert len(read_metrics(tmp_path / "run")) == 2


def test_accuracy_counts_only_a_full_score_and_the_mean_score_keeps_partial_credit(
    micro_model_dir, monkeypatch
):
    """Guards the two held-out numbers: an answer the verifier gives partial credit (``12`` for
    ``2``: 0.5) adds to the mean score but not to the accuracy."""
    from transformers import AutoModelForCausalLM

    task = ReasoningGymTask("chain_sum", {**SMALL, "size": 200})
    problems = task.held_out(3, EVAL_SEED)
    answers = [problem.answer for problem in problems]
    texts = [f"<answer>{answers[0]}</answer>", f"<answer>9 {answers[1]}</answer>", "no tags"]
    monkeypatch.setattr(rollout_module, "decode_completions", lambda *args: list(texts))
    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True)
    evaluation = greedy_evaluation(model, build_char_tokenizer(), task, problems, 2)
    generator, by_question = oracle_entries(EVAL_SEED, {**SMALL}, size=200)
    expected = [
        generator.score_answer(extract_answer(t), by_question[p.prompt])
        for t, p in zip(texts, problems, strict=True)
    ]
    assert expected[0] == 1 and 0 < expected[1] < 1 and expected[2] == 0
    assert evaluation.accuracy == pytest.approx(1 / 3) and evaluation.score == pytest.approx(
        sum(expected) / 3
    )


def fmt(completion: str, answer: str) -> float:
    """A format reward: 1 when the completion is nothing but one answer in tags."""
    return float(completion.strip().startswith("<answer>") and completion.strip().endswith("</answer>"))


def test_a_format_reward_adds_to_the_task_score_which_stays_the_correctness_reward():
    """Guards ``--reward task,module:fmt --reward-weights 1,0.1``: total = score + 0.1 x fmt, and
    correctness (held-out accuracy) is decided by the verifier even when ``task`` is not first."""
    task = ReasoningGymTask(
        "chain_sum", {**SMALL, "size": 200}, reward=f"{__name__}:fmt,task", reward_weights=[0.1, 1]
    )
    problem = task.held_out(1, EVAL_SEED)[0]
    right, tagged_wrong = f"<answer>{problem.answer}</answer>", "<answer>x</answer>"
    total, correct, parts = RewardScorer(task).score([problem] * 3, [right, tagged_wrong, "plain"], [[]] * 3)
    assert total.tolist() == pytest.approx([1.1, 0.1, 0.0]) and correct == [True, False, False]
    assert parts["task"] == [1.0, 0.0, 0.0]


# ---------------------------------------------------------------------- held out by question text
def test_held_out_questions_are_never_trained_on_though_the_generator_repeats_them(monkeypatch):
    """Guards disjointness by question text: with 200 distinct questions in 10,000 entries the
    training generator holds every held-out question many times, and none is ever drawn. The two
    generators' per-entry seeds (seed + index) do not overlap either."""
    seeds = []
    real_create = reasoning_gym.create_dataset
    monkeypatch.setattr(
        reasoning_gym,
        "create_dataset",
        lambda name, **kw: seeds.append((kw["seed"], kw["size"])) or real_create(name, **kw),
    )
    task = build_task("reasoning-gym:chain_sum", reward=None, task_config=SMALL)
    held_out = held_out_problems(task, 150, seed=EVAL_SEED)
    check_training_pool(task, held_out)
    held = {problem.prompt for problem in held_out}
    assert len(held) == 150
    training_questions = [task.training[i]["question"] for i in range(2_000)]
    assert held & set(training_questions)  # the generator repeats held-out questions: the filter matters
    drawn = [problem.prompt for problem in ProblemSampler(task, seed=0, exclude=held_out).draw(2_000)]
    assert not held & set(drawn) and len(set(drawn)) == 50  # every remaining question, none held out
    (train_seed, train_size), (eval_seed, eval_size) = seeds[0], seeds[-1]
    assert (train_seed, eval_seed) == (TRAINING_SEED, EVAL_SEED)
    assert eval_seed + eval_size <= train_seed or train_seed + train_size <= eval_seed


def test_a_pool_too_small_for_the_held_out_set_is_refused_with_its_sizes(micro_model_dir, tmp_path):
    """Guards the two refusals: fewer distinct questions than --eval-size, and a held-out set that
    takes every question (the sampler would loop forever); both before any file is written."""
    with pytest.raises(
        ValueError, match=r"eval_size: reasoning-gym:chain_sum gave 200 distinct questions in the 10000"
    ):
        train(rg_config(micro_model_dir, tmp_path / "a", eval_size=250))
    with pytest.raises(
        ValueError, match=r"eval_size: every one of the 10000 entries .* 200 held-out questions"
    ):
        train(rg_config(micro_model_dir, tmp_path / "b", eval_size=200))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------- prompts and the embedded model
def test_chat_models_get_reasoning_gyms_system_prompt_or_the_users(micro_model_dir, tmp_path):
    """Guards the chat rendering: a tokenizer with a chat template gets (system, question)
    conversations with reasoning-gym's own system prompt unless --system-prompt replaces it; a
    model without one gets the question alone and refuses --system-prompt."""
    chat_dir = tmp_path / "chat"
    shutil.copytree(micro_model_dir, chat_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(chat_dir)
    task = build_config_task(rg_config(str(chat_dir), tmp_path / "run"))
    problem = task.sample(random.Random(0))
    assert problem.prompt[0] == ("system", SYSTEM_PROMPTS["default"]) and problem.prompt[1][0] == "user"
    own = build_config_task(rg_config(str(chat_dir), tmp_path / "run", system_prompt="S"))
    assert own.sample(random.Random(0)).prompt == (("system", "S"), problem.prompt[1])
    plain = build_config_task(rg_config(micro_model_dir, tmp_path / "run"))
    assert plain.sample(random.Random(0)).prompt == problem.prompt[1][1]
    with pytest.raises(ValueError, match="system_prompt: applies to chat prompts"):
        build_config_task(rg_config(micro_model_dir, tmp_path / "run", system_prompt="S"))


def test_the_embedded_model_warm_starts_on_tagged_answers_and_refuses_what_it_cannot_hold(tmp_path):
    """Guards the embedded model's support: small arithmetic fits (the warm-start target is the
    answer in tags); a generator writing newlines, too few new tokens for the tagged answers, or
    questions longer than its positions are refused naming the task and the reason."""
    task = ReasoningGymTask("chain_sum", {**SMALL, "size": 300})
    problems = task.held_out(32, EVAL_SEED)
    assert task.target(problems[0]) == f"<answer>{problems[0].answer}</answer>"
    task.check_embedded_model(problems, max_new_tokens=20)
    with pytest.raises(
        ValueError, match=r"max_new_tokens: reasoning-gym:chain_sum's answers .* take up to 20"
    ):
        task.check_embedded_model(problems, max_new_tokens=6)
    with pytest.raises(
        ValueError, match=r"task: reasoning-gym:chain_sum's questions run to .* 256 positions"
    ):
        task.check_embedded_model(problems, max_new_tokens=200)
    base = dict(eval_size=8, max_new_tokens=40, sft_steps=0, output_dir=str(tmp_path / "run"), progress=False)
    with pytest.raises(
        ValueError,
        match=r"task: reasoning-gym:maze writes characters the embedded model cannot encode \(\['\\n'\] in",
    ):
        train(TrainConfig(task="reasoning-gym:maze", **base))
    assert not (tmp_path / "run").exists()
    no_answer = ReasoningGymTask("rush_hour", {"size": 20})
    with pytest.raises(
        ValueError, match="sft_steps: reasoning-gym:rush_hour's entries have no reference answer"
    ):
        no_answer.target(no_answer.held_out(1, EVAL_SEED)[0])


# ---------------------------------------------------------------------- one-line errors
@pytest.mark.parametrize(
    ("task", "task_config", "message"),
    [
        (
            "reasoning-gym:chain_summ",
            {},
            r"task: reasoning-gym has no generator 'chain_summ'; did you mean chain_sum, ",
        ),
        (
            "reasoning-gym:chain_sum",
            {"min_term": 2},
            r"task_config: 'min_term' is not an option of reasoning-gym:chain_sum; its options: min_terms, max_terms",
        ),
        (
            "reasoning-gym:chain_sum",
            {"min_terms": 0},
            r"task_config: reasoning-gym:chain_sum rejects the options \{'min_terms': 0\} \(AssertionError: min_terms must be positive\)",
        ),
        (
            "reasoning-gym:chain_sum",
            {"max_digits": "four"},
            r"task_config: reasoning-gym:chain_sum rejects the options .*TypeError",
        ),
        ("reasoning-gym:chain_sum", {"seed": 3}, "task_config: 'seed' is set by the trainer"),
        (
            "addition",
            {"min_terms": 2},
            "task_config: options of a reasoning-gym generator, for --task reasoning-gym:NAME; this run uses task 'addition'",
        ),
        ("nope", {}, "task: unknown task 'nope'; expected a built-in task"),
    ],
)
def test_a_bad_task_or_option_is_one_line_naming_the_option(task, task_config, message):
    """Guards the checks in ``TrainConfig.validate`` (before any work, and before a sweep's cells run)."""
    with pytest.raises(ValueError, match=message) as error:
        TrainConfig(task=task, task_config=task_config).validate()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("option", [{"prompt_column": "question"}, {"answer_column": "solution"}])
def test_dataset_column_options_are_refused_for_a_generator(option):
    """A generator has no columns: ``--prompt-column`` was silently ignored."""
    ((name, value),) = option.items()
    message = (
        f"{name}: applies to --dataset; this run trains on the reasoning-gym task 'reasoning-gym:chain_sum'"
    )
    with pytest.raises(ValueError, match=f"^{message}, which would ignore it \\(got '{value}'\\)$"):
        TrainConfig(task="reasoning-gym:chain_sum", **option).validate()
    TrainConfig(task="reasoning-gym:chain_sum", system_prompt="Be brief.", reward="task").validate()


def test_rewards_must_include_the_verifier_which_decides_correctness():
    """Guards the reward plumbing: a --reward without ``task`` and a --correctness-reward other
    than ``task`` are refused; ``task`` with --dataset names the reasoning-gym option."""
    with pytest.raises(
        ValueError, match="reward: a reasoning-gym task is scored by its generator's verifier, named 'task'"
    ):
        ReasoningGymTask("chain_sum", SMALL, reward="exact")
    with pytest.raises(
        ValueError, match="correctness_reward: a reasoning-gym task's correctness is .* 'task'"
    ):
        ReasoningGymTask("chain_sum", SMALL, reward="task,exact", correctness_reward="exact")
    from softtrust.train.rewards import RewardSet

    with pytest.raises(ValueError, match=r"'task' is a reasoning-gym generator's score"):
        RewardSet.parse("task")


def test_task_config_from_the_command_line_yaml_and_a_sweep_cell(tmp_path):
    """Guards the option's plumbing: --task-config with a bracketed list, the same as a YAML
    mapping, and a sweep cell's config carrying task and task_config (a bad one refused by the
    sweep's validation, before any cell runs)."""
    from softtrust.study.cli import sweep_from_arguments
    from softtrust.train.options import config_from_arguments

    flags = [
        "--task",
        "reasoning-gym:basic_arithmetic",
        "--task-config",
        "operators=[+, -],max_terms=3,size=50",
    ]
    config = config_from_arguments(build_parser().parse_args(["train", *flags]))
    assert config.task_config == {"operators": ["+", "-"], "max_terms": 3, "size": 50}
    path = tmp_path / "run.yaml"
    path.write_text(
        "task: reasoning-gym:basic_arithmetic\ntask_config:\n  operators: ['+', '-']\n  max_terms: 3\n  size: 50\n"
    )
    assert TrainConfig.from_yaml(path).task_config == config.task_config
    arguments = build_parser().parse_known_args(
        ["sweep", "--methods", "clip", "--staleness", "1", "--seeds", "1"]
    )[0]
    sweep = sweep_from_arguments(arguments, flags)
    cell = sweep.cell_config(sweep.cells()[0])
    assert (cell.task, cell.task_config) == ("reasoning-gym:basic_arithmetic", config.task_config)
    (tmp_path / "cell.yaml").write_text(cell.to_yaml())
    assert TrainConfig.from_yaml(tmp_path / "cell.yaml").task_config == config.task_config
    sweep.validate()
    bad = sweep_from_arguments(arguments, [*flags[:3], "operators=[+, -],max_term=3"])
    with pytest.raises(
        ValueError, match="task_config: 'max_term' is not an option of reasoning-gym:basic_arithmetic"
    ):
        bad.validate()


def test_a_run_on_a_reasoning_gym_task_resumes_to_the_same_weights(micro_model_dir, tmp_path):
    """Guards that the training stream is a function of the sampler's checkpointed state: a run
    stopped and resumed draws the same problems and ends with the same weights as a straight one."""
    common = dict(staleness=3, max_new_tokens=8)
    train(rg_config(micro_model_dir, tmp_path / "straight", max_steps=4, **common))
    train(rg_config(micro_model_dir, tmp_path / "resumed", max_steps=2, **common))
    train(
        rg_config(
            micro_model_dir, tmp_path / "resumed", max_steps=4, resume=str(tmp_path / "resumed"), **common
        )
    )
    straight, resumed = model_parameters(tmp_path / "straight"), model_parameters(tmp_path / "resumed")
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=1e-6)
    assert [m["reward/mean"] for m in read_metrics(tmp_path / "resumed")] == [
        m["reward/mean"] for m in read_metrics(tmp_path / "straight")
    ]


def test_the_warm_start_cache_tells_generator_options_apart(micro_model_dir, tmp_path):
    """Guards the cache key: two runs whose generator options differ (other problems) train their
    own warm starts instead of sharing one; the same options load the cached one."""
    common = dict(sft_steps=2, max_steps=0, max_new_tokens=20, cache_dir=str(tmp_path / "cache"))
    train(rg_config(micro_model_dir, tmp_path / "a", **common))
    train(rg_config(micro_model_dir, tmp_path / "b", **common, task_config={**SMALL, "allow_negation": True}))
    train(rg_config(micro_model_dir, tmp_path / "c", **common))
    assert len(list((tmp_path / "cache" / "warmstart").glob("*.safetensors"))) == 2
    cached = [json.loads((tmp_path / run / "events.jsonl").read_text().splitlines()[0]) for run in "abc"]
    assert [event["warmstart_cached"] for event in cached] == [False, False, True]
