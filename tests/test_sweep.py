"""``softtrust sweep``: the grid runs and reports, resumes, detects collapse, and is on-policy at N = 1.

Every sweep here uses a ~10k-parameter Qwen2 saved to a temporary directory (``--model``),
a JSONL of single-digit sums, a reward that every completion can earn part of (so
advantages are non-zero and every update moves the model) and four optimizer steps.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from softtrust.cli import main
from softtrust.study import (
    EXIT_STOPPED,
    PRESETS,
    CollapseCriterion,
    load_run,
    mean_std_ci,
    run_outcome,
    split_methods,
)
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

from budgets import adam_budget

torch.set_num_threads(1)

MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)

REWARD_MODULE = '''
def digit_reward(completion, answer):
    """The fraction of digit characters (random weights already earn varied rewards)."""
    return sum(character.isdigit() for character in completion) / 3
'''


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> Path:
    """The micro model and char tokenizer (``save_pretrained``), ``sums.jsonl`` and a reward module."""
    directory = tmp_path_factory.mktemp("sweep_micro_model")
    (directory / "sums.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"{i}+{j}=", "answer": f"{i + j:02d}"}) + "\n"
            for i in range(10)
            for j in range(10)
        )
    )
    (directory / "sweep_test_rewards.py").write_text(REWARD_MODULE)
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture
def sweep_env(micro_model_dir, tmp_path, monkeypatch):
    """Cells (subprocesses) can import the reward module, cache warm starts in tmp_path and run on
    one thread each."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(micro_model_dir), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.setenv("SOFTTRUST_CACHE", str(tmp_path / "cache"))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):  # cells run --num-threads 1:
        monkeypatch.setenv(name, "1")  # no library starts a pool of its own beside it
    return micro_model_dir


def sweep_argv(model_dir: Path, output_dir: Path, methods: str, staleness: str, *extra: str) -> list[str]:
    return [
        "sweep",
        "--methods",
        methods,
        "--staleness",
        staleness,
        "--seeds",
        "1",
        "--output-dir",
        str(output_dir),
        "--jobs",
        "2",
        "--no-progress",
        # shared train flags, passed through to every cell
        "--model",
        str(model_dir),
        "--dataset",
        str(model_dir / "sums.jsonl"),
        "--reward",
        "sweep_test_rewards:digit_reward",
        "--group-size",
        "4",
        "--prompts-per-step",
        "2",
        "--max-new-tokens",
        "3",
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--eval-size",
        "8",
        "--save-every",
        "0",
        "--lr",
        "1e-2",
        "--sft-steps",  # the default (full) preset's warm start is for the embedded model
        "0",
        *extra,
    ]


def cells_run(output_dir: Path) -> list[str]:
    log = output_dir / "sweep-log.jsonl"
    return [json.loads(line)["cell"] for line in log.read_text().splitlines()] if log.is_file() else []


def is_png(path: Path) -> bool:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return False
    width, height = struct.unpack(">II", data[16:24])
    return width > 100 and height > 100


# ---------------------------------------------------------------------- (1) smoke sweep
def test_smoke_sweep_runs_the_grid_and_writes_all_four_outputs(sweep_env, tmp_path):
    output = tmp_path / "sweep"
    argv = sweep_argv(sweep_env, output, "clip,vespo", "1,2", "--sft-steps", "3", "--sft-batch-size", "8")
    assert main(argv) == 0
    assert sorted(cells_run(output)) == sorted(f"{m} N={n} seed=0" for m in ("clip", "vespo") for n in (1, 2))
    for name in ("summary.json", "summary.md", "curves.png", "final_vs_staleness.png"):
        assert (output / name).is_file(), name
    assert is_png(output / "curves.png") and is_png(output / "final_vs_staleness.png")

    report = json.loads((output / "summary.json").read_text())
    assert report["methods"] == ["clip", "vespo"] and report["staleness"] == [1, 2] and report["axis"] == "N"
    assert "rule" in report["collapse_criterion"]
    assert {(r["method"], r["N"]) for r in report["records"]} == {
        (m, n) for m in ("clip", "vespo") for n in (1, 2)
    }
    warm_starts = set()
    for record in report["records"]:
        for key in ("final_accuracy", "best_accuracy", "auc_accuracy", "final_reward"):
            assert set(record[key]) >= {"mean", "std", "ci95", "n", "values"}, key
            assert record[key]["n"] == 1 and 0.0 <= record[key]["mean"] <= 1.0, key
        assert record["runs_complete"] == 1 and record["collapsed_runs"] in (0, 1)
        (run,) = record["runs"]
        assert run["status"] == "complete" and run["steps"] == 4  # equal steps for every N
        assert set(run) >= {"collapsed", "collapse_step", "collapse_reason", "best_step", "curves"}
        metrics = [
            json.loads(line) for line in Path(run["run_dir"], "metrics.jsonl").read_text().splitlines()
        ]
        assert max(m["lag"] for m in metrics) == record["N"] - 1  # N changes only the staleness
        events = [json.loads(line) for line in Path(run["run_dir"], "events.jsonl").read_text().splitlines()]
        warm_starts |= {e["warmstart"] for e in events if "warmstart" in e}
    assert len(warm_starts) == 1  # the same cached warm start for every cell of the seed
    # every run records the code that made it (the trainer writes it; this checkout is a git tree)
    from softtrust._provenance import provenance

    expected = provenance()
    assert all(run["provenance"] == expected for record in report["records"] for run in record["runs"])
    assert expected["git_commit"] and {"softtrust", "torch", "transformers"} <= set(expected["versions"])
    assert len(report["code"]) == 1 and not report["mixed_code"]
    assert {p["metric"] for p in report["lag_profile"]} >= {"loss/ess", "kl_behaviour", "loss/ratio/mean"}

    table = (output / "summary.md").read_text()
    assert "| N | clip | vespo |" in table
    assert "\n| 1 | " in table and "\n| 2 | " in table and "Collapse criterion" in table


