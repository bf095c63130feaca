"""``softtrust sweep --report-only`` reads the sweep's own record (``sweep.json``, each cell's
``config.yaml``) and the run files it reports strictly: settings other than the runs' are refused
by name, a damaged file is a one-line error naming the file and the line, and in either case the
report already there is left as it was. Synthetic run directories (``test_study_report``): seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from softtrust.cli import main
from softtrust.study.presets import STUDY_SETUP
from test_study_report import STEPS, make_sweep


def recorded_sweep(root: Path):
    """The report tests' grid (clip, vespo x N 4, 64 x seeds 0-2) as a sweep of the study's setup
    with 8 steps and lr 1e-3 leaves it: ``sweep.json``, each cell's ``config.yaml``, and its report."""
    sweep = make_sweep(root)
    sweep.overrides = {**STUDY_SETUP, "max_steps": STEPS, "lr": 1e-3, "num_threads": 1}
    for cell in sweep.cells():
        config = sweep.cell_config(cell).resolved()
        (cell.directory(root) / "config.yaml").write_text(config.to_yaml())
    record = {"methods": sweep.labels, "staleness": [4, 64], "seeds": [0, 1, 2], "axis": "N", "lrs": None}
    (root / "sweep.json").write_text(
        json.dumps({**record, "overrides": sweep.overrides})
    )  # as sweeps wrote it
    assert main(["sweep", "--output-dir", str(root), "--report-only"]) == 0
    return sweep


def report_files(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in ("summary.json", "summary.md")}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


# ---------------------------------------------------------------------- the record
def test_report_only_takes_the_grid_and_settings_from_the_sweeps_record(tmp_path, capsys):
    """No flag but the directory: the report is the recorded grid with the recorded settings
    (before: the full preset's grid and settings, and no run of it found)."""
    recorded_sweep(tmp_path)
    report = json.loads((tmp_path / "summary.json").read_text())
    assert report["methods"] == ["clip", "vespo"] and report["staleness"] == [4, 64]
    assert report["seeds"] == [0, 1, 2] and report["overrides"]["max_steps"] == STEPS
    assert all(record["runs_complete"] == 3 for record in report["records"])
    text = (tmp_path / "summary.md").read_text()
    assert "`lr=0.001`, `max_steps=8`" in text and text.count("`num_threads=1`.") == 1
    # the grid given (a subset) is reported with the recorded settings
    argv = ["sweep", "--output-dir", str(tmp_path), "--report-only", "--methods", "clip", "--staleness", "64"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "summary.json").read_text())
    assert report["methods"] == ["clip"] and report["records"][0]["runs_complete"] == 3


def test_report_only_with_other_settings_than_the_runs_is_refused_naming_them(tmp_path, capsys):
    """Issue 37: ``--max-steps 500 --lr 0.5`` on 8-step runs wrote "shared settings max_steps=500,
    lr=0.5", every cell unfinished, over the right report."""
    recorded_sweep(tmp_path)
    before = report_files(tmp_path)
    argv = ["sweep", "--methods", "clip,vespo", "--staleness", "4,64", "--seeds", "3"]
    argv += ["--output-dir", str(tmp_path), "--report-only", "--max-steps", "500", "--lr", "0.5"]
    assert main(argv) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"softtrust sweep: error: output_dir: the runs in {str(tmp_path)!r} were made")
    assert "max_steps: the runs have 8, given 500" in err and "lr: the runs have 0.001, given 0.5" in err
    assert "clip N=4 seed=0 and 11 more" in err
    assert report_files(tmp_path) == before  # the right report stays
    # a preset's settings are checked the same way (the full preset: 256 steps, lr 1e-4, ...)
    assert main(["sweep", "--preset", "full", "--output-dir", str(tmp_path), "--report-only"]) == 2
    err = one_line_error(capsys)
    assert "lr: the runs have 0.001, given 0.0001; max_steps: the runs have 8, given 256;" in err
    # the settings the runs were made with are accepted when given
    assert main([*argv[:-4], "--max-steps", str(STEPS), "--lr", "1e-3"]) == 0


