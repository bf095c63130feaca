"""The study's report machinery on synthetic run directories: the Holm adjustment, the paired
difference-in-differences, outcome-based cells, the diagnostics against the lag within a
rollout, and the refusal to pair runs of different code. No training runs here (seconds)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from scipy import stats

from softtrust._provenance import provenance
from softtrust.cli import main
from softtrust.study import Sweep, split_methods, write_report
from softtrust.study.analysis import analyse
from softtrust.study.markdown import markdown_table
from softtrust.study.runs import load_run, load_runs, step_lag
from softtrust.study.stats import holm, paired_t_test, sign_test

CODE = {"git_commit": "a" * 40, "git_dirty": False, "versions": {"softtrust": "0.1.0", "torch": "2.13.0"}}

# Final accuracies per seed (0, 1, 2). clip drops 9-11 points from N = 4 to 64, vespo 1-3:
# the difference-in-differences is 0.07, 0.08, 0.09 (hand-computed below).
FINALS = {
    ("clip", 4): [0.50, 0.30, 0.70],
    ("clip", 64): [0.40, 0.21, 0.59],
    ("vespo", 4): [0.55, 0.28, 0.75],
    ("vespo", 64): [0.52, 0.27, 0.73],
}
STEPS = 8


def write_cell(
    directory: Path, final: float, staleness: int, code: dict | None = CODE, dip: bool = False
) -> None:
    """A finished run as the trainer leaves it: metrics (with lag and loss diagnostics), events, summary.

    Diagnostics depend only on the lag ℓ = (step − 1) mod N: φ = 1 − 0.1 ℓ, clip/low = 0.01 ℓ,
    clip/high = 0.02, kl_behaviour = 0.001 ℓ. ``dip``: an evaluation 0.2 below the warm start (a collapse).
    """
    directory.mkdir(parents=True)
    lines = []
    for step in range(1, STEPS + 1):
        lag = (step - 1) % staleness
        lines.append(
            {
                "step": step,
                "reward/mean": 0.5,
                "lag": lag,
                "loss/phi/mean": 1 - 0.1 * lag,
                "loss/clip/low": 0.01 * lag,
                "loss/clip/high": 0.02,
                "kl_behaviour": 0.001 * lag,
                "loss/ess": float("nan") if step == 1 else 0.9,  # a NaN is skipped, not averaged
            }
        )
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    evaluations = [(0, 0.3), (4, 0.1 if dip else 0.35), (STEPS, final)]
    (directory / "events.jsonl").write_text(
        "".join(json.dumps({"step": s, "eval/accuracy": a}) + "\n" for s, a in evaluations)
    )
    summary = {"steps": STEPS, "accuracy_before": 0.3, "accuracy_after": final}
    if code is not None:
        summary["provenance"] = code
    (directory / "summary.json").write_text(json.dumps(summary))


def make_sweep(root: Path, finals=FINALS, codes=None, dips=()) -> Sweep:
    sweep = Sweep(
        methods=split_methods("clip,vespo"),
        staleness=[4, 64],
        seeds=[0, 1, 2],
        output_dir=root,
        overrides={"max_steps": STEPS},
    )
    codes = codes or {}
    for (method, n), values in finals.items():
        for seed, value in enumerate(values):
            directory = root / "runs" / method / f"N{n}" / f"seed{seed}"
            write_cell(directory, value, n, codes.get((method, n, seed), CODE), dip=(method, n, seed) in dips)
    return sweep


# ---------------------------------------------------------------------- statistics
def test_holm_matches_a_hand_computed_example():
    # sorted: 0.005, 0.01, 0.03, 0.04 -> 4·0.005 = 0.02, 3·0.01 = 0.03, 2·0.03 = 0.06, max(0.06, 1·0.04) = 0.06
    assert holm([0.01, None, 0.04, 0.03, 0.005]) == pytest.approx([0.03, None, 0.06, 0.06, 0.02])
    assert holm([0.4, 0.5]) == pytest.approx([0.8, 0.8])  # capped at 1 only when needed
    assert holm([0.6, 0.7]) == [1.0, 1.0]
    assert holm([]) == []
    with pytest.raises(ValueError, match=r"p_values: expected values in \[0, 1\], got 1.5"):
        holm([0.1, 1.5])


def test_paired_t_test_matches_the_closed_form_with_two_degrees_of_freedom():
    # with 2 d.f. the t distribution has F(t) = 1/2 + t / (2 √(2 + t²)): two-sided p = 1 − t / √(2 + t²)
    result = paired_t_test([0.07, 0.08, 0.09])
    t = 0.08 / (0.01 / math.sqrt(3))
    assert result["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    assert result["p"] == pytest.approx(stats.ttest_1samp([0.07, 0.08, 0.09], 0).pvalue, rel=1e-9)
    assert paired_t_test([0.1])["p"] is None
    assert paired_t_test([0.0, 0.0])["p"] == 1.0


def test_sign_test_counts_seeds_and_uses_the_exact_binomial():
    assert sign_test([0.1, 0.2, 0.3, 0.4, 0.5])["p"] == pytest.approx(2 / 32)  # 5 of 5: the floor
    result = sign_test([0.1, -0.1, 0.2, 0.3, 0.4])  # 4 of 5: 2·(1 + 5)/32
    assert result["p"] == pytest.approx(12 / 32)
    assert (result["positive"], result["negative"]) == (4, 1)
    assert sign_test([0.0, 0.0])["p"] is None  # ties only: no test


# ---------------------------------------------------------------------- the report
def test_difference_in_differences_matches_a_hand_computation(tmp_path):
    report = analyse(make_sweep(tmp_path), load_runs(make_sweep(tmp_path / "again")))
    (did,) = [entry for entry in report["did"] if entry["measure"] == "final_accuracy"]
    # vespo's drops -0.03, -0.01, -0.02 minus clip's -0.10, -0.09, -0.11
    assert did["values"] == pytest.approx([0.07, 0.08, 0.09])
    assert did["mean"] == pytest.approx(0.08)
    assert did["ci95"] == pytest.approx(4.3026527 * 0.01 / math.sqrt(3))
    assert did["test"] == "t" and did["comparison"] == "(vespo − clip) at N = 64 − at N = 4"
    # the family: 4 comparisons x 2 measures + 1 difference-in-differences x 2 measures
    assert report["holm"]["size"] == 10
    tests = report["paired"] + report["did"]
    expected = holm([entry["p"] for entry in tests])
    assert [entry["p_holm"] for entry in tests] == pytest.approx(expected)
    assert all(entry["holds"] == (entry["p_holm"] <= 0.05) for entry in tests)


def test_a_named_reference_is_the_method_every_other_is_tested_against(tmp_path):
    """``Sweep.reference`` (``--reference``, a preset's ``reference``) replaces the default
    (vespo when in the grid): every comparison is reference − other, so the values flip."""
    sweep = make_sweep(tmp_path)
    default = analyse(sweep, load_runs(sweep))
    sweep.reference = "clip"
    named = analyse(sweep, load_runs(sweep))
    assert (default["reference"], named["reference"]) == ("vespo", "clip")
    (did,) = [entry for entry in named["did"] if entry["measure"] == "final_accuracy"]
    assert did["comparison"] == "(clip − vespo) at N = 64 − at N = 4"
    assert did["values"] == pytest.approx([-0.07, -0.08, -0.09])
    entries = {(e["comparison"], e["measure"]): e for e in named["paired"]}
    assert entries[("clip − vespo at N = 4", "final_accuracy")]["values"] == pytest.approx(
        [-0.05, 0.02, -0.05]
    )
    sweep.reference = "sapo"
    with pytest.raises(ValueError, match=r"reference: 'sapo' is not a method of the sweep"):
        analyse(sweep, load_runs(sweep))  # the --report-only path, which does not validate the grid
    with pytest.raises(
        ValueError,
        match=r"reference: 'sapo' is not a method of the sweep; expected one of \['clip', 'vespo'\]",
    ):
        sweep.validate()


def test_summary_md_carries_the_holm_table_the_did_and_the_figures(tmp_path):
    sweep = make_sweep(tmp_path)
    write_report(sweep)
    text = (tmp_path / "summary.md").read_text()
    assert "## Tests (paired by seed, Holm-adjusted)" in text
    assert "(10 tests)" in text
    assert (
        "| (vespo − clip) at N = 64 − at N = 4 | final accuracy | **8.0 ± 2.5** | 3 / 0 | paired t |" in text
    )
    assert f"Code of every run: commit {'a' * 40}; softtrust 0.1.0, torch 2.13.0." in text
    for name in ("paired_differences.png", "lag.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["did"][0]["values"] == pytest.approx([0.07, 0.08, 0.09])


def test_cells_with_a_collapse_are_reported_by_outcome_and_compared_by_the_sign_test(tmp_path):
    sweep = make_sweep(tmp_path, dips={("vespo", 64, 1)})
    report = write_report(sweep)
    record = next(r for r in report["records"] if (r["method"], r["N"]) == ("vespo", 64))
    assert record["outcome_based"] and record["outcomes"]["collapsed"] == 1
    assert record["outcomes"]["final_not_collapsed"]["values"] == pytest.approx([0.52, 0.73])
    entries = {(e["comparison"], e["measure"]): e for e in report["paired"] + report["did"]}
    assert entries[("vespo − clip at N = 64", "final_accuracy")]["test"] == "sign"
    assert entries[("vespo − clip at N = 64", "final_accuracy")]["p"] == pytest.approx(2 / 8)  # 3 of 3
    assert entries[("(vespo − clip) at N = 64 − at N = 4", "final_accuracy")]["test"] == "sign"
    assert entries[("vespo − clip at N = 4", "final_accuracy")]["test"] == "t"  # no collapse there
    text = (tmp_path / "summary.md").read_text()
    assert "| vespo | 64 | 1 | 2 | 0 | 0: 52.0, 1: 27.0 ×, 2: 73.0 | 62.5 ± 133.4 |" in text
    # the sign test's floor is said for the seeds at hand: 2 / 2³ with 3 seeds
    assert "with 3 seeds its smallest p is 0.25, so such a comparison cannot hold" in text
    # the lag table says how many steps (over seeds) stand behind each mean: 8 steps, lags 0..7
    assert "| all | steps at this lag | 3 | 3 | 3 | 3 | 3 |" in text
    # the axis and the seeds are the report's own: K for async; with 6 seeds the sign test can hold
    from softtrust.study.markdown import _tests_section

    other = "\n".join(_tests_section({**report, "axis": "K", "seeds": list(range(6))}))
    assert "from the smallest to the largest K minus" in other
    assert "with 6 seeds its smallest p is 0.0312)." in other


def stop_cell(directory: Path) -> None:
    """A run the trainer stopped on non-finite updates after step 5 (exit code 3): its metrics up
    to there, its evaluations at steps 0 and 4, no summary."""
    (directory / "summary.json").unlink()
    metrics = (directory / "metrics.jsonl").read_text().splitlines()
    (directory / "metrics.jsonl").write_text("\n".join(metrics[:5]) + "\n")
    events = (directory / "events.jsonl").read_text().splitlines()
    stop = {"step": 5, "stopped": "stopped at step 5: 3 non-finite losses", "provenance": CODE}  # log_stop
    (directory / "events.jsonl").write_text("\n".join([*events[:2], json.dumps(stop)]) + "\n")
    (directory / "sweep-cell.json").write_text(json.dumps({"returncode": 3}))


def test_a_run_stopped_on_nonfinite_updates_counts_as_a_failure_in_the_tests(tmp_path):
    """Issue 36: a stopped run was dropped from the paired tests (favouring the method that
    collapsed), and a cell whose every run stopped took its tests out of the Holm family. Now it
    counts as registered (docs/preregistration.md): final 0, accuracy 0 at every evaluation after
    the stop, so area = (trapezoids to step 4, then to (8, 0)) / 8."""
    sweep = make_sweep(tmp_path)
    for seed in range(3):
        stop_cell(tmp_path / "runs" / "vespo" / "N64" / f"seed{seed}")
    report = write_report(sweep)
    (record,) = [r for r in report["records"] if (r["method"], r["N"]) == ("vespo", 64)]
    area = (4 * (0.3 + 0.35) / 2 + 4 * 0.35 / 2) / STEPS  # evaluations (0, 0.3), (4, 0.35), then (8, 0)
    assert [run["status"] for run in record["runs"]] == ["stopped"] * 3
    assert [run["final_accuracy"] for run in record["runs"]] == [0.0, 0.0, 0.0]
    assert [run["auc_accuracy"] for run in record["runs"]] == pytest.approx([area] * 3)
    assert record["collapsed_runs"] == 3 and record["outcome_based"]
    entries = {(e["comparison"], e["measure"]): e for e in report["paired"] + report["did"]}
    final = entries[("vespo − clip at N = 64", "final_accuracy")]
    assert final["values"] == pytest.approx([-0.40, -0.21, -0.59])
    assert (final["test"], final["n"], final["p"]) == ("sign", 3, pytest.approx(0.25))
    clip_area = [(4 * 0.65 / 2 + 4 * (0.35 + f) / 2) / STEPS for f in FINALS[("clip", 64)]]
    assert entries[("vespo − clip at N = 64", "auc_accuracy")]["values"] == pytest.approx(
        [area - a for a in clip_area]
    )
    did = entries[("(vespo − clip) at N = 64 − at N = 4", "final_accuracy")]
    assert did["n"] == 3 and did["values"] == pytest.approx(
        [
            (0 - v4) - (c64 - c4)
            for v4, c64, c4 in zip(
                FINALS[("vespo", 4)], FINALS[("clip", 64)], FINALS[("clip", 4)], strict=True
            )
        ]
    )
    assert report["holm"]["size"] == 10  # every test stays in the family
    assert all(entry["p"] is not None for entry in entries.values())
    text = (tmp_path / "summary.md").read_text()
    assert "| vespo | 64 | 3 | 0 | 0 | 0: 0.0 × stopped, 1: 0.0 × stopped, 2: 0.0 × stopped | — |" in text
    assert "A run stopped on non-finite updates counts as a failure" in text


def test_diagnostics_against_the_lag_within_a_rollout(tmp_path):
    report = analyse(make_sweep(tmp_path), load_runs(make_sweep(tmp_path / "again")))
    profiles = {(p["method"], p["N"], p["metric"]): p for p in report["lag_profile"]}
    phi = profiles[("vespo", 4, "loss/phi/mean")]
    # 8 steps at N = 4: lags 0, 1, 2, 3 twice each, 3 seeds: 6 steps per lag
    assert phi["lags"] == [0, 1, 2, 3] and phi["n"] == [6, 6, 6, 6]
    assert phi["mean"] == pytest.approx([1.0, 0.9, 0.8, 0.7])
    assert profiles[("clip", 4, "clip")]["mean"] == pytest.approx([0.02, 0.03, 0.04, 0.05])  # low + high
    assert profiles[("clip", 64, "kl_behaviour")]["lags"] == list(range(8))  # 8 steps of one rollout
    ess = profiles[("clip", 4, "loss/ess")]
    assert ess["n"] == [3, 6, 6, 6] and ess["mean"] == pytest.approx([0.9] * 4)  # step 1's NaN skipped


def test_throughput_from_the_step_timing(tmp_path):
    """Steps per hour, the learner's waiting share and the sampling hidden behind the updates,
    by hand: seed s logs 2 + s seconds a step, of which 0.5 waiting, and 1.5 s of sampling
    (an overlapping worker); vespo's cells log no timing (runs before ``seconds/sample``)."""
    sweep = make_sweep(tmp_path)
    for seed in range(3):
        directory = tmp_path / "runs" / "clip" / "N4" / f"seed{seed}"
        lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
        for line in lines:
            line.update({"seconds": 2.0 + seed, "seconds/collect": 0.5, "seconds/sample": 1.5})
        (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    # a synchronous cell: the learner waits a little longer than the sampling took
    sync = tmp_path / "runs" / "clip" / "N64" / "seed0"
    lines = [json.loads(line) for line in (sync / "metrics.jsonl").read_text().splitlines()]
    for line in lines:
        line.update({"seconds": 3.0, "seconds/collect": 1.01, "seconds/sample": 1.0})
    (sync / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    report = analyse(sweep, load_runs(sweep))
    records = {(r["method"], r["N"]): r for r in report["records"]}
    clip = records[("clip", 4)]
    assert [run["steps_per_hour"] for run in clip["runs"]] == pytest.approx([1800, 1200, 900])
    assert clip["steps_per_hour"]["mean"] == pytest.approx(1300)
    assert clip["learner_waiting"]["values"] == pytest.approx([0.25, 0.5 / 3, 0.125])
    assert clip["sampling_hidden"]["values"] == pytest.approx([2 / 3] * 3)
    assert records[("clip", 64)]["sampling_hidden"]["values"] == [0.0]  # clamped: 1 - 1.01 / 1.0 < 0
    assert records[("vespo", 4)]["steps_per_hour"]["n"] == 0
    text = markdown_table(report)
    assert "## Throughput" in text
    assert "| clip | 4 | 1300 ± " in text and "| 67 % |" in text
    assert "| vespo | 4 |" not in text.split("## Throughput")[1]  # no timing, no row


def test_the_lag_is_derived_when_a_run_did_not_log_it(tmp_path):
    directory = tmp_path / "run"
    write_cell(directory, 0.5, 4)
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    assert [step_lag(line, 4) for line in lines] == [0, 1, 2, 3, 0, 1, 2, 3]
    for line in lines:
        del line["lag"]
    assert [step_lag(line, 4) for line in lines] == [0, 1, 2, 3, 0, 1, 2, 3]  # (step − 1) mod N
    assert step_lag({"step": 7, "rollout/minibatch": 2}, None) == 2
    assert step_lag({"step": 7}, None) is None  # async without a logged lag: unknown
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [d["lag"] for d in load_run(directory, staleness=4)["diagnostics"]] == [0, 1, 2, 3, 0, 1, 2, 3]


# ---------------------------------------------------------------------- code provenance
def test_the_report_refuses_runs_of_different_code_naming_the_cells(tmp_path, capsys):
    other = {**CODE, "git_commit": "b" * 40}
    make_sweep(tmp_path, codes={("vespo", 64, 2): other, ("clip", 4, 0): None})
    argv = ["sweep", "--methods", "clip,vespo", "--staleness", "4,64", "--seeds", "3"]
    argv += ["--output-dir", str(tmp_path), "--max-steps", str(STEPS), "--report-only"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "the runs were made by different code" in error
    assert f"commit {'b' * 40}; softtrust 0.1.0, torch 2.13.0: 1 run(s): vespo N=64 seed=2" in error
    assert "not recorded: 1 run(s): clip N=4 seed=0" in error
    assert "--allow-mixed-code" in error
    assert not (tmp_path / "summary.md").exists()
    assert main([*argv, "--allow-mixed-code"]) == 0
    text = (tmp_path / "summary.md").read_text()
    assert "**Mixed code (reported with --allow-mixed-code)" in text
    assert json.loads((tmp_path / "summary.json").read_text())["mixed_code"] is True


def test_a_run_still_going_is_not_a_code_of_its_own():
    """An interim report while cells run: a cell with no summary yet has no code to pair."""
    from softtrust.study.analysis import code_versions

    done = {"seed": 0, "status": "complete", "provenance": CODE}
    going = {"seed": 1, "status": "incomplete", "provenance": None}
    old = {"seed": 2, "status": "complete", "provenance": None}
    groups = code_versions([{"method": "clip", "staleness": 4, "runs": [done, going]}])
    assert list(groups.values()) == [["clip N=4 seed=0"]]
    groups = code_versions([{"method": "clip", "staleness": 4, "runs": [done, going, old]}])
    assert groups["not recorded"] == ["clip N=4 seed=2"]


def test_provenance_records_the_commit_the_dirty_flag_and_the_versions(tmp_path):
    def git(*arguments):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *arguments],
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )

    git("init", "-q")
    (tmp_path / "file.txt").write_text("one\n")
    git("add", "file.txt")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    clean = provenance(tmp_path)
    assert clean["git_commit"] == head.strip() and clean["git_dirty"] is False
    import torch

    assert clean["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert "softtrust" in clean["versions"]
    (tmp_path / "file.txt").write_text("two\n")
    assert provenance(tmp_path)["git_dirty"] is True
    (tmp_path / "untracked.txt").write_text("x\n")  # untracked files do not make it dirty
    (tmp_path / "file.txt").write_text("one\n")
    assert provenance(tmp_path)["git_dirty"] is False
    outside = provenance(tmp_path.parent / "no-such-dir")
    assert outside["git_commit"] is None and outside["git_dirty"] is None


# ---------------------------------------------------------------------- --report-only and unfinished runs
def report_only(root: Path) -> list[str]:
    argv = ["sweep", "--methods", "clip,vespo", "--staleness", "4,64", "--seeds", "3"]
    return [*argv, "--output-dir", str(root), "--max-steps", str(STEPS), "--report-only"]


@pytest.mark.parametrize("state", ["missing", "empty", "another grid"])
def test_report_only_without_runs_of_the_grid_is_an_error_naming_the_directory(state, tmp_path, capsys):
    """Old behaviour: ``--report-only`` on a missing or empty directory wrote an all-empty report
    (creating the directory) and exited 0."""
    root = tmp_path / "sweep"
    if state == "empty":
        root.mkdir()
    elif state == "another grid":
        write_cell(root / "runs" / "gspo" / "N4" / "seed0", 0.5, 4)
    assert main(report_only(root)) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"softtrust sweep: error: output_dir: {str(root)!r} ")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (root / "summary.json").exists() and not (root / "summary.md").exists()
    assert root.exists() == (state != "missing")


def test_an_interrupted_run_is_unfinished_not_a_run_that_did_not_collapse(tmp_path, capsys):
    """A cell killed mid-run (metrics for 3 of 8 steps, no summary.json, no exit code recorded)
    was counted in ``not_collapsed`` and shown as ``0/3`` collapsed runs, as if it had finished
    without collapsing."""
    make_sweep(tmp_path, finals={**FINALS, ("clip", 64): [0.40, 0.21]})
    interrupted = tmp_path / "runs" / "clip" / "N64" / "seed2"
    write_cell(interrupted, 0.5, 64)
    (interrupted / "summary.json").unlink()
    metrics = (interrupted / "metrics.jsonl").read_text().splitlines()
    (interrupted / "metrics.jsonl").write_text("\n".join(metrics[:3]) + "\n")
    (interrupted / "events.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.3}) + "\n")
    assert main(report_only(tmp_path)) == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "summary.json").read_text())
    (record,) = [r for r in report["records"] if (r["method"], r["N"]) == ("clip", 64)]
    assert record["outcomes"]["unfinished"] == 1 and record["outcomes"]["not_collapsed"] == 2
    assert [run["outcome"] for run in record["runs"]] == ["not collapsed", "not collapsed", "unfinished"]
    text = (tmp_path / "summary.md").read_text()
    assert "**Unfinished runs (1)**" in text and "clip N=64 seed=2 (step 3, incomplete)" in text
    assert "| 64 | 0/2, 1 unfinished | 0/3 |" in text  # collapsed / runs with an outcome