# ---------------------------------------------------------------------- (2) resumption
def test_sweep_resumes_by_running_only_the_missing_cells(sweep_env, tmp_path, capsys):
    output = tmp_path / "sweep"
    assert main(sweep_argv(sweep_env, output, "clip", "1")) == 0
    assert cells_run(output) == ["clip N=1 seed=0"]

    # the same sweep grown by one method: only the new cell runs
    assert main(sweep_argv(sweep_env, output, "clip,vespo", "1")) == 0
    assert cells_run(output) == ["clip N=1 seed=0", "vespo N=1 seed=0"]

    # a cell without its summary (as if interrupted) runs again; the complete one does not
    (output / "runs" / "clip" / "N1" / "seed0" / "summary.json").unlink()
    assert main(sweep_argv(sweep_env, output, "clip,vespo", "1")) == 0
    assert cells_run(output) == ["clip N=1 seed=0", "vespo N=1 seed=0", "clip N=1 seed=0"]
    report = json.loads((output / "summary.json").read_text())
    assert [r["runs_complete"] for r in report["records"]] == [1, 1]

    # nothing missing: nothing runs
    assert main(sweep_argv(sweep_env, output, "clip,vespo", "1")) == 0
    assert len(cells_run(output)) == 3

    # other settings in the same directory are refused, not mixed with the old results
    assert main(sweep_argv(sweep_env, output, "clip,vespo", "1", "--lr", "5e-3")) == 2
    assert "lr: 0.01 -> 0.005" in capsys.readouterr().err
    assert len(cells_run(output)) == 3


