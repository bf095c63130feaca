"""The warm-start cache: keyed on what determines the warm start, files by their content.

Every warm start here is two supervised steps of the micro Qwen2 of ``test_train`` on a
conversational copy of its dataset, cached in a temporary directory.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
import torch

from softtrust.train.config import TrainConfig
from softtrust.train.tasks import build_config_task, held_out_problems
from softtrust.train.tiny import build_char_tokenizer, build_tiny_model
from softtrust.train.trainer import EVAL_SEED, load_policy
from softtrust.train.warmstart import content_fingerprint
from test_train import MICRO, micro_config, write_micro_model

torch.set_num_threads(1)

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}<unk>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def write_conversational_model(directory: Path) -> Path:
    """The micro model with a chat template, and ``chats.jsonl``: each record's prompt and answer
    in two spellings (``prompt``/``question``, ``answer``/``solution``)."""
    directory.mkdir()
    write_micro_model(directory)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    records = [
        {
            "prompt": [{"role": "user", "content": f"{i}+{j}="}],
            "question": [{"role": "user", "content": f"{j}+{i}="}],
            "answer": f"{i + j:02d}",
            "solution": str(i + j),
        }
        for i in range(10)
        for j in range(10)
    ]
    (directory / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory


class SilentRun:
    """What ``load_policy`` needs of a ``RunLog``: it records the warm start's event."""

    writes = False

    def __init__(self):
        self.events, self.warmstart = [], {}

    def log_event(self, record: dict) -> None:
        self.events.append(record)

    def warn(self, message: str, step: int) -> None:
        pass


def warm_start_cached(config: TrainConfig) -> bool:
    """Warm-start the policy of ``config`` (``load_policy``); whether it came from the cache."""
    config = config.resolved().validate()
    task = build_config_task(config)
    run = SilentRun()
    load_policy(config, run, task, held_out_problems(task, config.eval_size, seed=EVAL_SEED))
    return run.events[-1]["warmstart_cached"]


def test_the_warm_start_cache_misses_when_a_file_or_a_setting_that_shapes_it_changes(tmp_path):
    """The key held the dataset's and the model's paths and missed fields: after editing the
    dataset, changing --answer-column, --prompt-column or --system-prompt, after a --dtype bf16
    warm start, or after new weights were saved into the --model directory, a rerun loaded the
    old warm start (``warmstart_cached: true``)."""
    model = write_conversational_model(tmp_path / "model")
    base = micro_config(
        str(model),
        tmp_path / "run",
        dataset=str(model / "chats.jsonl"),
        reward="exact",
        sft_steps=2,
        sft_batch_size=4,
        sft_target_accuracy=None,
        cache_dir=str(tmp_path / "cache"),
    )
    assert not warm_start_cached(base) and warm_start_cached(base)
    variants = {
        "answer_column": base.replace(answer_column="solution"),
        "prompt_column": base.replace(prompt_column="question"),
        "system_prompt": base.replace(system_prompt="Be brief."),
        "dtype": base.replace(dtype="bf16"),
    }
    for name, variant in variants.items():
        assert not warm_start_cached(variant), name  # another entry ...
        assert warm_start_cached(variant), name  # ... cached in turn
    assert warm_start_cached(base)  # the first entry is still there
    with open(model / "chats.jsonl", "a") as handle:  # an edited dataset
        handle.write(json.dumps({"prompt": [{"role": "user", "content": "9+9+1="}], "answer": "19"}) + "\n")
    assert not warm_start_cached(base) and warm_start_cached(base)
    build_tiny_model(build_char_tokenizer(), MICRO, seed=1).save_pretrained(model)  # new weights, same path
    assert not warm_start_cached(base) and warm_start_cached(base)


def test_a_copy_of_the_same_files_elsewhere_is_the_same_entry(tmp_path):
    """Files enter the key by content, not by path: a copied model and dataset load the entry."""
    model = write_conversational_model(tmp_path / "model")
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    (copy / ".cache").mkdir()  # a hidden download cache does not count
    (copy / ".cache" / "lock").write_text("x")
    config = dict(sft_steps=2, sft_batch_size=4, sft_target_accuracy=None, cache_dir=str(tmp_path / "cache"))
    original = micro_config(str(model), tmp_path / "a", dataset=str(model / "chats.jsonl"), **config)
    copied = micro_config(str(copy), tmp_path / "b", dataset=str(copy / "chats.jsonl"), **config)
    assert not warm_start_cached(original) and warm_start_cached(copied)
    (entry,) = (tmp_path / "cache").rglob("*.safetensors")  # mkstemp's 0600 survived the rename
    (tmp_path / "plain").write_text("x")
    assert stat.S_IMODE(entry.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert content_fingerprint(model) == content_fingerprint(copy)
    assert content_fingerprint(tmp_path / "nothing").startswith("missing:")


@pytest.mark.parametrize("size", [100, (8 << 20) + 5])
def test_a_file_fingerprint_changes_with_its_content(tmp_path, size):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * size)
    before = content_fingerprint(path)
    path.write_bytes(b"b" + b"a" * (size - 1))  # the first byte (a large file: size and time too)
    assert content_fingerprint(path) != before
