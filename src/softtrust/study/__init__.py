"""The staleness study: ``softtrust sweep`` runs a grid of ``train`` runs and reports it.

One cell is one ``train(config)`` run (a method, a staleness N, a seed), executed in
its own process (``python -m softtrust.study.cell <cell>/sweep-cell.yaml``), ``--jobs``
at a time. The progress bar counts optimizer steps summed over every cell (a running cell's
from the lines of its ``metrics.jsonl``), with the cells finished in its postfix. Every cell runs the same number of optimizer steps (``--max-steps``), so N
changes only how stale the samples are, and every cell of a seed starts from the same
cached warm start (the trainer keys the cache by the recipe and the seed).

The sweep directory holds:

| path | content |
| --- | --- |
| ``runs/<method>/N<N>/seed<s>/`` | each cell's run directory (see ``docs/training.md``), plus ``train.log`` (its output, filled as it trains: a line every few steps) and ``sweep-cell.json`` (``.../N<N>/lr<lr>/seed<s>/`` with ``--lrs``) |
| ``sweep.json`` | the grid, the shared overrides and the reference method (``record``: ``--report-only`` reads it) |
| ``sweep-log.jsonl`` | one line per cell executed (start, end, return code) |
| ``summary.json`` | one record per method x N: accuracy at the end, at its best, its area under the curve, mean / std / 95 % CI over seeds, collapses; each run's outcome: collapsed, not collapsed (finished its steps) or unfinished (started, no result for the planned steps: interrupted, crashed or still running; named in ``summary.md``, counted as neither; a collapse already seen in it counts, its best so far is not a result) |
| ``summary.md`` | the table of the VESPO paper's Table 2 layout: rows N, columns methods; the outcome-based cells; the paired tests and differences-in-differences with the Holm adjustment; the diagnostics against the lag; the code of the runs |
| ``curves.png``, ``final_vs_staleness.png``, ``lag.png`` | the figures (with ``--lrs``: at the smallest learning rate; skipped with a one-line notice without matplotlib) |
| ``paired_differences.png`` | each paired comparison's per-seed differences with their mean and 95 % interval |
| ``lr_stability.png`` | with ``--lrs``: the largest stable learning rate against N, one line per method |

The learning-rate view (``--lrs 3e-4,1e-3,...``): a third grid axis. For every method and
N, the **largest stable learning rate** is the largest value of the grid at which, and at
every smaller value of which, every seed completed without collapsing (see
``largest_stable_lr``). It does not depend on one learning rate: a method that tolerates
staleness should keep its stable range as N grows.

Resumption: a cell is not run again when its run directory has a ``summary.json`` for
the requested number of steps, or when it stopped on its own (too many non-finite
updates, exit code 3: a deterministic outcome, reported as a collapse). A cell that was
interrupted resumes from its last checkpoint (any mode, the concurrent async worker
included), or starts over when it has none: the sweep owns its cells' directories and clears
such a cell's directory itself before the new run (which would refuse a directory holding a run). A cell
that was run with other settings (say another ``--lr``) stops the sweep with a message
naming them, rather than mixing old and new results in one table.

The collapse criterion (``CollapseCriterion``, applied per run) is documented there.

``--report-only`` rewrites the report from the runs already there, described by the sweep's own
record (``record``): the grid and shared settings it is not given come from ``sweep.json`` (a
``--preset``, when named, replaces them), and every cell's ``config.yaml`` must agree with the
settings the report is built with, ``max_steps`` included, or the report is refused naming the
settings, the runs' values and the cells. A sweep directory that does not exist, or holds no run
of the grid given, is an error naming it (exit code 2). So is a damaged run file (a
``summary.json`` that is not an object with ``steps``, ``accuracy_before`` and ``accuracy_after``,
a ``metrics.jsonl`` line without a numeric ``reward/mean``, a null ``eval/accuracy``, a line
that is not JSON): one line naming the file and the line, and the report already there is left
as it was. It is refused rather than skipped with a warning, so that a report never has fewer
runs than its directory without saying so; a torn last line (a write cut by a kill) is skipped.

Every run records the code that made it (``summary.json["provenance"]``: git commit, dirty
flag, package versions); the report refuses to pair runs of different code, naming the
cells of each, unless ``--allow-mixed-code``.

The package, one job per module:

| module | job |
| --- | --- |
| ``presets`` | the predefined grids and their shared settings |
| ``grid`` | method specs, axes, cells and each cell's ``TrainConfig`` |
| ``runner`` | running the cells (processes, resumption, the sweep log) |
| ``cell`` | one cell's process (``python -m softtrust.study.cell``) |
| ``runs`` | reading run directories into raw run records (a damaged file: an error naming it) |
| ``record`` | the sweep's own record (``sweep.json``, the cells' ``config.yaml``) and the settings check |
| ``analysis`` | a pure function from run records to the report (collapse, outcomes, lr stability, paired tests, differences-in-differences, the lag view, the code check) |
| ``stats`` | intervals, the paired t and exact sign tests, the Holm adjustment (``scipy.stats``: checked before any cell runs) |
| ``markdown``, ``plots`` | render the report (nothing else) |
| ``report`` | read, analyse, render: the files of the sweep directory |
| ``cli`` | ``softtrust sweep``'s flags and command |
"""

from softtrust.study.analysis import CollapseCriterion, analyse, run_outcome
from softtrust.study.grid import Cell, MethodSpec, Sweep, split_methods
from softtrust.study.presets import PRESETS
from softtrust.study.report import write_report
from softtrust.study.runner import run_sweep
from softtrust.study.runs import EXIT_BAD_CONFIG, EXIT_STOPPED, load_run, load_runs
from softtrust.study.stats import holm, mean_std_ci

__all__ = [
    "EXIT_BAD_CONFIG",
    "EXIT_STOPPED",
    "PRESETS",
    "Cell",
    "CollapseCriterion",
    "MethodSpec",
    "Sweep",
    "analyse",
    "holm",
    "load_run",
    "load_runs",
    "mean_std_ci",
    "run_outcome",
    "run_sweep",
    "split_methods",
    "write_report",
]