def test_report_only_without_a_record_checks_the_cells_configs(tmp_path, capsys):
    """An older sweep without sweep.json: the flags describe it, and each cell's config.yaml checks them."""
    recorded_sweep(tmp_path)
    (tmp_path / "sweep.json").unlink()
    argv = ["sweep", "--methods", "clip,vespo", "--staleness", "4,64", "--seeds", "3", "--max-steps", "8"]
    argv += ["--output-dir", str(tmp_path), "--report-only"]
    assert main(argv) == 2  # the full preset's setup, with its lr
    err = one_line_error(capsys)
    assert "(lr: the runs have 0.001, given 0.0001; clip N=4 seed=0 and 11 more)" in err
    assert err.endswith("give the --preset and train flags the sweep ran with (it has no sweep.json)")
    assert main([*argv, "--lr", "1e-3"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[1]", r"sweep.json: expected a JSON object, got list '\[1\]'"),
        ('{"methods": ["clip"], "staleness": [4],', r"sweep.json, line 1: not valid JSON"),
        (
            '{"methods": "clip", "staleness": [4], "seeds": [0]}',
            r"sweep.json: 'methods' is 'clip'; expected a list",
        ),
        (
            '{"methods": ["clip"], "staleness": [4], "seeds": [0], "overrides": {"max_stepz": 2}}',
            r"sweep.json: 'overrides' are not train settings \(config: unknown field\(s\) \['max_stepz'\]",
        ),
    ],
)
def test_a_damaged_record_is_a_one_line_error_naming_it(tmp_path, capsys, content, expected):
    recorded_sweep(tmp_path)
    before = report_files(tmp_path)
    (tmp_path / "sweep.json").write_text(content)
    assert main(["sweep", "--output-dir", str(tmp_path), "--report-only"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"softtrust sweep: error: {tmp_path / 'sweep.json'}")
    assert pytest.importorskip("re").search(expected, err), err
    assert report_files(tmp_path) == before


def test_report_only_on_a_file_says_it_is_not_a_directory(tmp_path, capsys):
    path = tmp_path / "some_file"
    path.write_text("x\n")
    assert main(["sweep", "--output-dir", str(path), "--report-only"]) == 2
    assert f"output_dir: {str(path)!r} exists and is not a directory" in one_line_error(capsys)


# ---------------------------------------------------------------------- damaged run files
CELL = Path("runs") / "vespo" / "N64" / "seed1"


def damage_metrics(lines: list[dict]) -> None:
    del lines[2]["reward/mean"]


def null_accuracy(lines: list[dict]) -> None:
    lines[-1]["eval/accuracy"] = None


@pytest.mark.parametrize(
    ("name", "damage", "expected"),
    [
        ("summary.json", "[1]", "summary.json: expected a JSON object, got list '[1]'"),
        ("summary.json", '{"steps": 8, "accuracy_before": 0.3', "summary.json, line 1: not valid JSON"),
        (
            "summary.json",
            '{"steps": 8, "accuracy_before": 0.3}',
            "summary.json: 'accuracy_after' is 'missing'",
        ),
        (
            "metrics.jsonl",
            damage_metrics,
            "metrics.jsonl, line 3: 'reward/mean' is missing; expected a number",
        ),
        ("events.jsonl", null_accuracy, "events.jsonl, line 3: 'eval/accuracy' is None; expected a number"),
        ("metrics.jsonl", "{bad json\n{}\n", "metrics.jsonl, line 1: not valid JSON"),
        ("metrics.jsonl", "[1]\n", "metrics.jsonl, line 1: expected a JSON object, got list '[1]'"),
        ("events.jsonl", '{"step": "x", "eval/accuracy": 0.5}\n', "events.jsonl, line 1: 'step' is 'x'"),
        ("sweep-cell.json", '{"returncode": "3"}', "sweep-cell.json: 'returncode' is '3'"),
        ("summary.json", b"\xff\xfe", "summary.json: cannot be read"),
    ],
)
def test_a_damaged_run_file_is_a_one_line_error_naming_the_file_and_line(
    tmp_path, capsys, name, damage, expected
):
    """Issue 37: ``[1]`` as summary.json, a metrics line without ``reward/mean``, a null held-out
    accuracy gave tracebacks, and bad JSON an error naming no file. The choice: refuse the report
    (no record is skipped silently, nor with a warning that a reader of summary.md never sees)."""
    recorded_sweep(tmp_path)
    before = report_files(tmp_path)
    path = tmp_path / CELL / name
    if callable(damage):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        damage(lines)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    elif isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        path.write_text(damage)
    assert main(["sweep", "--output-dir", str(tmp_path), "--report-only"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"softtrust sweep: error: {tmp_path / CELL / name}"), err
    assert expected in err, err
    assert report_files(tmp_path) == before


def test_a_torn_last_line_is_an_interruption_not_damage(tmp_path, capsys):
    """A kill mid-write leaves a last line without its newline: skipped, as before."""
    recorded_sweep(tmp_path)
    path = tmp_path / CELL / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 9, "reward/me')
    assert main(["sweep", "--output-dir", str(tmp_path), "--report-only"]) == 0, capsys.readouterr().err
