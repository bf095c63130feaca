"""``softtrust train`` on the command line: help, YAML + overrides, --model, bad values."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from softtrust.cli import build_parser, main
from softtrust.train.config import TrainConfig
from softtrust.train.loss_config import build_method_loss
from softtrust.train.options import config_from_arguments
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from softtrust.train.values import parse_key_values

torch.set_num_threads(1)

MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)


def parse(*argv: str) -> TrainConfig:
    return config_from_arguments(build_parser().parse_args(["train", *argv]))


def test_help_documents_every_config_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name in TrainConfig.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in text, name
    for flag in (
        "--method",
        "--staleness",
        "--mode",
        "--max-lag",
        "--prompts-per-rollout",
        "--resume",
        "--report-to",
    ):
        assert flag in text


def test_help_shows_each_list_option_with_its_element_type(capsys):
    """``--reward-weights`` takes numbers such as ``1,0.2``; its help showed ``INT,...``."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--reward-weights FLOAT,..." in text
    assert "--lag-schedule INT,..." in text
    assert parse("--reward-weights", "1,0.2").reward_weights == [1.0, 0.2]


@pytest.mark.parametrize("command", ["train", "sweep"])
def test_an_abbreviated_flag_is_refused_with_the_subcommand_usage(command, tmp_path, capsys):
    """``--stal 3`` was read as ``--staleness 3`` (argparse's prefix matching); an unknown flag
    to ``train`` printed the top-level usage (``usage: softtrust [-h] COMMAND ...``)."""
    argv = [command, "--stal", "3", "--output-dir", str(tmp_path / "out")]
    if command == "train":
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        code = exit_info.value.code
    else:
        code = main([*argv, "--report-only"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"usage: softtrust {command} "), err
    assert f"softtrust {command}: error: unrecognized arguments: --stal 3" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_no_parser_in_the_package_matches_abbreviated_flags():
    """Every ``ArgumentParser`` under ``src/`` is built with ``allow_abbrev=False``."""
    import re

    source = Path(__file__).resolve().parents[1] / "src"
    for path in source.rglob("*.py"):
        text = path.read_text()
        for match in re.finditer(r"(ArgumentParser|add_parser)\(", text):
            depth, end = 1, match.end()
            while depth:  # the call's arguments, up to its closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            call = text[match.start() : end]
            assert "allow_abbrev=False" in call, f"{path.name}: {call[:60]}"


def test_yaml_config_then_flags_override_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: sapo\nstaleness: 4\nmethod_params: {tau_neg: 1.1}\nlr: 0.001\n")
    config = parse(
        "--config",
        str(path),
        "--staleness",
        "16",
        "--correction",
        "tis:cap=2",
        "--lag-schedule",
        "0,1,2",
        "--no-progress",
    )
    assert config.method == "sapo" and config.method_params == {"tau_neg": 1.1} and config.lr == 0.001
    assert config.staleness == 16 and config.correction == "tis:cap=2" and config.lag_schedule == [0, 1, 2]
    assert config.progress is False
    assert TrainConfig.from_yaml(path).staleness == 4
    assert parse("--method-params", "eps_high=0.28,eps_low=0.2").method_params == {
        "eps_high": 0.28,
        "eps_low": 0.2,
    }
    assert parse("--prompts-per-rollout", "12").prompts_per_step == 12


def test_key_values_keep_commas_inside_brackets_and_a_bad_value_names_the_option():
    """Guards list values in k=v options (``--task-config 'operators=[+, -],max_terms=3'``): a comma
    inside brackets is part of the value; a value YAML cannot read is one line naming the option."""
    assert parse_key_values("ops=[+, -],n=2,m={a: 1, b: 2}", "x") == {
        "ops": ["+", "-"],
        "n": 2,
        "m": {"a": 1, "b": 2},
    }
    assert parse_key_values("k_pos=2,lambda_pos=3", "x") == {"k_pos": 2, "lambda_pos": 3}
    with pytest.raises(
        ValueError, match=r"task_config: cannot read the value of 'ops', '\[\+,-,\*\]'"
    ) as error:
        parse_key_values("ops=[+,-,*]", "task_config")
    assert "\n" not in str(error.value)


def test_the_reward_default_is_recorded_as_the_reward_used():
    """Guards resuming across the default's change (``reward`` None = exact, or task for a
    reasoning-gym task): ``resolved`` writes the reward used, so a run recorded with ``exact``
    resumes with a config that leaves ``--reward`` out."""
    assert TrainConfig().resolved().reward == "exact"
    assert TrainConfig(dataset="d.jsonl").resolved().reward == "exact"
    assert TrainConfig(task="reasoning-gym:chain_sum").resolved().reward == "task"
    assert TrainConfig(task="reasoning-gym:chain_sum", reward="task,m:f").resolved().reward == "task,m:f"


@pytest.fixture(scope="module")
def saved_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("saved")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_train_loads_a_save_pretrained_model_through_model_flag(saved_model_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    output_dir = tmp_path / "run"
    code = main(
        ["train", "--model", str(saved_model_dir), "--task", "addition-1digit", "--max-steps", "2", "--staleness", "1",
         "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "3", "--eval-size", "4", "--eval-every", "0",
         "--output-dir", str(output_dir), "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["method"] == "vespo"
    # The trained weights are the saved model's shapes (not the embedded default's).
    trained, original = (
        load_file(str(output_dir / "final" / "model.safetensors")),
        load_file(str(saved_model_dir / "model.safetensors")),
    )
    assert {name: tensor.shape for name, tensor in trained.items()} == {
        name: tensor.shape for name, tensor in original.items()
    }
    assert "held-out accuracy" in capsys.readouterr().out


# ---------------------------------------------------------------------- bad configuration
def not_a_causal_lm(tmp_path: Path) -> str:
    from transformers import BertConfig

    directory = tmp_path / "bert"
    BertConfig(
        vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8
    ).save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--method", "ppo2"], "method"),
        (["--staleness", "0"], "staleness"),
        (["--max-lag", "-1"], "max_lag"),
        (["--group-size", "1"], "group_size"),
        (["--model", "NOT_A_CAUSAL_LM"], "model"),
        (["--model", "EMPTY_DIRECTORY"], "model"),
        (["--method-params", "k_pos=2,nonsense=1"], "method_params"),
        (["--correction", "ipw"], "correction"),
        (["--correction", "tis:cap=2+mis"], "correction"),  # two IS corrections
        (["--correction", "reject:high=-1"], "correction"),  # a k3 bound is >= 0
        (["--correction", "reject:low=none,high=none"], "correction"),  # keeps everything
        (["--correction", "reject:divergence=k9"], "correction"),
        (["--correction", "tis:cap=-1"], "correction"),  # was reported as a method_params error
        (["--mode", "eventually"], "mode"),
        (["--filter-groups", "--filter-groups-max-draws", "0"], "filter_groups_max_draws"),
        (["--overlong-penalty", "4"], "overlong_penalty"),  # L_cache without the penalty
        (["--overlong-penalty", "0,1"], "overlong_penalty"),  # an empty buffer
        (["--overlong-penalty", "2.5,1"], "overlong_penalty"),  # a fraction of a token
        (["--overlong-penalty", "7,1"], "overlong_penalty"),  # longer than the embedded model's 6 tokens
        (["--overlong-penalty", "4,0"], "overlong_penalty"),
        (["--overlong-penalty", "4,-1"], "overlong_penalty"),  # the sign is the option's: a penalty > 0
        (["--overlong-penalty", "4,inf"], "overlong_penalty"),
        (["--old-logprobs", "cached"], "old_logprobs"),
        # async's pi_old is the sampler's
        (["--mode", "async", "--old-logprobs", "recompute"], "old_logprobs"),
        (["--old-logprobs", "sampler", "--correction", "tis:cap=2"], "old_logprobs"),  # weight 1: no effect
        (["--old-logprobs", "sampler", "--correction", "opsm+reject"], "old_logprobs"),
        (["--proximal", "recompute"], "proximal"),  # sync mode: no worker policy to decouple from
        (["--mode", "async", "--proximal", "loglinear", "--method", "m2po"], "proximal"),
        (["--mode", "async", "--proximal", "exact"], "proximal"),
        (["--sft-target-accuracy", "1.5"], "sft_target_accuracy"),
        # every numeric option is finite and in range, checked before any file is written
        (["--lr", "inf"], "lr"),
        (["--lr", "nan"], "lr"),
        (["--weight-decay", "inf"], "weight_decay"),
        (["--weight-decay=-0.1"], "weight_decay"),
        (["--sft-lr", "inf"], "sft_lr"),
        (["--sft-lr", "0"], "sft_lr"),
        (["--sft-batch-size", "0"], "sft_batch_size"),
        (["--temperature", "inf"], "temperature"),
        (["--kl-coef", "nan"], "kl_coef"),
        (["--max-grad-norm=-inf"], "max_grad_norm"),
        (["--warmup-steps=-1"], "warmup_steps"),
        (["--staleness", "2.7"], "staleness"),
        (["--seed=-1"], "seed"),
        (["--eval-size", "0"], "eval_size"),
        (["--output-dir", ""], "output_dir"),
        (["--task", "addition-1digit"], "eval_size"),  # 100 problems, 512 held out: none left to train on
    ],
)
def test_bad_configuration_fails_before_any_work_naming_the_field(argv, field, tmp_path, capsys):
    argv = [
        {"NOT_A_CAUSAL_LM": not_a_causal_lm(tmp_path), "EMPTY_DIRECTORY": str(tmp_path)}.get(item, item)
        for item in argv
    ]
    output_dir = tmp_path / "run"
    code = main(["train", "--output-dir", str(output_dir), *argv, "--cache-dir", str(tmp_path / "cache")])
    assert code == 2
    message = capsys.readouterr().err
    assert f"error: {field}:" in message, message
    assert not output_dir.exists() and not (tmp_path / "cache").exists()  # nothing was started


def test_correction_specs_build_the_library_corrections():
    import softtrust as st
    from softtrust.train.loss_config import build_correction

    assert build_correction(None) is None
    assert build_correction("tis:cap=2,level=sequence") == st.TIS(cap=2, level="sequence")
    # every Reject parameter; 'none' is no bound
    assert build_correction("reject:divergence=ratio,level=sequence-max,low=0.5,high=none,veto=0.01") == (
        st.Reject(divergence="ratio", level="sequence-max", low=0.5, high=None, veto=0.01)
    )
    assert build_correction("reject") == st.Reject()  # verl's K3-RS default
    # '+' combines one IS correction with OPSM and Reject (any order, spaces allowed)
    assert build_correction("reject:high=0.02 + tis:cap=3+opsm:delta=0.4") == [
        st.Reject(high=0.02),
        st.TIS(cap=3),
        st.OPSM(delta=0.4),
    ]
    loss = build_method_loss(TrainConfig(method="clip", correction="tis:cap=3+reject:high=0.02"))
    assert loss.is_correction == st.TIS(cap=3) and loss.reject == st.Reject(high=0.02)
    with pytest.raises(ValueError, match="correction: 'reject:high=0.1\\+reject' holds two reject"):
        build_correction("reject:high=0.1+reject")
    with pytest.raises(ValueError, match="correction: 'reject:veto=1.5': veto must be"):
        build_correction("reject:veto=1.5")


def test_unknown_yaml_field_is_rejected_by_name(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("stalenes: 4\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "stalenes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("lr: .inf\n", "lr"),
        ("weight_decay: .inf\n", "weight_decay"),
        ("sft_batch_size: 0\n", "sft_batch_size"),
        ("staleness: 2.7\n", "staleness"),  # was truncated to 2
        ("staleness: true\n", "staleness"),  # was read as 1
        ("group_size: '8.0'\n", "group_size"),
        ("strict_reward: 1\n", "strict_reward"),
        ("method: 1\n", "method"),
        ("method_params: 5\n", "method_params"),
        ("lag_schedule: [0, 1.5]\n", "lag_schedule"),
        ("lr: null\n", "lr"),
        ("max_steps: [4]\n", "max_steps"),
        ("filter_groups: 1\n", "filter_groups"),
        ("mask_truncated: maybe\n", "mask_truncated"),
        ("overlong_penalty: [4, true]\n", "overlong_penalty"),
    ],
)
def test_yaml_values_are_checked_like_the_flags(yaml_text, field, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    output_dir = tmp_path / "run"
    assert main(["train", "--config", str(path), "--output-dir", str(output_dir)]) == 2
    err = capsys.readouterr().err
    assert f"softtrust train: error: {field}:" in err, err
    assert "Traceback" not in err and not output_dir.exists()


def test_yaml_numbers_written_as_text_read_like_flags(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("lr: 3e-4\nstaleness: '4'\nlag_schedule: 0,1\n")  # PyYAML reads 3e-4 as text
    config = TrainConfig.from_yaml(path)
    assert (config.lr, config.staleness, config.lag_schedule) == (3e-4, 4, [0, 1])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("method: [unclosed\n", "config: "),
        ("- 1\n- 2\n", "config: "),
        (None, "config: cannot read"),
    ],
    ids=["malformed", "a-list", "missing"],
)
def test_a_bad_config_file_is_an_error_line_not_a_traceback(content, message, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    if content is not None:
        path.write_text(content)
    assert main(["train", "--config", str(path), "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"softtrust train: error: {message}" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "", "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": null, "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": ["1+1="], "answer": "2"}', "'prompt' message 0 must be an object with string 'role'"),
        ('{"prompt": [], "answer": "2"}', "'prompt' must be a non-empty string or a non-empty list"),
        ('{"prompt": "1+1=", "answer": null}', "'answer' must be a string or a finite number"),
        ('{"prompt": "1+1=", "answer": {"v": 2}}', "'answer' must be a string or a finite number"),
        ('{"prompt": "1+1=", "answer": true}', "'answer' must be a string or a finite number"),
        ("[1, 2]", "expected an object (a record), got '[1, 2]'"),
        ('{"question": "1+1=", "answer": "2"}', "no 'prompt' column (the records before it have one)"),
        ('{"prompt": "1+1=", "answer": ' + "9" * 5000 + "}", "a number of more than 4300 digits"),
    ],
)
def test_bad_dataset_values_are_refused_by_line(line, message, tmp_path, capsys):
    dataset = tmp_path / "data.jsonl"
    good = "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(40))
    dataset.write_text(good + line + "\n")
    output_dir = tmp_path / "run"
    code = main(["train", "--dataset", str(dataset), "--eval-size", "4", "--output-dir", str(output_dir)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"softtrust train: error: dataset: {dataset}:41: {message}" in err, err
    assert "Traceback" not in err and not output_dir.exists()


def test_numeric_dataset_answers_are_read_as_text(tmp_path):
    from softtrust.train.tasks import read_jsonl_problems

    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": "half", "answer": 0.5}\n')
    assert [p.answer for p in read_jsonl_problems(path)] == ["2", "0.5"]


def test_without_the_package_every_entry_point_says_which_extra_to_install(monkeypatch, capsys):
    """Guards the missing-package error for --task reasoning-gym:NAME (the import made to fail, so
    this runs with or without reasoning-gym installed): validation, the task itself and the
    command line give one line naming pip install -e ".[tasks]"."""
    from softtrust.train.reasoning_gym_task import ReasoningGymTask

    loaded = [name for name in sys.modules if name.startswith("reasoning_gym.")]
    for name in ["reasoning_gym", *loaded]:  # `import reasoning_gym` now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ValueError,
        match=r'task: reasoning-gym:NAME needs the reasoning-gym package.*pip install -e "\.\[tasks\]"',
    ):
        TrainConfig(task="reasoning-gym:chain_sum").validate()
    with pytest.raises(ValueError, match=r"pip install -e \"\.\[tasks\]\""):
        ReasoningGymTask("chain_sum")
    assert main(["train", "--task", "reasoning-gym:chain_sum", "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and 'pip install -e ".[tasks]"' in error
