"""The study's analysis: a pure function from run records to one report (no file is read or written).

``analyse(sweep, runs, criterion)`` takes the grid and the raw record of each cell's run
(``runs.load_run``) and returns the report: per method x N (x lr) the aggregated measures,
the collapses, the largest stable learning rate or the paired differences. Everything that
renders it (``markdown.py``, ``plots.py``) reads only that report.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from .grid import Cell, Sweep
from .runs import EXIT_STOPPED

# Two-sided 95 % Student t quantiles t_{0.975, df}; df > 30 uses the normal 1.96.
T_975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}


@dataclass(frozen=True)
class CollapseCriterion:
    """When a run counts as collapsed (checked in this order; the earliest step is reported).

    1. ``stopped`` / ``nonfinite``: the run stopped itself after too many non-finite losses
       or gradients in a row, or any update was skipped as non-finite. (A crash, e.g. an
       exception in a reward function, is reported as a failed cell, not a collapse.)
    2. ``accuracy``: a held-out greedy accuracy (any evaluation after step 0) fell more
       than ``accuracy_margin`` (absolute) below the warm start's accuracy. With 256
       held-out problems the standard error of one evaluation is at most 0.031 (0.022
       with 512), so the default 0.10 is over three standard errors: evaluation noise
       alone rarely triggers it.
    3. ``reward``: the training reward, averaged over a trailing window of
       ``reward_window`` steps, fell more than ``reward_margin`` (absolute; rewards are in
       [0, 1]) below its average over the first ``reward_window`` steps.

    Reported per run as ``collapsed`` (bool), ``collapse_step`` and ``collapse_reason``.
    """

    accuracy_margin: float = 0.10
    reward_margin: float = 0.15
    reward_window: int = 8

    def check(
        self,
        accuracy_before: float,
        accuracies: list[tuple[int, float]],
        rewards: list[tuple[int, float]],
        stopped: bool = False,
        nonfinite_steps: list[int] = (),
    ) -> tuple[bool, int | None, str | None]:
        """``(collapsed, step, reason)`` for one run's curves (``[(step, value), ...]``)."""
        if stopped or nonfinite_steps:
            step = min(nonfinite_steps) if nonfinite_steps else (rewards[-1][0] if rewards else 0)
            return True, step, "stopped" if stopped else "nonfinite"
        events = []
        for step, accuracy in accuracies:
            if step > 0 and not (accuracy >= accuracy_before - self.accuracy_margin):
                events.append((step, "accuracy"))
                break
        values = [value for _, value in rewards]
        window = self.reward_window
        if len(values) >= 2 * window:
            baseline = sum(values[:window]) / window
            for index in range(window, len(values) - window + 1):
                trailing = sum(values[index : index + window]) / window
                if not (trailing >= baseline - self.reward_margin):
                    events.append((rewards[index + window - 1][0], "reward"))
                    break
        if not events:
            return False, None, None
        step, reason = min(events)
        return True, step, reason

    def describe(self) -> str:
        return (
            "a run collapsed if it stopped or skipped a non-finite update; or if a held-out "
            f"accuracy fell more than {self.accuracy_margin:.2f} below the warm start's; or if the "
            f"training reward averaged over {self.reward_window} steps fell more than "
            f"{self.reward_margin:.2f} below its average over the first {self.reward_window} steps"
        )


# ---------------------------------------------------------------------- statistics
def mean_std_ci(values: list[float]) -> dict:
    """Mean, sample std and the 95 % Student t half-width over seeds (None with one value)."""
    values = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(values)
    if n == 0:
        return {"mean": None, "std": None, "ci95": None, "n": 0, "values": []}
    mean = sum(values) / n
    if n == 1:
        return {"mean": mean, "std": None, "ci95": None, "n": 1, "values": values}
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    df = n - 1
    t = T_975.get(df) or (T_975[max(k for k in T_975 if k <= df)] if df <= 30 else 1.96)
    return {"mean": mean, "std": std, "ci95": t * std / math.sqrt(n), "n": n, "values": values}


def area_under_curve(points: list[tuple[int, float]], max_steps: int) -> float | None:
    """Trapezoid area of accuracy against step (evaluations from step 0 to ``max_steps``),
    divided by the steps spanned: the mean accuracy along the run, in [0, 1]."""
    points = sorted(points)
    if len(points) < 2 or max_steps <= 0:
        return None
    area = sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in itertools.pairwise(points))
    return area / (points[-1][0] - points[0][0]) if points[-1][0] != points[0][0] else None


