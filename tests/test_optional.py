"""Optional dependencies (``softtrust._optional``): a missing one is a one-line error before any
work when the user asked for it, or a one-line notice after the work is saved, never a crash.

A missing module is simulated with ``sys.modules[name] = None``: ``import name`` then raises
``ImportError`` and ``importlib.util.find_spec(name)`` returns None, as for a module that is
not installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from softtrust.cli import main
from softtrust.train.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model

torch.set_num_threads(1)

MICRO = TinyModelConfig(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)


def without(monkeypatch, *modules: str) -> None:
    """Make ``modules`` (and their submodules already imported) impossible to import."""
    for name in list(sys.modules):
        if any(name == module or name.startswith(module + ".") for module in modules):
            monkeypatch.setitem(sys.modules, name, None)
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("optional_micro")
    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, MICRO, seed=0).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def train_argv(model_dir: Path, output_dir: Path, *extra: str) -> list[str]:
    return [
        "train", "--model", str(model_dir), "--task", "addition-1digit", "--max-steps", "2",
        "--staleness", "1", "--group-size", "2", "--prompts-per-step", "2", "--max-new-tokens", "3",
        "--eval-size", "4", "--eval-every", "0", "--save-every", "0", "--output-dir", str(output_dir),
        "--no-progress", *extra,
    ]  # fmt: skip


def test_train_without_matplotlib_completes_and_says_the_plot_was_skipped(
    micro_model_dir, tmp_path, monkeypatch, capsys
):
    """Old behaviour: with only ``.[trl]`` installed, ``softtrust train`` crashed on ``import
    matplotlib`` in ``RunLog.plot``, after the model and the summary were written."""
    without(monkeypatch, "matplotlib")
    output = tmp_path / "run"
    assert main(train_argv(micro_model_dir, output)) == 0
    captured = capsys.readouterr()
    assert "held-out accuracy" in captured.out
    notices = [line for line in captured.err.splitlines() if "reward_curve.png" in line]
    assert len(notices) == 1 and "matplotlib" in notices[0] and '.[train]"' in notices[0], captured.err
    assert "Traceback" not in captured.err
    assert (output / "summary.json").is_file() and (output / "final").is_dir()
    assert not (output / "reward_curve.png").exists()
    events = [json.loads(line) for line in (output / "events.jsonl").read_text().splitlines()]
    assert any("reward_curve.png" in event.get("warning", "") for event in events)


def test_report_to_tensorboard_without_tensorboard_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """Old behaviour: ``--report-to tensorboard`` without tensorboard crashed in ``RunLog``'s
    constructor with an ``ImportError`` traceback, after the run directory was created."""
    without(monkeypatch, "tensorboard", "torch.utils.tensorboard")
    output = tmp_path / "run"
    code = main(["train", "--report-to", "tensorboard", "--output-dir", str(output)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("softtrust train: error: report_to: --report-to tensorboard needs tensorboard")
    assert '.[tensorboard]"' in err and len(err.strip().splitlines()) == 1
    assert not output.exists()


def test_a_parquet_dataset_without_pyarrow_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Old behaviour: a ``ModuleNotFoundError`` traceback from ``import pyarrow.parquet``."""
    without(monkeypatch, "pyarrow")
    dataset = tmp_path / "data.parquet"
    dataset.write_bytes(b"PAR1")
    code = main(["train", "--dataset", str(dataset), "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "softtrust train: error: dataset: reading" in err and "pyarrow" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_a_core_only_install_gets_one_error_line_naming_the_train_extra():
    """Old behaviour: ``softtrust train`` without the ``train`` extra (``pip install -e .``) died
    with a ``ModuleNotFoundError`` traceback from ``import yaml``."""
    script = (
        "import sys; sys.modules['yaml'] = None\nfrom softtrust.cli import main\nsys.exit(main(['train']))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        'softtrust: error: pyyaml is not installed; pip install -e ".[train]" in the softtrust clone, '
        "or pip install pyyaml"
    )


# ---------------------------------------------------------------------- the sweep
def write_finished_sweep(root: Path, max_steps: int = 2) -> Path:
    """A sweep directory with one finished cell (clip, N = 1, seed 0), as the trainer leaves it."""
    run = root / "runs" / "clip" / "N1" / "seed0"
    run.mkdir(parents=True)
    metrics = "".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in range(1, max_steps + 1))
    (run / "metrics.jsonl").write_text(metrics)
    (run / "events.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.25}) + "\n")
    summary = {"steps": max_steps, "accuracy_before": 0.25, "accuracy_after": 0.5}
    (run / "summary.json").write_text(json.dumps(summary))
    return root


def report_only_argv(root: Path) -> list[str]:
    return [
        "sweep", "--methods", "clip", "--staleness", "1", "--seeds", "1", "--output-dir", str(root),
        "--report-only", "--max-steps", "2",
    ]  # fmt: skip


def test_sweep_report_without_matplotlib_writes_the_tables_and_says_the_figures_were_skipped(
    tmp_path, monkeypatch, capsys
):
    """Old behaviour: the report crashed on ``import matplotlib`` after ``summary.md`` (at the end
    of a whole sweep)."""
    root = write_finished_sweep(tmp_path / "sweep")
    without(monkeypatch, "matplotlib")
    assert main(report_only_argv(root)) == 0
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if "figures not written" in line]
    assert len(notices) == 1 and "matplotlib" in notices[0] and "Traceback" not in err, err
    assert (root / "summary.md").is_file() and (root / "summary.json").is_file()
    assert not (root / "curves.png").exists()


def test_sweep_without_scipy_is_refused_before_any_cell_runs(tmp_path, monkeypatch, capsys):
    """Old behaviour: every cell trained, then the report crashed on ``from scipy import stats``."""
    without(monkeypatch, "scipy")
    root = tmp_path / "sweep"
    argv = ["sweep", "--methods", "clip", "--staleness", "1", "--seeds", "1", "--output-dir", str(root)]
    assert main([*argv, "--max-steps", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("softtrust sweep: error: sweep: the report (its intervals and tests) needs scipy")
    assert len(err.strip().splitlines()) == 1 and not (root / "runs").exists()