# ---------------------------------------------------------------------- progress
def test_sweep_progress_counts_steps_inside_cells_and_each_cell_log_fills_as_it_trains(
    sweep_env, tmp_path, capsys
):
    """Old behaviour: the bar counted finished cells (``0/4`` for the whole of a cell's minutes)
    and a cell's ``train.log`` held nothing until its last line (``--no-progress`` printed nothing)."""
    output = tmp_path / "sweep"
    argv = [arg for arg in sweep_argv(sweep_env, output, "clip", "1,2") if arg != "--no-progress"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "8/8" in err and "step" in err and "cells=2/2" in err, err  # 2 cells x 4 steps
    log = (output / "runs" / "clip" / "N2" / "seed0" / "train.log").read_text()
    assert "evaluating 8 held-out problems before RL" in log
    for step in range(1, 5):
        assert f"RL clip N=2 sync: step {step}/4, " in log, log


def test_steps_done_reads_each_started_cells_metrics(tmp_path):
    from softtrust.study.grid import Sweep
    from softtrust.study.runner import steps_done

    sweep = Sweep(split_methods("clip,vespo,sapo"), [1], [0], tmp_path, overrides={"max_steps": 4})
    clip, vespo, _ = sweep.cells()  # sapo: not started
    write_run(clip.directory(tmp_path), [(0, 0.3)], 4, summary={"steps": 4})  # done
    write_run(vespo.directory(tmp_path), [(0, 0.3)], 3)  # running (or interrupted) at step 3
    assert steps_done(sweep, sweep.cells()) == 4 + 3 + 0


# ---------------------------------------------------------------------- (3) collapse criterion
def steps(values: list[float], every: int = 1) -> list[tuple[int, float]]:
    return [(every * (index + 1), value) for index, value in enumerate(values)]


def test_collapse_criterion_ignores_a_stable_or_slightly_noisy_run():
    criterion = CollapseCriterion()
    accuracies = [(0, 0.40), (32, 0.45), (64, 0.33), (96, 0.50)]  # dips 0.07 < margin 0.10
    rewards = steps([0.40 + 0.05 * math.sin(i) for i in range(128)])
    assert criterion.check(0.40, accuracies, rewards) == (False, None, None)


def test_collapse_criterion_flags_the_first_accuracy_below_warm_start_minus_margin():
    criterion = CollapseCriterion(accuracy_margin=0.10)
    accuracies = [(0, 0.40), (32, 0.45), (64, 0.29), (96, 0.05)]
    assert criterion.check(0.40, accuracies, steps([0.4] * 128)) == (True, 64, "accuracy")
    assert criterion.check(0.40, [(0, 0.4), (32, float("nan"))], []) == (True, 32, "accuracy")


def test_collapse_criterion_flags_reward_collapse_at_the_end_of_the_first_low_window():
    criterion = CollapseCriterion(reward_margin=0.15, reward_window=8)
    rewards = steps([0.4] * 40 + [0.1] * 40)
    # trailing mean of 8 after k low steps: (0.4 (8 - k) + 0.1 k) / 8 < 0.25 first at k = 5: step 45
    assert criterion.check(0.40, [(0, 0.4), (80, 0.38)], rewards) == (True, 45, "reward")


def test_collapse_criterion_flags_stopped_and_nonfinite_runs():
    criterion = CollapseCriterion()
    assert criterion.check(0.4, [(0, 0.4)], steps([0.4] * 10), stopped=True) == (True, 10, "stopped")
    assert criterion.check(0.4, [(0, 0.4)], steps([0.4] * 10), nonfinite_steps=[7, 8]) == (
        True,
        7,
        "nonfinite",
    )


def write_run(
    directory: Path,
    accuracies: list[tuple[int, float]],
    steps_done: int,
    summary: dict | None = None,
    returncode: int | None = None,
) -> Path:
    """A run directory as the trainer leaves it: metrics, and a summary only when it finished."""
    directory.mkdir(parents=True)

    def jsonl(records: list[dict]) -> str:
        return "".join(json.dumps(record) + "\n" for record in records)

    (directory / "metrics.jsonl").write_text(
        jsonl([{"step": s, "reward/mean": 0.5} for s in range(1, steps_done + 1)])
    )
    (directory / "events.jsonl").write_text(jsonl([{"step": s, "eval/accuracy": v} for s, v in accuracies]))
    if summary is not None:
        (directory / "summary.json").write_text(json.dumps(summary))
    if returncode is not None:
        (directory / "sweep-cell.json").write_text(json.dumps({"returncode": returncode}))
    return directory


def read_run(directory: Path, max_steps: int, criterion: CollapseCriterion) -> dict:
    return run_outcome(load_run(directory), max_steps, criterion)


def test_only_finished_or_stopped_runs_report_a_best_accuracy(tmp_path):
    curve = [(0, 0.30), (16, 0.50), (32, 0.40)]
    done = {"steps": 32, "accuracy_before": 0.30, "accuracy_after": 0.40}
    complete = read_run(write_run(tmp_path / "done", curve, 32, summary=done), 32, CollapseCriterion())
    assert (complete["status"], complete["best_accuracy"], complete["best_step"]) == ("complete", 0.50, 16)
    assert complete["final_accuracy"] == 0.40
    # still running (no summary yet): its best so far is not a result, like its final
    running = read_run(write_run(tmp_path / "running", curve[:2], 20), 32, CollapseCriterion())
    assert running["status"] == "incomplete"
    assert running["best_accuracy"] is None and running["final_accuracy"] is None
    # stopped by the trainer (a collapse): its best stands, it will not go on
    stopped = read_run(
        write_run(tmp_path / "stopped", curve[:2], 20, returncode=EXIT_STOPPED), 32, CollapseCriterion()
    )
    assert (stopped["status"], stopped["best_accuracy"], stopped["collapsed"]) == ("stopped", 0.50, True)


# ---------------------------------------------------------------------- (4) on-policy sanity
@pytest.mark.numerics
@pytest.mark.costly
def test_on_policy_clip_vespo_and_reinforce_reach_the_same_parameters(sweep_env, tmp_path):
    """At N = 1 every ratio is 1 and VESPO's phi is 1: the three give the same gradient A grad log p."""
    output = tmp_path / "sweep"
    assert main(sweep_argv(sweep_env, output, "clip,vespo,reinforce", "1")) == 0
    weights = {
        method: load_file(str(output / "runs" / method / "N1" / "seed0" / "final" / "model.safetensors"))
        for method in ("clip", "vespo", "reinforce")
    }
    initial = load_file(str(sweep_env / "model.safetensors"))
    # the three formulas give one gradient in three op orders: 4 Adam steps at lr 1e-2 from float32
    # gradients summing 8 rows x 7 positions x 64 hidden units of products (≈ 1.7e-4)
    budget = adam_budget(steps=4, lr=1e-2, gradient_terms=8 * 7 * 64)
    moved = max(float((weights["clip"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 100 * budget  # four steps at lr 1e-2 really changed the model (~lr a step)
    for method in ("vespo", "reinforce"):
        for name, tensor in weights["clip"].items():
            difference = float((weights[method][name] - tensor).abs().max())
            assert difference <= budget, (method, name, difference)


# ---------------------------------------------------------------------- grid parsing, statistics
def test_method_specs_keep_commas_inside_brackets_and_route_level_to_the_config():
    specs = split_methods("clip,vespo[k_neg=2,lambda_neg=3],vespo[level=sequence-mean]")
    assert [s.label for s in specs] == ["clip", "vespo[k_neg=2,lambda_neg=3]", "vespo[level=sequence-mean]"]
    assert specs[1].method == "vespo" and specs[1].params == {"k_neg": 2, "lambda_neg": 3}
    assert specs[2].params == {} and specs[2].config == {"level": "sequence-mean"}
    assert specs[1].slug == "vespo-k_neg=2-lambda_neg=3"
    with pytest.raises(ValueError, match="methods"):
        split_methods("clip,clip")


def test_bad_method_parameter_or_unknown_flag_fails_before_any_run(sweep_env, tmp_path, capsys):
    output = tmp_path / "sweep"
    assert main(sweep_argv(sweep_env, output, "vespo[k_nope=2]", "1")) == 2
    assert "method_params" in capsys.readouterr().err
    assert main(sweep_argv(sweep_env, output, "clip", "1", "--no-such-flag", "3")) == 2
    assert "no-such-flag" in capsys.readouterr().err
    assert main(sweep_argv(sweep_env, output, "clip", "1", "--seed", "3")) == 2
    assert cells_run(output) == []


def test_mean_std_ci_uses_the_student_t_quantile():
    stat = mean_std_ci([0.2, 0.4, 0.6])
    assert stat["mean"] == pytest.approx(0.4) and stat["std"] == pytest.approx(0.2)
    assert stat["ci95"] == pytest.approx(4.3026527 * 0.2 / math.sqrt(3))  # t_{0.975, 2} = 4.3026527...
    assert mean_std_ci([0.5])["ci95"] is None


def test_async_mode_makes_the_lag_bound_the_grid_axis(sweep_env, tmp_path):
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    argv = sweep_argv(sweep_env, tmp_path, "clip", "1", "--mode", "async", "--max-lag", "0,4")
    arguments, extra = build_parser().parse_known_args(argv)
    sweep = sweep_from_arguments(arguments, extra)
    assert sweep.axis == "K" and sweep.staleness == [0, 4]
    configs = [sweep.cell_config(cell) for cell in sweep.cells()]
    assert [(c.mode, c.max_lag, c.method) for c in configs] == [("async", 0, "clip"), ("async", 4, "clip")]
    assert configs[1].output_dir.endswith(str(Path("runs", "clip", "K4", "seed0")))


def test_a_correction_flag_reaches_every_cell(sweep_env, tmp_path):
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    spec = "tis:cap=2+reject:divergence=ratio,level=sequence-mean,low=0.999,high=none"
    argv = sweep_argv(sweep_env, tmp_path, "clip,dppo", "1,2", "--correction", spec)
    sweep = sweep_from_arguments(*build_parser().parse_known_args(argv))
    sweep.validate()
    configs = [sweep.cell_config(cell) for cell in sweep.cells()]
    assert len(configs) == 4 and {c.correction for c in configs} == {spec}


# ---------------------------------------------------------------------- the learning-rate view
def without_lr(argv: list[str]) -> list[str]:
    index = argv.index("--lr")
    return argv[:index] + argv[index + 2 :]


def test_lr_axis_runs_every_rate_and_reports_the_largest_stable_one(sweep_env, tmp_path):
    output = tmp_path / "sweep"
    argv = without_lr(sweep_argv(sweep_env, output, "clip", "1", "--lrs", "2e-2,1e-2"))
    assert main(argv) == 0
    assert sorted(cells_run(output)) == ["clip N=1 lr=0.01 seed=0", "clip N=1 lr=0.02 seed=0"]
    assert (output / "runs" / "clip" / "N1" / "lr0.02" / "seed0" / "summary.json").is_file()
    for name in ("summary.json", "summary.md", "curves.png", "final_vs_staleness.png", "lr_stability.png"):
        assert (output / name).is_file(), name
    assert is_png(output / "lr_stability.png")

    report = json.loads((output / "summary.json").read_text())
    assert report["lrs"] == [0.01, 0.02]
    assert [(r["lr"], r["runs_complete"]) for r in report["records"]] == [(0.01, 1), (0.02, 1)]
    for record in report["records"]:  # each cell really trained at its own rate
        (run,) = record["runs"]
        assert Path(run["run_dir"], "config.yaml").read_text().count(f"lr: {record['lr']}") == 1
    (row,) = report["lr_stability"]
    collapsed = [r["collapsed_runs"] > 0 for r in report["records"]]
    expected = None if collapsed[0] else (0.01 if collapsed[1] else 0.02)
    assert row["largest_stable_lr"] == expected
    table = (output / "summary.md").read_text()
    assert "## Largest stable learning rate" in table and "## Learning rate 0.01" in table
    assert "## Learning rate 0.02" in table


def test_largest_stable_lr_scans_upwards_and_stops_at_the_first_failure():
    from softtrust.study.analysis import largest_stable_lr

    def record(lr, complete=2, collapsed=0):
        return {"lr": lr, "runs_complete": complete, "collapsed_runs": collapsed}

    stable = [record(1e-3), record(3e-4), record(2e-3)]
    assert largest_stable_lr(stable, seeds=2) == 2e-3
    # a collapse at 1e-3 ends the stable range, even though 2e-3 happened to survive
    assert largest_stable_lr([record(3e-4), record(1e-3, collapsed=1), record(2e-3)], seeds=2) == 3e-4
    # an incomplete rate is not stable; nothing stable at all gives None
    assert largest_stable_lr([record(3e-4, complete=1), record(1e-3)], seeds=2) is None
    assert largest_stable_lr([], seeds=2) is None


def test_run_directories_read_back_every_cell_directory_and_leave_out_other_folders(tmp_path):
    from softtrust.study.grid import Cell

    spec = split_methods("clip[proximal=held,proximal_every=16]")[0]
    cells = [
        Cell(spec, 64, 5),
        Cell(spec, 16, 14, axis="K"),
        Cell(spec, 64, 7, lr=5e-5),
        Cell(spec, 64, 7, lr=2e-4),
    ]
    for cell in cells:
        cell.directory(tmp_path).mkdir(parents=True)
    for stray in (
        "runs/clip/N64-old/seed5",
        "runs/clip/N64/notes",
        "runs/clip/X4/seed1",
        "runs/clip/N64/x2/seed3",
        "runs/clip/N64/seed5-old",
        "runs/clip/N064/seed5",
        "runs/clip/N64/seed05",
        "runs/clip/N64/lr2e-04/seed7",
        "runs/clip/N64/lr0.0002-old/seed7",
        "runs/clip/N64/lrfoo/seed7",
        "runs/clip/N64/lr2_0/seed7",
        "runs/clip/N64/lrnan/seed7",
        "runs/clip/N64/lr-0.001/seed7",
    ):
        (tmp_path / stray).mkdir(parents=True)
    (tmp_path / "runs/clip/N4").mkdir(parents=True)
    (tmp_path / "runs/clip/N4/seed4").write_text("a file, not a run")
    found = Cell.run_directories(tmp_path)
    expected = [
        (cell.directory(tmp_path), {"slug": spec.slug, "axis": cell.axis, "value": cell.staleness,
                                    "lr": None if cell.lr is None else f"{cell.lr:g}", "seed": cell.seed})
        for cell in cells
    ]  # fmt: skip
    assert sorted(found, key=str) == sorted(expected, key=str)
    assert [float(parts["lr"]) for _, parts in found if parts["lr"]] == [2e-4, 5e-5]  # sorted by folder name


def test_lr_and_lrs_together_or_bad_rates_are_refused(sweep_env, tmp_path, capsys):
    output = tmp_path / "sweep"
    assert main(sweep_argv(sweep_env, output, "clip", "1", "--lrs", "1e-3,2e-3")) == 2
    assert "--lrs" in capsys.readouterr().err
    assert main(without_lr(sweep_argv(sweep_env, output, "clip", "1", "--lrs", "1e-3,-1"))) == 2
    assert "lrs" in capsys.readouterr().err
    assert cells_run(output) == []


def test_an_lr_flag_with_a_preset_that_has_an_lr_axis_is_refused(tmp_path):
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    arguments, extra = build_parser().parse_known_args(
        ["sweep", "--preset", "lr-stability-long", "--lr", "3e-4", "--output-dir", str(tmp_path)]
    )
    with pytest.raises(ValueError, match=r"lr=0.0003 is given .* lrs=\[0.0001, 0.0002, 0.0003, 0.0006\]"):
        sweep_from_arguments(arguments, extra).validate()


# ---------------------------------------------------------------------- presets and paired statistics
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_valid_grid(name, tmp_path, micro_model_dir):
    from softtrust.cli import build_parser
    from softtrust.study.cli import PRESETS, sweep_from_arguments

    argv = ["sweep", "--preset", name, "--output-dir", str(tmp_path / "sweep")]
    given = {"model": str(micro_model_dir), "dataset": str(micro_model_dir / "sums.jsonl")}
    for key in PRESETS[name].get("requires", ()):  # a model and data of the user's own
        argv += [f"--{key}", given[key]]
    sweep = sweep_from_arguments(*build_parser().parse_known_args(argv))
    sweep.validate()  # every cell's TrainConfig, method spec and level
    expected = dict(PRESETS[name]["overrides"])
    if "lrs" in PRESETS[name]:  # the learning rate is a grid axis: the setup's own lr gives way
        expected.pop("lr", None)
        assert sweep.lrs == PRESETS[name]["lrs"] and "lr" not in sweep.overrides
    assert sweep.overrides.items() >= expected.items()
    assert sweep.jobs == PRESETS[name].get("jobs", os.cpu_count() or 1)  # async: one cell at a time


@pytest.mark.parametrize(
    ("preset", "seeds", "expected", "warning"),
    [
        (
            "confirm-sync",
            "14",
            list(range(14)),
            r"seeds 0, 1, 2, 3, 4 are not among the registered .*'14' is a number of seeds \(0-13\): for seed 14 alone write '14,'",
        ),
        ("confirm-sync", "14,", [14], None),
        ("confirm-sync", "9,10", [9, 10], None),
        (
            "confirm-lr",
            "9,10",
            [9, 10],
            r"seed 10 is not among the registered seeds of --preset confirm-lr \(5-9, ",
        ),
        ("quick", "14", list(range(14)), None),  # no registered seeds: a count is the usual form
    ],
)
def test_a_confirmation_preset_warns_of_seeds_it_did_not_register(
    preset, seeds, expected, warning, tmp_path, capsys
):
    """``--seeds 14`` is a count (seeds 0-13): on a ``confirm-*`` preset that runs unregistered
    seeds, no part of its registered analysis, so the command warns and shows the one-seed form."""
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    argv = ["sweep", "--preset", preset, "--seeds", seeds, "--output-dir", str(tmp_path / "sweep")]
    assert sweep_from_arguments(*build_parser().parse_known_args(argv)).seeds == expected
    err = capsys.readouterr().err
    if warning is None:
        assert err == ""
    else:
        assert re.search(warning, err), err


def test_the_real_model_pilot_needs_a_model_and_data_and_runs_without_a_warm_start(tmp_path):
    """``--preset pilot-smollm2`` (issue 34): without ``--model`` and ``--dataset`` it is one error
    naming both (its setup would otherwise fall back to the embedded model); with them, every
    cell trains that model from its pretrained weights (no supervised warm start)."""
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    argv = ["sweep", "--preset", "pilot-smollm2", "--output-dir", str(tmp_path / "sweep")]
    with pytest.raises(ValueError, match="pilot-smollm2: needs --model and --dataset .*real_model.py pilot"):
        sweep_from_arguments(*build_parser().parse_known_args(argv))
    with pytest.raises(ValueError, match="needs --dataset"):
        sweep_from_arguments(*build_parser().parse_known_args([*argv, "--model", str(tmp_path)]))
    argv += ["--model", str(tmp_path), "--dataset", str(tmp_path / "add.jsonl")]
    sweep = sweep_from_arguments(*build_parser().parse_known_args(argv))
    configs = [sweep.cell_config(cell) for cell in sweep.cells()]
    assert (
        len(configs) == 12
        and {c.staleness for c in configs} == {1, 8}
        and {c.seed for c in configs} == {0, 1, 2}
    )
    assert {c.model for c in configs} == {str(tmp_path)} and {c.sft_steps for c in configs} == {0}
    assert {c.max_steps % 8 for c in configs} == {0}  # whole rollouts at N = 8
    record = {"overrides": {"model": "/models/smollm2", "dataset": "/data/add.jsonl"}}  # --report-only
    arguments, extra = build_parser().parse_known_args(argv[:5])
    assert sweep_from_arguments(arguments, extra, record).overrides.items() >= record["overrides"].items()


def test_presets_of_the_next_runs_route_corrections_and_the_async_axis(tmp_path):
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    def sweep(name, *flags):
        argv = ["sweep", "--preset", name, "--output-dir", str(tmp_path), *flags]
        return sweep_from_arguments(*build_parser().parse_known_args(argv))

    mismatch = sweep("mismatch")
    assert mismatch.reference_method == "clip"  # each correction is tested against none
    configs = {cell.spec.label: mismatch.cell_config(cell) for cell in mismatch.cells()}
    assert configs["vespo[correction=tis]"].correction == "tis"
    assert configs["clip[correction=mis]"].correction == "mis" and configs["clip"].correction is None
    assert {c.mismatch for c in configs.values()} == {"bf16"} and {c.staleness for c in configs.values()} == {
        1
    }
    controls = sweep("controls")
    clip28 = next(c for c in controls.cells() if c.spec.label == "clip[eps_high=0.28]")
    assert controls.cell_config(clip28).method_params == {"eps_high": 0.28}
    assert sweep("mismatch", "--reference", "clip[correction=mis]").reference_method == "clip[correction=mis]"
    asynchronous = sweep("async")
    assert asynchronous.reference_method == "vespo"  # the default: vespo when in the grid
    assert asynchronous.axis == "K" and asynchronous.jobs == 1
    assert {asynchronous.cell_config(c).max_lag for c in asynchronous.cells()} == {1, 16}
    # the head-to-head shares the controls' clip and VESPO cells (the same configs)
    head = sweep("head-to-head")
    shared = {c.name: head.cell_config(c) for c in head.cells() if c.spec.label in ("clip", "vespo")}
    assert shared == {
        c.name: controls.cell_config(c) for c in controls.cells() if c.spec.label in ("clip", "vespo")
    }


def test_quick_preset_is_the_first_half_of_full_study_cells(tmp_path):
    """So the quick picture can be read against the full one cell by cell (docs/results.md)."""
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    def configs(preset):
        argv = ["sweep", "--preset", preset, "--output-dir", str(tmp_path)]
        sweep = sweep_from_arguments(*build_parser().parse_known_args(argv))
        return {cell.name: sweep.cell_config(cell) for cell in sweep.cells()}

    quick, full = configs("quick"), configs("full")
    assert len(quick) == 4 and set(quick) <= set(full)
    assert all(quick[name] == full[name].replace(max_steps=128) for name in quick)
    config = next(iter(full.values()))
    assert (config.task, config.max_steps, config.eval_size) == ("scratchpad", 256, 2000)
    assert config.sft_target_accuracy == 0.3


def synthetic_report(finals: dict, seeds=(0, 1, 2)) -> dict:
    """A report with one run per (method, N, seed) from ``{(method, N): [final per seed or None]}``."""
    records = []
    for (method, n), values in finals.items():
        runs = [
            {"seed": seed, "final_accuracy": value, "auc_accuracy": None if value is None else value / 2}
            for seed, value in zip(seeds, values, strict=True)
        ]
        records.append({"method": method, "N": n, "runs": runs})
    methods = list(dict.fromkeys(method for method, _ in finals))
    staleness = sorted({n for _, n in finals})
    return {
        "axis": "N",
        "methods": methods,
        "reference": "vespo",  # every test report here has vespo, the default reference
        "staleness": staleness,
        "seeds": list(seeds),
        "records": records,
    }


def test_paired_differences_pair_runs_by_seed_and_mark_intervals_that_exclude_zero():
    from softtrust.study.analysis import holm_adjust, paired_differences
    from softtrust.study.markdown import _tests_table

    report = synthetic_report(
        {
            ("clip", 4): [0.50, 0.30, 0.70],  # seeds differ by 20 points...
            ("clip", 64): [0.40, 0.21, 0.59],  # ...but every seed loses 9-11 points
            ("vespo", 4): [0.55, 0.28, 0.75],
            ("vespo", 64): [0.52, 0.30, None],  # seed 2 did not finish
        }
    )
    entries = {(e["comparison"], e["measure"]): e for e in paired_differences(report)}
    drop = entries[("clip: N = 64 − N = 4", "final_accuracy")]
    assert drop["values"] == pytest.approx([-0.10, -0.09, -0.11])
    assert drop["mean"] == pytest.approx(-0.10)
    assert drop["ci95"] == pytest.approx(4.3026527 * 0.01 / math.sqrt(3))
    assert drop["excludes_zero"]
    # unpaired, the same numbers would not separate: the per-cell intervals overlap widely
    assert mean_std_ci([0.50, 0.30, 0.70])["ci95"] > 0.4
    assert entries[("clip: N = 64 − N = 4", "auc_accuracy")]["mean"] == pytest.approx(-0.05)
    vespo_drop = entries[("vespo: N = 64 − N = 4", "final_accuracy")]
    assert vespo_drop["n"] == 2 and vespo_drop["values"] == pytest.approx([-0.03, 0.02])
    assert not vespo_drop["excludes_zero"]
    ahead = entries[("vespo − clip at N = 4", "final_accuracy")]
    assert ahead["values"] == pytest.approx([0.05, -0.02, 0.05]) and not ahead["excludes_zero"]
    assert ("clip − vespo at N = 4", "final_accuracy") not in entries  # vespo is the reference

    report["paired"] = holm_adjust(list(entries.values()))
    table = "\n".join(_tests_table(report, "paired", "Paired differences"))
    # t = -0.10 / (0.01 / √3) = -17.3 on 2 d.f.: p = 0.0033; times 8 tests (Holm's first step) = 0.027
    assert (
        "| clip: N = 64 − N = 4 | final accuracy | **-10.0 ± 2.5** | 0 / 3 | paired t | 0.003 | **0.027** |"
        in table
    )
    assert "| vespo: N = 64 − N = 4 | final accuracy | -0.5 ± 31.8 (n = 2) | 1 / 1 | paired t |" in table


def test_report_tables_mark_cells_with_fewer_seeds_than_the_grid():
    """A partial grid (some seeds not run yet) must not read as the mean over every seed."""
    from softtrust.study.markdown import format_stat

    three, one = mean_std_ci([0.5, 0.6, 0.7]), mean_std_ci([0.5])
    assert format_stat(three, seeds=3) == "60.0 ± 24.8"
    assert format_stat(three, seeds=5) == "60.0 ± 24.8 (n = 3)"
    assert format_stat(one, seeds=5) == "50.0 (n = 1)"
    assert format_stat(mean_std_ci([]), seeds=5) == "—"


# ---------------------------------------------------------------------- cells own their directories
def test_two_method_labels_with_one_directory_are_refused_before_any_run(sweep_env, tmp_path, capsys):
    output = tmp_path / "sweep"
    assert main(sweep_argv(sweep_env, output, "vespo,vespo[]", "1")) == 2
    assert "methods: 'vespo' and 'vespo[]' are the same cell directory" in capsys.readouterr().err
    assert cells_run(output) == []


def cell_metrics(output: Path, cell: str) -> list[dict]:
    return [json.loads(line) for line in (output / "runs" / cell / "metrics.jsonl").read_text().splitlines()]


def test_interrupted_sync_cell_resumes_to_the_straight_result(sweep_env, tmp_path):
    """k + k steps with a resume = 2k straight, for a sweep cell: N = 3, interrupted after its
    step-2 checkpoint (inside a rollout), then resumed by the sweep to 4 steps."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(sweep_argv(sweep_env, straight, "vespo", "3")) == 0
    assert main(sweep_argv(sweep_env, resumed, "vespo", "3", "--max-steps", "2", "--save-every", "2")) == 0
    (resumed / "runs" / "vespo" / "N3" / "seed0" / "summary.json").unlink()  # as if killed after the save
    assert main(sweep_argv(sweep_env, resumed, "vespo", "3", "--save-every", "2")) == 0
    events = [
        json.loads(line)
        for line in (resumed / "runs" / "vespo" / "N3" / "seed0" / "events.jsonl").read_text().splitlines()
    ]
    assert any(event.get("resumed_from", "").endswith("step-000002") for event in events)
    cell = "vespo/N3/seed0"
    assert [m["step"] for m in cell_metrics(resumed, cell)] == [1, 2, 3, 4]
    for key in ("reward/mean", "loss", "grad_norm"):
        assert [m[key] for m in cell_metrics(resumed, cell)] == [m[key] for m in cell_metrics(straight, cell)]
    a = load_file(str(straight / "runs" / cell / "final" / "model.safetensors"))
    b = load_file(str(resumed / "runs" / cell / "final" / "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise


def test_interrupted_async_cell_resumes(sweep_env, tmp_path):
    """The concurrent async worker: an interrupted cell resumes (it crashed with KeyError: 'history')."""
    output = tmp_path / "sweep"
    argv = ["--mode", "async", "--save-every", "2"]
    assert main(sweep_argv(sweep_env, output, "clip", "1", *argv, "--max-steps", "2")) == 0
    (output / "runs" / "clip" / "K1" / "seed0" / "summary.json").unlink()
    assert main(sweep_argv(sweep_env, output, "clip", "1", *argv)) == 0
    metrics = cell_metrics(output, "clip/K1/seed0")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(0 <= m["lag"] <= 1 for m in metrics)
    assert metrics[2]["policy_version"] == 2  # restarted from the learner's step-2 weights
    summary = json.loads((output / "runs" / "clip" / "K1" / "seed0" / "summary.json").read_text())
    assert summary["steps"] == 4


def test_confirmation_presets_are_the_registered_grid(tmp_path):
    """docs/preregistration.md names these cells: fresh seeds 5-14, the study's setup at lr 1e-4, the
    decoupled clip as a method spec (async, held pi_prox with M = K = 16), shared cells once."""
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments

    def sweep(name):
        argv = ["sweep", "--preset", name, "--output-dir", str(tmp_path)]
        return sweep_from_arguments(*build_parser().parse_known_args(argv))

    seeds = list(range(5, 15))
    sync, asynchronous, decoupled = sweep("confirm-sync"), sweep("confirm-async"), sweep("confirm-decoupled")
    assert (
        sync.seeds == seeds and asynchronous.seeds == seeds and sweep("confirm-lr").seeds == [5, 6, 7, 8, 9]
    )
    assert sync.reference_method == "vespo" and sorted(sync.staleness) == [4, 64]
    assert {sync.cell_config(c).lr for c in sync.cells()} == {1e-4}
    configs = {c.spec.label: decoupled.cell_config(c) for c in decoupled.cells()}
    held = configs["clip[proximal=held,proximal_every=16]"]
    assert (held.mode, held.max_lag, held.proximal, held.proximal_every, held.method) == (
        "async",
        16,
        "held",
        16,
        "clip",
    )
    assert configs["clip"].proximal == "none" and decoupled.jobs == 1
    naive = {c.name: asynchronous.cell_config(c) for c in asynchronous.cells() if c.spec.label == "clip"}
    for cell in (c for c in decoupled.cells() if c.spec.label == "clip"):  # the same cell, run once
        assert decoupled.cell_config(cell) == naive[cell.name]
    for config in configs.values():
        config.validate()
