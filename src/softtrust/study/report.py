"""Writing a study's report: read the runs, analyse them, render the tables and figures."""

from __future__ import annotations

from softtrust._runfiles import atomic_write_json, atomic_write_text

from .analysis import CollapseCriterion, analyse, at_lr
from .grid import Sweep
from .markdown import markdown_table
from .plots import plot_curves, plot_final_vs_staleness, plot_lr_stability
from .runs import load_runs


def write_report(
    sweep: Sweep, wall_seconds: float | None = None, criterion: CollapseCriterion | None = None
) -> dict:
    """``summary.json``, ``summary.md``, ``curves.png``, ``final_vs_staleness.png`` (and
    ``lr_stability.png`` with ``--lrs``) in the sweep directory; returns the report."""
    report = analyse(sweep, load_runs(sweep), criterion, wall_seconds)
    atomic_write_json(sweep.output_dir / "summary.json", report)
    atomic_write_text(sweep.output_dir / "summary.md", markdown_table(report))
    first = at_lr(report, sweep.lrs[0]) if sweep.lrs else report  # the figures: the smallest lr
    plot_curves(first, sweep.output_dir / "curves.png")
    plot_final_vs_staleness(first, sweep.output_dir / "final_vs_staleness.png")
    if sweep.lrs:
        plot_lr_stability(report, sweep.output_dir / "lr_stability.png")
    return report
