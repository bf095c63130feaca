"""Datasets (formats, columns, bad records), chat templates, rewards (built-in math, TRL's batched
signature, weights, None), samples.jsonl, micro-batches and the on-policy shortcut."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import softtrust
from softtrust.train.data import problems_from_records, read_records
from softtrust.train.problem import Problem
from softtrust.train.rewards import RewardSet, as_reward, extract_final_answer, math_reward
from softtrust.train.rollout import RewardScorer, decode_completions, encode_prompts, end_token_ids
from softtrust.train.tasks import DatasetTask
from softtrust.train.tiny import build_char_tokenizer
from softtrust.train.trainer import train
from test_train import micro_config, write_micro_model

from budgets import EPS32, MICRO_LOGPROB, rounding_budget


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


RECORDS = [
    {"prompt": "1+2=", "answer": "3", "level": 1},
    {"prompt": "4+5=", "answer": 9, "level": 2},
]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}<unk>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def write_all_formats(directory: Path) -> list[Path]:
    jsonl = directory / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    as_json = directory / "d.json"
    as_json.write_text(json.dumps(RECORDS))
    columns = directory / "columns.json"
    columns.write_text(json.dumps({key: [r[key] for r in RECORDS] for key in RECORDS[0]}))
    as_csv = directory / "d.csv"
    with as_csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(RECORDS[0]))
        writer.writeheader()
        writer.writerows(RECORDS)
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = directory / "d.parquet"
    rows = [{**r, "answer": str(r["answer"])} for r in RECORDS]
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from datasets import Dataset

    saved = directory / "saved"
    Dataset.from_list(rows).save_to_disk(str(saved))
    return [jsonl, as_json, columns, as_csv, parquet, saved]


def test_every_format_reads_the_same_problems_with_their_columns(tmp_path):
    for path in write_all_formats(tmp_path):
        problems = problems_from_records(read_records(path))
        assert [(p.prompt, p.answer) for p in problems] == [("1+2=", "3"), ("4+5=", "9")], path
        assert str(problems[1].columns["level"]) == "2", path  # CSV keeps text, the others numbers
        assert "prompt" not in problems[0].columns and "answer" in problems[0].columns


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"question": "1+1=", "answer": "2"}, "no 'prompt' column (the records before it have one)"),
        ({"prompt": None, "answer": "2"}, "'prompt' must be a non-empty string or a non-empty list"),
        ({"prompt": "  ", "answer": "2"}, "'prompt' must be a non-empty string or a non-empty list"),
        ({"prompt": [{"role": "user"}], "answer": "2"}, "'prompt' message 0 must be an object"),
        ({"prompt": [{"role": "robot", "content": "x"}], "answer": "2"}, "has role 'robot'"),
        ({"prompt": [{"role": "user", "content": "x"}], "answer": "2"}, "is a conversation but earlier"),
        ({"prompt": "1+1=", "answer": [2]}, "'answer' must be a string or a finite number"),
    ],
)
def test_bad_records_name_the_row(record, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([RECORDS[0], record]))
    with pytest.raises(ValueError, match="dataset: .*bad.json row 2: ") as error:
        problems_from_records(read_records(path))
    assert message in str(error.value)


def test_byte_order_marks_are_dropped_and_other_bytes_name_the_line(tmp_path):
    # a spreadsheet's UTF-8 export starts with a BOM: the same records as without it
    bom = b"\xef\xbb\xbf"
    for name, text in [
        ("a.csv", "prompt,answer\n1+2=,3\n"),
        ("a.jsonl", '{"prompt": "1+2=", "answer": "3"}\n'),
    ]:
        (tmp_path / name).write_bytes(bom + text.encode())
        problems = problems_from_records(read_records(tmp_path / name))
        assert [(p.prompt, p.answer) for p in problems] == [("1+2=", "3")], name
    latin = tmp_path / "latin.jsonl"  # é in Latin-1 on line 2
    latin.write_bytes(b'{"prompt": "1+2=", "answer": "3"}\n{"prompt": "caf\xe9", "answer": "3"}\n')
    with pytest.raises(ValueError, match=r"^dataset: .*latin.jsonl:2: not UTF-8 \(byte 0xe9 at offset 49"):
        read_records(latin)
    (tmp_path / "latin.csv").write_bytes(b"prompt,answer\n1+2=,3\n\xff,3\n")
    with pytest.raises(ValueError, match=r"latin.csv:3: not UTF-8"):
        read_records(tmp_path / "latin.csv")


def test_jsonl_lines_split_at_newlines_only(tmp_path):
    # U+2028 and U+0085 may stand unescaped inside a JSON string; str.splitlines would cut there
    path = tmp_path / "sep.jsonl"
    records = [{"prompt": "a\u2028b\u0085c", "answer": "1"}, {"prompt": "d", "answer": "2"}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in records), encoding="utf-8")
    assert [p.prompt for p in problems_from_records(read_records(path))] == ["a\u2028b\u0085c", "d"]


def test_a_column_option_the_data_lacks_is_named(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    with pytest.raises(
        ValueError, match=r"^prompt_column: 'nope' is not a column of the dataset \(its first"
    ):
        problems_from_records(read_records(path), "nope", "solution")
    with pytest.raises(
        ValueError, match=r"^answer_column: 'answer' is not a column .* has 'question', 'solution'"
    ):
        problems_from_records(read_records(path), "question")
    assert problems_from_records(read_records(path), "question", need_answer=False)[0].answer == ""


def test_bad_csv_row_and_unknown_format_and_missing_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("prompt,answer\n1+1=,2\n,3\n")
    with pytest.raises(ValueError, match=r"bad.csv row 2: 'prompt' must be a non-empty string"):
        problems_from_records(read_records(path))
    with pytest.raises(ValueError, match="unknown extension '.txt'"):
        read_records(tmp_path / "x.txt").__len__() if (tmp_path / "x.txt").write_text("a") else None
    columns = tmp_path / "q.jsonl"
    columns.write_text(json.dumps({"question": "1+1=", "solution": "2"}) + "\n")
    problems = problems_from_records(read_records(columns), "question", "solution")
    assert problems[0].prompt == "1+1=" and problems[0].answer == "2"


def conversation_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_conversations_are_rendered_with_the_template_and_end_at_the_end_of_turn_token():
    tokenizer = conversation_tokenizer()
    prompt = (("system", "be brief"), ("user", "1+2="))
    ids, mask = encode_prompts(tokenizer, [prompt, (("user", "10+20="),)])
    text = tokenizer.decode(ids[0][mask[0].bool()].tolist(), skip_special_tokens=False)
    assert text == "<s>system:be brief<unk><s>user:1+2=<unk><s>assistant:"  # no extra BOS added
    unk, eos = tokenizer.convert_tokens_to_ids(["<unk>", "</s>"])
    assert end_token_ids(tokenizer) == [eos, unk]
    completion = torch.tensor([[*tokenizer.convert_tokens_to_ids(list("12")), unk, 5]])
    assert decode_completions(tokenizer, completion, torch.tensor([[1, 1, 1, 0]])) == ["12"]
    with pytest.raises(
        ValueError, match="model: the dataset holds conversations but the tokenizer has no chat template"
    ):
        encode_prompts(build_char_tokenizer(), [prompt])


def test_system_prompt_goes_first_and_is_refused_for_plain_strings(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    task = DatasetTask(path, system_prompt="S")
    assert task.problems[0].prompt == (("system", "S"), ("user", "1+1="))
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="system_prompt: applies to conversational prompts"):
        DatasetTask(plain, system_prompt="S")


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("so the sum is \\boxed{71}.", "71", 1.0),
        ("\\boxed{\\frac{1}{2}} then \\boxed{0.5}", "0.5", 1.0),  # the last box
        ("23 + 48 = 71", "71", 1.0),
        ("work\n#### 1,234", "1234", 1.0),
        ("The answer is $5.", "5", 1.0),
        ("23 + 48 = 70", "71", 0.0),
        ("no number here", "3", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(completion, answer) == expected


def test_extract_final_answer_nested_braces():
    assert extract_final_answer("x \\boxed{\\frac{3}{4}} y") == "\\frac{3}{4}"
    assert extract_final_answer("nothing") is None


# TRL's batched signature, as a TRL user writes it (module-level: --reward imports it by name)
CALLS = []


def trl_style_reward(prompts, completions, completion_ids, answer, level, **kwargs):
    CALLS.append((prompts, completions, completion_ids, answer, level))
    return [
        None if lvl == 2 else float(c[0]["content"].strip() == a)
        for c, a, lvl in zip(completions, answer, level, strict=True)
    ]


def per_sample_with_columns(completion, answer, level):
    return 0.5 * level


def test_trl_batched_signature_weights_none_and_correctness():
    rewards = RewardSet.parse(f"{__name__}:trl_style_reward,{__name__}:per_sample_with_columns", [1.0, 0.1])
    scorer = RewardScorer(type("T", (), {"rewards": rewards})())
    conversation = (("user", "1+2="),)
    problems = [
        Problem(conversation, "3", {"answer": "3", "level": 1}),
        Problem(conversation, "3", {"answer": "3", "level": 2}),
    ]
    CALLS.clear()
    total, correct, parts = scorer.score(problems, ["3", "3"], [[1, 2], [3]])
    prompts, completions, ids, answer, level = CALLS[0]
    assert prompts == [[{"role": "user", "content": "1+2="}]] * 2
    assert completions == [[{"role": "assistant", "content": "3"}]] * 2 and ids == [[1, 2], [3]]
    assert answer == ["3", "3"] and level == [1, 2]
    # row 0: 1 x 1 + 0.1 x 0.5; row 1: None adds nothing, 0.1 x 1.0
    assert total.tolist() == pytest.approx([1.05, 0.1])
    assert correct == [True, False] and parts[f"{__name__}:trl_style_reward"] == [1.0, None]
    with pytest.raises(ValueError, match="reward_weights: 1 weight"):
        RewardSet.parse("math,exact", [1.0])
    with pytest.raises(ValueError, match="correctness_reward: 'numeric' is not one of"):
        RewardSet.parse("math,exact", None, "numeric")
    assert RewardSet.parse("math,exact", None, "exact").correctness == 1


def test_weighted_totals_beyond_float32_name_reward_weights():
    """``--reward-weights 3e38,3e38``: each weight is a float32, their sum on a completion both
    rewards score 1 is not; the total was an inf reward and NaN advantages ("advantages must be
    finite"). Now a ValueError that names the option and the terms."""
    rewards = RewardSet.parse("exact,numeric", [3e38, 3e38])
    scorer = RewardScorer(type("T", (), {"rewards": rewards})())
    problems = [Problem("1+2=", "3"), Problem("1+2=", "3")]
    total, _, _ = scorer.score(problems, ["4", "3.0"], [[], []])  # 0 + 0 and 0 + 3e38: in range
    assert total.tolist() == [0.0, pytest.approx(3e38, rel=EPS32)]
    with pytest.raises(
        ValueError, match=r"^reward_weights: .*3e\+38 \* exact 1\.0, 3e\+38 \* numeric 1\.0 = 6e\+38"
    ):
        scorer.score(problems, ["4", "3"], [[], []])
    negative = RewardScorer(type("T", (), {"rewards": RewardSet.parse("exact,numeric", [-3e38, -3e38])})())
    with pytest.raises(ValueError, match="= -6e\\+38 is beyond float32"):
        negative.score(problems[:1], ["3"], [[]])


def kwargs_only_reward(**kwargs):
    """Written for TRL, which passes everything by keyword: 1 when the completion is the answer."""
    return [float(c == a) for c, a in zip(kwargs["completions"], kwargs["answer"], strict=True)]


def args_kwargs_reward(*args, **kwargs):
    return [len(ids) + 0.5 * lvl for ids, lvl in zip(kwargs["completion_ids"], kwargs["level"], strict=True)]


def test_trl_rewards_taking_only_keywords_are_called_as_trl_calls_them():
    """``def reward(**kwargs)`` and ``def reward(*args, **kwargs)`` were refused ("takes neither ...");
    TRL calls every reward with keywords only, so they take TRL's batched call."""
    spec = f"{__name__}:kwargs_only_reward,{__name__}:args_kwargs_reward"
    rewards = RewardSet.parse(spec, [1.0, 0.1])
    assert [reward.batched for reward in rewards.rewards] == [True, True]
    scorer = RewardScorer(type("T", (), {"rewards": rewards})(), strict=True)
    problems = [
        Problem("1+2=", "3", {"answer": "3", "level": 1}),
        Problem("2+2=", "4", {"answer": "4", "level": 2}),
    ]
    total, correct, parts = scorer.score(problems, ["3", "5"], [[1, 2], [3]])
    assert parts[f"{__name__}:kwargs_only_reward"] == [1.0, 0.0]
    assert parts[f"{__name__}:args_kwargs_reward"] == [2.5, 2.0]
    assert total.tolist() == pytest.approx([1.25, 0.2]) and correct == [True, False]
    # a per-sample function keeps its convention: a named completion, or two positional parameters
    assert not as_reward("a", lambda completion, answer, **kwargs: 1.0).batched
    assert not as_reward("b", lambda text, target, **kwargs: 1.0).batched
    for refused in (lambda only_one: 1.0, lambda completion, **kwargs: 1.0):  # no answer parameter
        with pytest.raises(ValueError, match=r"reward: 'c' takes neither \(completion, answer"):
            as_reward("c", refused)


def bad_length_reward(prompts, completions, completion_ids, **kwargs):
    return [1.0]


def test_invalid_batched_reward_output_is_counted_or_raised():
    scorer = RewardScorer(type("T", (), {"rewards": RewardSet.parse(f"{__name__}:bad_length_reward")})())
    problems = [Problem("a", "1"), Problem("b", "1")]
    total, _, _ = scorer.score(problems, ["x", "y"], [[1], [2]])
    assert total.tolist() == [0.0, 0.0] and scorer.failures == 2
    scorer.strict = True
    with pytest.raises(TypeError, match="expected a list of 2 floats or None"):
        scorer.score(problems, ["x", "y"], [[1], [2]])


CHAR_TOKENIZER = build_char_tokenizer()


def ids_reward(prompts, completions, completion_ids, **kwargs):
    """1 when ``completion_ids`` are the tokens of the completion (its end token included), else 0."""
    return [
        float(bool(ids) and CHAR_TOKENIZER.decode(ids, skip_special_tokens=True) == text)
        for text, ids in zip(completions, completion_ids, strict=True)
    ]


def test_evaluation_passes_a_batched_reward_the_completion_ids_as_training_does(micro_model_dir):
    """Evaluation called TRL-style rewards with empty ``completion_ids`` while RL passed the real
    ones: a reward reading them scored 1.0 in training and 0 in held-out accuracy."""
    from transformers import AutoModelForCausalLM

    from softtrust.train.rollout import generate_rollout, greedy_accuracy, group_uniforms

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    task = type("T", (), {"rewards": RewardSet.parse(f"{__name__}:ids_reward")})()
    problems = [Problem(f"{i}+{i}=", "0") for i in range(3)]
    batch = generate_rollout(
        model,
        CHAR_TOKENIZER,
        problems,
        RewardScorer(task, strict=True),
        group_size=2,
        max_new_tokens=4,
        temperature=1.0,
        uniforms=group_uniforms(0, 0, [0, 1, 2], 2, 4),
    )
    assert batch.rewards.tolist() == [1.0] * 6  # training
    samples = []
    accuracy = greedy_accuracy(model, CHAR_TOKENIZER, task, problems, 4, strict=True, samples=samples)
    assert accuracy == 1.0 and all(sample["reward"] == 1.0 for sample in samples)  # evaluation


def test_conversational_dataset_trains_with_a_trl_reward_and_writes_samples(micro_model_dir, tmp_path):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    import shutil

    shutil.copytree(micro_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model_dir)
    data = tmp_path / "conv.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": [{"role": "user", "content": f"{i}+{j}="}], "answer": str(i + j), "level": i}
            )
            + "\n"
            for i in range(10)
            for j in range(10)
        )
    )
    config = micro_config(
        str(model_dir),
        tmp_path / "run",
        dataset=str(data),
        reward=f"{__name__}:trl_style_reward,math",
        reward_weights=[1.0, 0.5],
        correctness_reward="math",
        samples_every=2,
        num_samples=3,
        max_steps=2,
    )
    CALLS.clear()
    summary = train(config)
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    kinds = [(s["step"], s["kind"]) for s in samples]
    assert kinds == [(0, "eval")] * 3 + [(2, "train")] * 3 + [(2, "eval")] * 3
    assert all(s["prompt"].startswith("<s>user:") and s["prompt"].endswith("<s>assistant:") for s in samples)
    assert set(samples[0]["rewards"]) == {f"{__name__}:trl_style_reward", "math"}
    assert CALLS and all(isinstance(p, list) for p in CALLS[0][0])  # the reward saw conversations


