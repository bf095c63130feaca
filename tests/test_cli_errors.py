"""Malformed ``softtrust train`` and ``softtrust sweep`` input found by issue 37's attack round:
one error line naming the option, what it got and what it takes, exit code 2, no traceback,
and nothing created (no run, sweep or cache directory). Each case here crashed, ran on with a
value it could not use, or was silently read otherwise before.
"""

from __future__ import annotations

import contextlib
import re
import signal

import pytest

from softtrust.cli import main

# A tiny train command (the embedded model, 5 warm-start steps): a case that got through the
# checks would still end in seconds.
TINY = ["train", "--sft-steps", "5", "--eval-size", "8", "--prompts-per-step", "2", "--group-size", "2",
        "--eval-every", "0", "--max-steps", "1", "--staleness", "1", "--no-progress"]  # fmt: skip
SWEEP = ["sweep", "--methods", "clip", "--staleness", "1", "--seeds", "0,", "--jobs", "1", "--no-progress",
         "--max-steps", "1", "--sft-steps", "5", "--eval-size", "8", "--prompts-per-step", "2",
         "--group-size", "2", "--eval-every", "0"]  # fmt: skip
HUGE = "1" + "0" * 30
SECONDS_PER_CASE = 60  # a refusal takes well under a second; this only turns a hang into a failure


class Hung(BaseException):
    """Raised by ``deadline``'s alarm (not an ``Exception``: the command must not catch it)."""


