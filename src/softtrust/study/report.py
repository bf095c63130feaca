"""Writing a study's report: read the runs, analyse them, render the tables and figures."""

from __future__ import annotations

from softtrust._runfiles import atomic_write_json, atomic_write_text

from .analysis import CollapseCriterion, analyse, at_lr
from .grid import Sweep
from .markdown import markdown_table
from .plots import plot_curves, plot_final_vs_staleness, plot_lag, plot_lr_stability, plot_paired
from .runs import load_runs


def write_report(
    sweep: Sweep, wall_seconds: float | None = None, criterion: CollapseCriterion | None = None
) -> dict:
    """``summary.json``, ``summary.md``, ``curves.png``, ``final_vs_staleness.png``,
    ``paired_differences.png``, ``lag.png`` (and ``lr_stability.png`` with ``--lrs``) in the
    sweep directory; returns the report. Refuses (``ValueError``) runs of different code
    unless ``sweep.allow_mixed_code``."""
    report = analyse(sweep, load_runs(sweep), criterion, wall_seconds, sweep.allow_mixed_code)
    atomic_write_json(sweep.output_dir / "summary.json", report)
    atomic_write_text(sweep.output_dir / "summary.md", markdown_table(report))
    first = at_lr(report, sweep.lrs[0]) if sweep.lrs else report  # the figures: the smallest lr
    plot_curves(first, sweep.output_dir / "curves.png")
    plot_final_vs_staleness(first, sweep.output_dir / "final_vs_staleness.png")
    if report.get("paired"):
        plot_paired(report, sweep.output_dir / "paired_differences.png")
    plot_lag(first, sweep.output_dir / "lag.png")
    if sweep.lrs:
        plot_lr_stability(report, sweep.output_dir / "lr_stability.png")
    return report
