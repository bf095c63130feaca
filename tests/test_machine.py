"""``--model`` directories and prompts checked before any run directory exists (machine.py,
prompt_fit.py): a directory without or with unreadable weights, an encoder such as BERT, a chat
template that refuses ``--system-prompt``'s system message, a prompt longer than the context.
Each is one error line naming the field, exit code 2, and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from softtrust.cli import main
from softtrust.train.machine import check_causal_lm_directory, check_weights
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)  # max_position_embeddings 256: the context a prompt must fit
# renders a conversation, and refuses a system message as some models' templates do (Gemma, Mistral)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<s>{{ m['role'] }}:{{ m['content'] }}<unk>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("micro")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def bert_dir(tmp_path: Path) -> Path:
    """A BERT config with a tokenizer and weights: transformers lists BertLMHeadModel as a causal
    LM, so the model type alone passed the check (and sampling crashed)."""
    from transformers import BertConfig, BertForMaskedLM

    directory = tmp_path / "bert"
    config = BertConfig(
        vocab_size=99, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8
    )
    BertForMaskedLM(config).save_pretrained(directory)
    build_char_tokenizer().save_pretrained(directory)
    return directory


def train_fails(argv: list[str], tmp_path: Path, capsys) -> str:
    """Run ``softtrust train`` expecting a configuration error: exit 2, one line, no run directory."""
    output_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(output_dir), "--cache-dir", str(tmp_path / "cache"), *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and not output_dir.exists() and not (tmp_path / "cache").exists(), err
    return err


def write_dataset(path: Path, prompts: list) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


# ---------------------------------------------------------------------------------- weights
def test_a_directory_without_weights_is_refused_naming_model(model_dir, tmp_path, capsys):
    directory = copy_of(model_dir, tmp_path)
    (directory / "model.safetensors").unlink()
    err = train_fails(["--model", str(directory)], tmp_path, capsys)
    assert f"error: model: '{directory}' holds no weights (none of model.safetensors," in err


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda data: b"not a safetensors file at all" + data[:10], "its header claims"),
        (lambda data: data[: len(data) // 2], "truncated: its tensors need"),
        (lambda data: data[:5], "5 bytes, shorter than a safetensors header"),
        (lambda data: (12).to_bytes(8, "little") + b"{not json!!}" + data[20:], "its header is not JSON"),
    ],
    ids=["garbage", "truncated", "stub", "bad-header"],
)
def test_unreadable_weights_are_refused_naming_model_and_the_file(
    model_dir, tmp_path, capsys, corrupt, reason
):
    directory = copy_of(model_dir, tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(corrupt(weights.read_bytes()))
    err = train_fails(["--model", str(directory)], tmp_path, capsys)
    assert f"error: model: the weights {weights} cannot be read: {reason}" in err, err


def test_sharded_and_torch_weights_are_read_by_their_headers(model_dir, tmp_path):
    directory = copy_of(model_dir, tmp_path)
    weights = directory / "model.safetensors"
    shard = directory / "model-00001-of-00001.safetensors"
    weights.rename(shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard.name}}))
    check_causal_lm_directory(str(directory))  # a sharded checkpoint whose shard reads
    shard.unlink()
    with pytest.raises(
        ValueError,
        match=r"^model: the weights .*model-00001-of-00001.safetensors cannot be read: the file is missing",
    ):
        check_weights(directory)
    (directory / "model.safetensors.index.json").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04 half an archive")
    with pytest.raises(
        ValueError, match=r"^model: the weights .*pytorch_model.bin cannot be read: not a torch.save archive"
    ):
        check_weights(directory)


def test_a_torch_bin_checkpoint_passes(model_dir, tmp_path):
    directory = tmp_path / "bin"
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory, safe_serialization=False)
    tokenizer.save_pretrained(directory)
    check_causal_lm_directory(str(directory))


# ---------------------------------------------------------------------------------- architecture
def test_a_bert_directory_is_refused_as_an_encoder(tmp_path, capsys):
    directory = bert_dir(tmp_path)
    err = train_fails(["--model", str(directory)], tmp_path, capsys)
    assert (
        f"error: model: '{directory}' holds a 'bert' model, an encoder (or encoder-decoder) architecture"
        in err
    )


# ---------------------------------------------------------------------------------- chat template
def test_a_template_refusing_the_system_message_names_system_prompt(model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    directory = copy_of(model_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    tokenizer.save_pretrained(directory)
    data = write_dataset(
        tmp_path / "chat.jsonl", [[{"role": "user", "content": f"{i}+{i}="}] for i in range(40)]
    )
    argv = ["--model", str(directory), "--dataset", str(data), "--eval-size", "4"]
    err = train_fails([*argv, "--system-prompt", "Be brief."], tmp_path, capsys)
    assert "error: system_prompt: the chat template of --model" in err
    assert "refuses a system message (System role not supported); drop --system-prompt" in err
    # a record that holds the system message itself names the model's template and the record
    records = [
        [{"role": "system", "content": "x"}, {"role": "user", "content": f"{i}+1="}] for i in range(40)
    ]
    data = write_dataset(tmp_path / "own_system.jsonl", records)
    err = train_fails(
        ["--model", str(directory), "--dataset", str(data), "--eval-size", "4"], tmp_path, capsys
    )
    assert (
        f"error: model: the chat template of --model '{directory}' fails on the prompt of {data}:1 (System role not supported)"
        in err
    )


# ---------------------------------------------------------------------------------- prompt length
@pytest.mark.parametrize("length", [300, 400_000])
def test_a_prompt_longer_than_the_context_is_refused_naming_the_record(model_dir, tmp_path, capsys, length):
    """A 400,000-character prompt asked the sampler for ~160 GB: refused at once, by its record."""
    prompts = [f"{i}+{i}=" for i in range(40)]
    prompts[17] = "1" * length
    data = write_dataset(tmp_path / "long.jsonl", prompts)
    err = train_fails(
        ["--model", str(model_dir), "--dataset", str(data), "--eval-size", "4"], tmp_path, capsys
    )
    assert (
        f"error: dataset: {data}:18: the prompt is {length} tokens, longer than the context of --model "
        f"'{model_dir}' (256 tokens); shorten or drop it" in err
    ), err


def test_the_embedded_model_and_conversations_are_measured_as_the_sampler_encodes(
    model_dir, tmp_path, capsys
):
    """The embedded model's context (256) applies too; a conversation is counted through the chat
    template (its markers are one token each), and one that fits is accepted."""
    data = write_dataset(tmp_path / "long.jsonl", ["2" * 257] + [f"{i}+{i}=" for i in range(40)])
    err = train_fails(["--dataset", str(data), "--eval-size", "4"], tmp_path, capsys)
    assert (
        f"error: dataset: {data}:1: the prompt is 257 tokens, longer than the context of the embedded model"
        in err
    )
    from softtrust.train.prompt_fit import token_bound, token_count

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    conversation = (("user", "1" * 250),)
    assert token_count(tokenizer, conversation) == 1 + 5 + 250 + 1 + 1 + 10  # <s>user:...<unk><s>assistant:
    assert token_bound(conversation, overhead=17) >= token_count(tokenizer, conversation)