@contextlib.contextmanager
def deadline(seconds: int = SECONDS_PER_CASE):
    """Raise ``Hung`` in the main thread after ``seconds`` (a check looping over a huge value)."""

    def hung(signum, frame):
        raise Hung(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def make_workdir(tmp_path, monkeypatch):
    """``tmp_path`` as an empty working directory (the default run and sweep directories land in
    it) holding a file ``FILE`` and a dataset ``data.jsonl``, with the warm-start cache inside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SOFTTRUST_CACHE", str(tmp_path / "cache"))
    (tmp_path / "FILE").write_text("a file, not a directory\n")
    rows = "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(40))
    (tmp_path / "data.jsonl").write_text(rows)
    return tmp_path


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    return make_workdir(tmp_path, monkeypatch)


def refused(argv: list[str], root, capsys) -> str:
    """Run ``argv`` in ``root``; assert exit code 2, exactly one ``softtrust ...: error: ...``
    line, no traceback and nothing new in ``root``. Returns the line."""
    before = set(root.rglob("*"))
    try:
        with deadline():
            code = main(argv)
    except SystemExit as exit_:  # argparse's own errors (a flag without its value, ...)
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if re.match(r"softtrust( train| sweep)?: error: ", line)]
    assert len(lines) == 1, err
    assert set(root.rglob("*")) == before, sorted(set(root.rglob("*")) - before)
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # a repeated key was silently the last one
        (["--method-params", "k_pos=1,k_pos=2"], "method_params: 'k_pos' is given twice"),
        (["--correction", "tis:cap=2,cap=3"], "correction: 'cap' is given twice"),
        # a KeyError after the warm start
        (["--mode", "async", "--lag-schedule", "-1"], "lag_schedule: must be >= 0 (got [-1])"),
        (["--mode", "async", "--lag-schedule", "0,1,-2"], "lag_schedule: must be >= 0"),
        # 'Overflow when unpacking long long', naming no field
        (["--seed", "99999999999999999999"], "seed: must be <= 4294967295 (got 99999999999999999999)"),
        # unbounded sizes: memory or threads without end
        (["--max-new-tokens", "100000000000"], "max_new_tokens: must be <= 32768"),
        (["--num-threads", "100000000"], "num_threads: must be <= 1024"),
        (["--sft-batch-size", "100000000"], "sft_batch_size: must be <= 65536"),
        (["--eval-size", HUGE], "eval_size: must be <= 65536"),  # drew held-out problems forever
        (
            ["--group-size", "4096", "--prompts-per-step", "4096"],
            "staleness, prompts_per_step, group_size: a rollout of N x m x G = 1 x 4096 x 4096 = 16777216 "
            "completions is more than the most, 2^20 = 1048576",
        ),
        (
            ["--mode", "async", "--max-lag", "100000", "--group-size", "16"],
            "max_lag, prompts_per_step, group_size: a rollout of (K + 1) x m x G = 100001 x 2 x 16",
        ),
        (["--max-steps", HUGE], "max_steps: must be at most 9223372036854775807 (2^63 - 1)"),
        (["--group-size", HUGE], "group_size: must be at most 9223372036854775807"),
        # finite, but not as the float32 the model and optimizer hold it in
        (["--lr", "1e39"], "lr: must be at most 3.402823e+38 in magnitude, the largest float32 (got 1e+39)"),
        (["--temperature", "1e-50"], "temperature: must be > 0, and 1e-50 is 0 as a float32"),
        (
            ["--dataset", "data.jsonl", "--reward-weights", "1,1e39"],
            "reward_weights: must be at most 3.402823e+38",
        ),
        # options the built-in task ignored without a word
        (
            ["--reward", "numeric"],
            "reward: applies to --dataset and reasoning-gym tasks; this run trains on "
            "the built-in task 'addition', which would ignore it (got 'numeric')",
        ),
        (["--reward-weights", "2"], "reward_weights: applies to --dataset and reasoning-gym tasks"),
        (["--correctness-reward", "exact"], "correctness_reward: applies to --dataset and reasoning-gym"),
        (["--system-prompt", "Be brief."], "system_prompt: applies to --dataset and reasoning-gym tasks"),
        (
            ["--prompt-column", "q"],
            "prompt_column: applies to --dataset; this run trains on the built-in task",
        ),
        # a column the dataset lacks named the dataset's first line, not the option
        (
            ["--dataset", "data.jsonl", "--prompt-column", "q"],
            "prompt_column: 'q' is not a column of the dataset",
        ),
        (
            ["--dataset", "data.jsonl", "--answer-column", "a"],
            "answer_column: 'a' is not a column of the dataset",
        ),
        # directories that cannot be created
        (["--output-dir", "/dev/null"], "output_dir: '/dev/null' exists and is not a directory"),
        (["--output-dir", "FILE/run"], "output_dir: 'FILE/run' lies under"),
        (["--cache-dir", "/dev/null"], "cache_dir: '/dev/null' exists and is not a directory"),
        (["--cache-dir", "FILE/cache"], "cache_dir: 'FILE/cache' lies under"),
        # a TypeError traceback, or 'Empty module name' naming no option
        (["--dataset", "data.jsonl", "--reward", ".rel:f"], "reward: '.rel:f' is not module:function"),
        (["--dataset", "data.jsonl", "--reward", ":f"], "reward: ':f' is not module:function"),
        (["--dataset", "data.jsonl", "--reward", "exact,os:"], "reward: 'os:' is not module:function"),
    ],
)
def test_train_refuses_bad_values_before_any_work(argv, expected, workdir, capsys):
    line = refused([*TINY, *argv], workdir, capsys)
    assert line.startswith("softtrust train: error: ") and expected in line, line


def test_a_bad_directory_is_refused_on_resume_too(workdir, capsys):
    """``--cache-dir`` may change on ``--resume``: the new value is checked like a new run's."""
    run = workdir / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("method: clip\n")
    line = refused(["train", "--resume", str(run), "--cache-dir", "/dev/null"], workdir, capsys)
    assert "cache_dir: '/dev/null' exists and is not a directory" in line


def test_help_states_the_upper_bounds(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for bound in ("At most 32768", "at most 1024", "0 to 2^32 - 1", "at most 65536", "at most 2^20"):
        assert bound in help_text, bound


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # duplicate grid values aborted the sweep midway (or ran one cell twice)
        (["--seeds", "0,0"], "seeds: 0 is given twice; give each value once (got '0,0')"),
        (["--seeds", "3,03"], "seeds: 3 is given twice"),
        (["--staleness", "1,1"], "staleness: 1 is given twice"),
        (["--mode", "async", "--max-lag", "2,2"], "max_lag: 2 is given twice"),
        (["--mode", "async", "--max-lag", "1,x"], "max_lag: expected integers"),  # was named staleness
        (["--lrs", "3e-4,3e-4"], "lrs: 0.0003 is given twice"),
        (
            ["--lrs", "3e-4,3.0000001e-4"],
            "lrs: 0.00030000001 and 0.0003 name one cell directory (lr0.0003)",
        ),
        (["--lrs", "1e39"], "lrs: must be at most 3.402823e+38"),
        # list(range(10**9)) before any check: the process was killed for memory
        (["--seeds", "1000000000"], "seeds: at most 1000 seeds in one sweep"),
        (["--seeds", "4294967296,"], "seeds: a seed is at most 4294967295"),
        # an empty value was silently the preset's (the full study's grid)
        (["--methods", ""], "methods: give at least one method"),
        (["--seeds", ""], "seeds: expected non-negative integers, got ''"),
        (["--staleness", ""], "staleness: expected non-negative integers, got ''"),
        (["--lrs", ""], "lrs: expected finite learning rates > 0, got ''"),
        (["--reference", ""], "reference: '' is not a method of the sweep"),
        (["--output-dir", ""], "output_dir: must not be empty"),
        # sync mode read only the first of several lag bounds
        (["--max-lag", "1,2"], "max_lag: several lag bounds are a grid axis of --mode async"),
        # a refused method spec named a field, not the option
        (["--methods", "clip,clip[nonsense=1]"], "methods: 'clip[nonsense=1]': method_params: clip rejects"),
        (["--methods", "vespo[k_pos=1,k_pos=2]"], "methods: 'k_pos' is given twice"),
        # directories that cannot be created or read
        (["--output-dir", "/dev/null"], "output_dir: '/dev/null' exists and is not a directory"),
        (["--output-dir", "FILE/sweep"], "output_dir: 'FILE/sweep' lies under"),
        (["--report-only", "--output-dir", "FILE"], "output_dir: 'FILE' exists and is not a directory"),
        (["--report-only", "--output-dir", "FILE/sweep"], "output_dir: 'FILE/sweep' lies under"),
    ],
)
def test_sweep_refuses_a_bad_grid_before_any_cell(argv, expected, workdir, capsys):
    line = refused([*SWEEP, *argv], workdir, capsys)
    assert line.startswith("softtrust sweep: error: ") and expected in line, line
