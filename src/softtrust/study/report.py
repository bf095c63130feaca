"""Writing a study's report: read the runs, analyse them, render the tables and figures."""

from __future__ import annotations

import sys

from softtrust._optional import MissingDependency, require
from softtrust._runfiles import atomic_write_json, atomic_write_text

from .analysis import CollapseCriterion, analyse, at_lr
from .grid import Sweep
from .markdown import markdown_table
from .plots import plot_curves, plot_final_vs_staleness, plot_lag, plot_lr_stability, plot_paired
from .record import check_report_settings
from .runs import load_runs


def require_report_dependencies() -> None:
    """The report's statistics need scipy: refused (``ValueError`` naming ``sweep``) before any
    cell runs, not after hours of them. The figures only need matplotlib when it is there."""
    require("scipy", "the report (its intervals and tests)", name="sweep")


def rewrite_report(sweep: Sweep) -> dict:
    """``--report-only``: the report of the runs already in the sweep directory. A directory that
    does not exist or holds no run of this grid is a ``ValueError`` naming it, rather than an
    all-empty report (a mistyped ``--output-dir``, or a grid other than the one that ran); so are
    settings other than those the runs were made with (``record.check_report_settings``) and a
    damaged run file (``runs.load_run`` names the file and the line). Nothing is written then."""
    directory = sweep.output_dir
    if not directory.is_dir():
        state = "is not a directory" if directory.exists() else "does not exist"
        raise ValueError(
            f"output_dir: {str(directory)!r} {state}; --report-only reads the directory of a sweep "
            "that has run (give its --output-dir)"
        )
    check_report_settings(sweep)
    runs = load_runs(sweep)
    if not runs:
        grid = f"{', '.join(sweep.labels)} x {sweep.axis} = {sweep.staleness} x seeds {sweep.seeds}"
        raise ValueError(
            f"output_dir: {str(directory)!r} holds no run of the grid {grid}; give the --preset, --methods, "
            "--staleness, --seeds (and --lrs) the sweep ran with"
        )
    return write_report(sweep, runs=runs)


def write_report(
    sweep: Sweep,
    wall_seconds: float | None = None,
    criterion: CollapseCriterion | None = None,
    runs: dict | None = None,
) -> dict:
    """``summary.json``, ``summary.md``, ``curves.png``, ``final_vs_staleness.png``,
    ``paired_differences.png``, ``lag.png`` (and ``lr_stability.png`` with ``--lrs``) in the
    sweep directory; returns the report. Refuses (``ValueError``) runs of different code
    unless ``sweep.allow_mixed_code``. Without matplotlib the figures are skipped with a
    one-line notice on stderr (the tables are the report). ``runs``: the cells' records
    (``load_runs``), when already read."""
    require_report_dependencies()
    runs = load_runs(sweep) if runs is None else runs
    report = analyse(sweep, runs, criterion, wall_seconds, sweep.allow_mixed_code)
    atomic_write_json(sweep.output_dir / "summary.json", report)
    atomic_write_text(sweep.output_dir / "summary.md", markdown_table(report))
    try:
        write_figures(sweep, report)
    except MissingDependency as missing:
        print(f"softtrust sweep: note: figures not written: {missing}", file=sys.stderr, flush=True)
    return report


def write_figures(sweep: Sweep, report: dict) -> None:
    """The report's figures (``MissingDependency`` without matplotlib)."""
    first = at_lr(report, sweep.lrs[0]) if sweep.lrs else report  # the figures: the smallest lr
    plot_curves(first, sweep.output_dir / "curves.png")
    plot_final_vs_staleness(first, sweep.output_dir / "final_vs_staleness.png")
    if report.get("paired"):
        plot_paired(report, sweep.output_dir / "paired_differences.png")
    plot_lag(first, sweep.output_dir / "lag.png")
    if sweep.lrs:
        plot_lr_stability(report, sweep.output_dir / "lr_stability.png")