def test_a_conversation_with_a_tokenizer_without_template_is_a_clear_error(micro_model_dir, tmp_path):
    data = tmp_path / "conv.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"{i}="}], "answer": str(i)}) + "\n"
            for i in range(20)
        )
    )
    with pytest.raises(ValueError, match="model: the dataset holds conversations"):
        train(micro_config(micro_model_dir, tmp_path / "run", dataset=str(data), reward="exact"))


# ---------------------------------------------------------------------- micro-batches, N = 1
def micro_minibatch(model, rows: int = 8, prompt: int = 3, width: int = 4, seed: int = 0, sampler=False):
    from softtrust.train.rollout import RolloutBatch
    from softtrust.train.staleness import MiniBatch

    generator = torch.Generator().manual_seed(seed)
    completion_mask = torch.ones(rows, width, dtype=torch.long)
    for row in range(rows):  # ragged completions: row r keeps 1 + r % width tokens
        completion_mask[row, 1 + row % width :] = 0
    input_ids = torch.randint(5, model.config.vocab_size, (rows, prompt + width), generator=generator)
    attention_mask = torch.cat([torch.ones(rows, prompt, dtype=torch.long), completion_mask], 1)
    batch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        completion_mask=completion_mask,
        rollout_logprobs=torch.zeros(rows, width),
        rewards=torch.zeros(rows),
    )
    from softtrust.train.scoring import completion_logprobs_of

    with torch.no_grad():
        current = completion_logprobs_of(model, input_ids, attention_mask, width).logprobs
    # ratios spread around 1 (log-ratio noise 0.3): clipping and selections act on some tokens
    old = (current + 0.3 * torch.randn(rows, width, generator=generator)) * completion_mask
    advantages = torch.randn(rows, generator=generator)
    rollout = (
        (old + 0.3 * torch.randn(rows, width, generator=generator)) * completion_mask if sampler else None
    )
    return MiniBatch(batch, old, rollout, advantages, 0, 0, (0, rows), 0)


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("method", "aggregation", "correction"),
    [
        ("clip", "token-mean", None),
        ("gspo", "seq-mean-token-mean", None),
        ("cispo", "seq-mean-token-sum-norm", None),
        ("m2po", "token-mean", None),  # batch_state: the second-moment cut over the whole mini-batch
        ("kl-cov", "token-mean", None),  # batch_state: the covariance selection over the whole mini-batch
        # batch_state: the IS weights' mean over the whole mini-batch
        ("clip", "token-mean", "tis:cap=1.2,self_normalize=true"),
        ("vespo", "token-mean", "mis:low=0.7,high=1.4,level=token,self_normalize=true"),
        ("m2po", "seq-mean-token-mean", "mis:low=0.3,high=3,level=sequence,self_normalize=true"),
    ],
)
def test_micro_batches_give_the_gradient_of_the_whole_mini_batch(
    micro_model_dir, tmp_path, method, aggregation, correction
):
    from transformers import AutoModelForCausalLM

    from softtrust.train.distributed import World
    from softtrust.train.learner import Learner
    from softtrust.train.loss_config import build_method_loss

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    minibatch = micro_minibatch(model, sampler=correction is not None)
    gradients, losses = [], []
    for size in (0, 3, 1):  # whole, uneven pieces (3, 3, 2), one row each
        config = micro_config(
            micro_model_dir,
            tmp_path / "run",
            method=method,
            aggregation=aggregation,
            micro_batch_size=size,
            correction=correction,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # weights stay put: compare gradients
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        learner = Learner(
            model, model, optimizer, scheduler, World(), [], [], build_method_loss(config), config
        )
        metrics = learner.update(minibatch)
        assert metrics["skipped"] == 0
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        losses.append(metrics["loss"])
    scale = gradients[0].abs().max()
    assert scale > 0
    # the same float32 sums split into pieces: a gradient entry sums ~8 rows x ~7 positions x 64
    # hidden units of products (10·eps32·√3584 ≈ 7e-5 of the largest entry), the loss ~56 tokens
    gradient_budget = rounding_budget(EPS32, terms=8 * 7 * 64, scale=float(scale))
    loss_budget = rounding_budget(EPS32, terms=8 * 7)
    for gradient, loss in zip(gradients[1:], losses[1:], strict=True):
        assert float((gradient - gradients[0]).abs().max()) <= gradient_budget
        assert loss == pytest.approx(losses[0], rel=loss_budget, abs=1e-7)


def test_on_policy_skips_the_behaviour_forward_and_keeps_ratio_one(micro_model_dir, tmp_path, monkeypatch):
    import softtrust.train.staleness as staleness_module

    calls = []
    real = staleness_module.behaviour_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(staleness_module, "behaviour_logprobs", counting)
    train(micro_config(micro_model_dir, tmp_path / "n1", staleness=1, max_steps=2, method="clip"))
    assert calls == []  # N = 1: no separate behaviour forward
    metrics = [json.loads(line) for line in (tmp_path / "n1" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["kl_behaviour"] == 0.0 for m in metrics)  # the learner's own log-probs: ratio 1
    train(micro_config(micro_model_dir, tmp_path / "n2", staleness=2, max_steps=2, method="clip"))
    assert len(calls) == 2  # N = 2: one behaviour forward per mini-batch of the rollout


@pytest.mark.numerics
def test_shared_prompt_prefill_samples_what_a_prefill_per_row_does(micro_model_dir):
    from transformers import AutoModelForCausalLM

    from softtrust.train.rollout import group_uniforms, sample_completions

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    tokenizer = build_char_tokenizer()
    prompts = [p for p in ("1+2=", "13+4=", "7+7=") for _ in range(4)]  # 3 groups of G = 4, ragged
    ids, mask = encode_prompts(tokenizer, prompts)
    common = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_new_tokens=5)
    uniforms = group_uniforms(0, 0, [0, 1, 2], 4, 5)
    per_row = sample_completions(model, ids, mask, temperature=1.0, uniforms=uniforms, **common)
    shared = sample_completions(model, ids, mask, temperature=1.0, uniforms=uniforms, group_size=4, **common)
    assert torch.equal(per_row[0], shared[0]) and torch.equal(per_row[1], shared[1])
    # the sampler's float32 log-probs through another KV-cache layout: the log-prob budget
    torch.testing.assert_close(per_row[2], shared[2], rtol=0, atol=MICRO_LOGPROB)
    assert len(set(map(tuple, per_row[0].tolist()))) > 3  # the rows of a group differ


@pytest.mark.parametrize(("top_k", "top_p"), [(3, None), (None, 0.5)])
def test_truncated_sampling_is_scored_by_the_learner_as_sampled(micro_model_dir, top_k, top_p):
    from transformers import AutoModelForCausalLM

    from softtrust.train.rollout import generate_rollout, group_uniforms
    from softtrust.train.scoring import Scoring, completion_logprobs_of

    model = AutoModelForCausalLM.from_pretrained(micro_model_dir, local_files_only=True).eval()
    tokenizer = build_char_tokenizer()
    problems = [Problem(f"{i}+{i}=", "0") for i in range(3)]
    batch = generate_rollout(
        model,
        tokenizer,
        problems,
        RewardScorer(type("T", (), {"reward": staticmethod(lambda c, a: 0.0)})()),
        group_size=4,
        max_new_tokens=4,
        temperature=1.0,
        uniforms=group_uniforms(0, 0, [0, 1, 2], 4, 4),
        top_k=top_k,
        top_p=top_p,
    )
    mask = batch.completion_mask.bool()
    args = (batch.input_ids, batch.attention_mask, batch.completion_length)
    with torch.no_grad():
        truncated = completion_logprobs_of(model, *args, Scoring(top_k=top_k, top_p=top_p)).logprobs
        full = completion_logprobs_of(model, *args).logprobs
    # the learner scores the truncated policy the sampler drew from: on-policy ratio 1
    assert float((truncated - batch.rollout_logprobs)[mask].abs().max()) < 1e-4
    assert float((full - batch.rollout_logprobs)[mask].abs().max()) > 1e-2  # the full softmax would not


@pytest.mark.parametrize("row", ["1+1=,2,extra", "1+1="], ids=["extra field", "missing field"])
def test_a_csv_row_with_more_or_fewer_fields_than_the_header_is_refused_naming_file_and_row(tmp_path, row):
    """A row with an extra field was accepted: ``csv.DictReader`` put it under a column named
    ``None``, which broke a ``**kwargs`` reward (every completion scored 0)."""
    path = tmp_path / "ragged.csv"
    path.write_text(f"prompt,answer\n2+2=,4\n\n{row}\n")
    with pytest.raises(ValueError, match=r"^dataset: .*ragged.csv row 2: \d fields, but the header has 2 "):
        read_records(path)
    tsv = tmp_path / "fine.tsv"
    tsv.write_text("prompt\tanswer\n2+2=\t4\n\n1,1=\t2\n")
    assert [record for _, record in read_records(tsv)] == [
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": "1,1=", "answer": "2"},
    ]


def test_the_installed_command_imports_a_reward_module_from_the_current_directory(micro_model_dir, tmp_path):
    """Issue 37: ``softtrust train --reward my_rewards:f`` (the console script) could not import
    ``./my_rewards.py`` (``No module named``), although ``python -m softtrust`` could: the
    script's ``sys.path`` starts with its ``bin/``, not the current directory."""
    command = Path(sys.executable).parent / "softtrust"
    if not command.is_file():
        pytest.skip(f"no installed softtrust command next to {sys.executable}")
    (tmp_path / "cwd_rewards.py").write_text("def quarter(completion, answer):\n    return 0.25\n")
    source = str(Path(softtrust.__file__).resolve().parents[1])  # this checkout's code, not the cwd
    env = {**os.environ, "PYTHONPATH": source, "OMP_NUM_THREADS": "1"}
    flags = ["--model", micro_model_dir, "--dataset", str(Path(micro_model_dir) / "sums.jsonl")]
    flags += ["--reward", "cwd_rewards:quarter", "--max-steps", "1", "--sft-steps", "0", "--eval-size", "8"]
    flags += ["--eval-every", "0", "--group-size", "4", "--prompts-per-step", "2", "--max-new-tokens", "3"]
    flags += ["--output-dir", "run", "--no-progress", "--num-threads", "1"]
    done = subprocess.run(
        [str(command), "train", *flags], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["reward/mean"] == 0.25  # the module's reward scored the step