def run_outcome(run: dict, max_steps: int, criterion: CollapseCriterion) -> dict:
    """One run's curves and outcome from its raw record (``runs.load_run``).

    ``run``: ``{"run_dir", "summary" (or None), "returncode" (of the cell's process, or None),
    "rewards": [(step, reward)], "accuracies": [(step, accuracy)], "nonfinite_steps": [step]}``.
    """
    summary, returncode = run["summary"], run["returncode"]
    rewards, accuracies = list(run["rewards"]), sorted(run["accuracies"])
    evaluations = dict(accuracies)
    accuracy_before = summary["accuracy_before"] if summary else evaluations.get(0, float("nan"))
    complete = summary is not None and summary.get("steps") == max_steps
    stopped = not complete and returncode == EXIT_STOPPED
    crashed = not complete and returncode not in (None, 0, EXIT_STOPPED)
    collapsed, collapse_step, reason = criterion.check(
        accuracy_before, accuracies, rewards, stopped=stopped, nonfinite_steps=run["nonfinite_steps"]
    )
    # the best of a run still going (or crashed) is not comparable to a finished run's;
    # a stopped run (the trainer gave up on it) keeps its best, since it will not go on
    after = [(step, value) for step, value in accuracies if step > 0 and (complete or stopped)]
    best_step, best = max(after, key=lambda item: item[1]) if after else (None, None)
    final = summary["accuracy_after"] if complete else None
    window = max(1, len(rewards) // 10)
    return {
        "run_dir": run["run_dir"],
        "status": "complete"
        if complete
        else ("stopped" if stopped else "crashed" if crashed else "incomplete"),
        "steps": rewards[-1][0] if rewards else 0,
        "accuracy_before": accuracy_before,
        "final_accuracy": final,
        "best_accuracy": best,
        "best_step": best_step,
        "auc_accuracy": area_under_curve(accuracies, max_steps) if complete else None,
        "final_reward": sum(v for _, v in rewards[-window:]) / window if rewards else None,
        "collapsed": collapsed,
        "collapse_step": collapse_step,
        "collapse_reason": reason,
        "wall_seconds": summary.get("wall_seconds") if summary else None,
        "curves": {"reward": rewards, "accuracy": accuracies},
    }


def collect(sweep: Sweep, runs: dict[Cell, dict], criterion: CollapseCriterion) -> list[dict]:
    """One record per method x staleness (x learning rate with ``--lrs``), aggregating its seeds."""
    max_steps = sweep.max_steps
    records = []
    for staleness, lr, spec in itertools.product(sweep.staleness, sweep.lrs or [None], sweep.methods):
        outcomes = []
        for seed in sweep.seeds:
            run = runs.get(Cell(spec, staleness, seed, sweep.axis, lr))
            if run is not None:
                outcomes.append({"seed": seed, **run_outcome(run, max_steps, criterion)})
        collapse_steps = [run["collapse_step"] for run in outcomes if run["collapsed"]]
        records.append(
            {
                "method": spec.label,
                sweep.axis: staleness,
                "staleness": staleness,
                "lr": lr,
                "seeds": [run["seed"] for run in outcomes],
                "runs_complete": sum(run["status"] == "complete" for run in outcomes),
                "final_accuracy": mean_std_ci([run["final_accuracy"] for run in outcomes]),
                "best_accuracy": mean_std_ci([run["best_accuracy"] for run in outcomes]),
                "auc_accuracy": mean_std_ci([run["auc_accuracy"] for run in outcomes]),
                "final_reward": mean_std_ci([run["final_reward"] for run in outcomes]),
                "accuracy_before": mean_std_ci([run["accuracy_before"] for run in outcomes]),
                "collapsed_runs": len(collapse_steps),
                "first_collapse_step": min(collapse_steps) if collapse_steps else None,
                "runs": outcomes,
            }
        )
    return records


def largest_stable_lr(records: list[dict], seeds: int) -> float | None:
    """The largest learning rate of one method x N at which, and below which, every run is stable.

    ``records``: that method x N's records, one per learning rate. A learning rate is
    stable when all ``seeds`` runs completed and none collapsed (``CollapseCriterion``).
    Scanning upwards from the smallest, the answer is the last stable value before the
    first unstable one; None when the smallest is already unstable (or not run).
    """
    stable = None
    for record in sorted(records, key=lambda r: r["lr"]):
        if record["runs_complete"] < seeds or record["collapsed_runs"] > 0:
            break
        stable = record["lr"]
    return stable


def lr_stability(report: dict) -> list[dict]:
    """Per method x N: the largest stable learning rate and the final accuracy at each one."""
    axis, seeds = report["axis"], len(report["seeds"])
    rows = []
    for value in report["staleness"]:
        for method in report["methods"]:
            records = [r for r in report["records"] if r["method"] == method and r[axis] == value]
            rows.append(
                {
                    "method": method,
                    axis: value,
                    "largest_stable_lr": largest_stable_lr(records, seeds),
                    "final_accuracy_by_lr": {f"{r['lr']:g}": r["final_accuracy"]["mean"] for r in records},
                    "collapsed_by_lr": {f"{r['lr']:g}": r["collapsed_runs"] for r in records},
                }
            )
    return rows


PAIRED_MEASURES = (("final_accuracy", "final accuracy"), ("auc_accuracy", "area under the curve"))


def paired_differences(report: dict) -> list[dict]:
    """Differences between cells paired by seed, with a 95 % interval over seeds.

    Every cell of one seed shares its warm start and its held-out set, so the difference
    ``x[a, seed] - x[b, seed]`` removes the spread between seeds that widens the per-cell
    intervals. Two families of comparisons, for the final accuracy and the area under
    the accuracy curve:

    * per method, the largest N minus the smallest (does staleness hurt it?);
    * per N, the reference method minus every other one (``vespo`` when it is in the
      grid, else the last method listed).

    Each entry: ``{"comparison", "measure", "mean", "std", "ci95", "n", "values",
    "excludes_zero"}`` (values are fractions, like the accuracies; ``n``: the seeds that
    both cells completed). ``excludes_zero`` is the sweep's rule for claiming a difference.
    """
    axis, methods, values = report["axis"], report["methods"], report["staleness"]
    runs = {}
    for record in report["records"]:
        for run in record["runs"]:
            runs[(record["method"], record[axis], run["seed"])] = run
    reference = "vespo" if "vespo" in methods else methods[-1]
    pairs = []
    if len(values) > 1:
        low, high = min(values), max(values)
        pairs += [(f"{m}: {axis} = {high} − {axis} = {low}", (m, high), (m, low)) for m in methods]
    pairs += [
        (f"{reference} − {m} at {axis} = {v}", (reference, v), (m, v))
        for v in values
        for m in methods
        if m != reference
    ]
    entries = []
    for comparison, first, second in pairs:
        for key, _ in PAIRED_MEASURES:
            differences = []
            for seed in report["seeds"]:
                a, b = runs.get((*first, seed)), runs.get((*second, seed))
                if a and b and a[key] is not None and b[key] is not None:
                    differences.append(a[key] - b[key])
            stat = mean_std_ci(differences)
            excludes_zero = stat["ci95"] is not None and abs(stat["mean"]) > stat["ci95"]
            entries.append({"comparison": comparison, "measure": key, **stat, "excludes_zero": excludes_zero})
    return entries


def analyse(
    sweep: Sweep,
    runs: dict[Cell, dict],
    criterion: CollapseCriterion | None = None,
    wall_seconds: float | None = None,
) -> dict:
    """The report (``summary.json``) of ``sweep`` from the raw records of its cells' runs.

    Pure: ``runs`` maps each cell that has started to its ``runs.load_run`` record; cells
    without one count as not run. The report holds the grid, the collapse rule, one record
    per method x N (x lr; ``collect``) and either the largest stable learning rates
    (``--lrs``) or the paired differences between cells.
    """
    criterion = criterion or CollapseCriterion()
    records = collect(sweep, runs, criterion)
    run_seconds = [
        run["wall_seconds"] for record in records for run in record["runs"] if run["wall_seconds"] is not None
    ]
    report = {
        "methods": [spec.label for spec in sweep.methods],
        "staleness": sweep.staleness,
        "axis": sweep.axis,
        "seeds": sweep.seeds,
        "lrs": sweep.lrs,
        "overrides": sweep.overrides,
        "collapse_criterion": {**dataclasses.asdict(criterion), "rule": criterion.describe()},
        "wall_seconds": wall_seconds,
        "run_seconds_total": sum(run_seconds),
        "records": records,
    }
    if sweep.lrs:
        report["lr_stability"] = lr_stability(report)
    else:
        report["paired"] = paired_differences(report)
    return report


def at_lr(report: dict, lr: float | None) -> dict:
    """The report restricted to the records of one learning rate."""
    return {**report, "records": [r for r in report["records"] if r.get("lr") == lr]}
