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
from .runs import DIAGNOSTICS, EXIT_STOPPED
from .stats import ALPHA, holm, mean_std_ci, paired_t_test, sign_test


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


def _trapezoids(points: list[tuple[int, float]]) -> float:
    """Σ (s₁ − s₀)(a₀ + a₁)/2 over consecutive ``(step, accuracy)`` points (sorted)."""
    return sum((s1 - s0) * (a0 + a1) / 2 for (s0, a0), (s1, a1) in itertools.pairwise(points))


def area_under_curve(points: list[tuple[int, float]], max_steps: int) -> float | None:
    """Trapezoid area of accuracy against step (evaluations from step 0 to ``max_steps``),
    divided by the steps spanned: the mean accuracy along the run, in [0, 1]."""
    points = sorted(points)
    if len(points) < 2 or max_steps <= 0:
        return None
    return _trapezoids(points) / (points[-1][0] - points[0][0]) if points[-1][0] != points[0][0] else None


# What a run stopped on non-finite updates (exit code 3: the trainer gave up on it) counts as in
# the tables and the tests, registered before the confirmation runs (docs/preregistration.md): a
# failure, final accuracy 0 and accuracy 0 at every evaluation after the stop. Dropping it instead
# favoured the method that collapsed, and a cell whose every run stopped left the Holm family.
STOPPED_ACCURACY = 0.0


def stopped_area(points: list[tuple[int, float]], max_steps: int) -> float:
    """The area (mean accuracy along the run, ``area_under_curve``) of a run that stopped: its
    evaluations up to its last one, then ``STOPPED_ACCURACY`` at every later evaluation of its
    schedule (the spacing of its first two evaluations; one more point at ``max_steps`` if the
    schedule misses it), trapezoids over all of them divided by the steps spanned; 0 without an
    evaluation."""
    points = sorted(points)
    if not points or max_steps <= points[0][0]:
        return STOPPED_ACCURACY
    every = points[1][0] - points[0][0] if len(points) > 1 else max_steps - points[0][0]
    padded = points + [(s, STOPPED_ACCURACY) for s in range(points[-1][0] + every, max_steps + 1, every)]
    if padded[-1][0] < max_steps:
        padded.append((max_steps, STOPPED_ACCURACY))
    return _trapezoids(padded) / (padded[-1][0] - padded[0][0])


def run_outcome(run: dict, max_steps: int, criterion: CollapseCriterion) -> dict:
    """One run's curves and outcome from its raw record (``runs.load_run``). A run that stopped
    on non-finite updates has the final accuracy ``STOPPED_ACCURACY`` and the area ``stopped_area``
    (a failure, counted in the tests); one unfinished for another reason has neither.

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
    final = summary["accuracy_after"] if complete else (STOPPED_ACCURACY if stopped else None)
    area = area_under_curve(accuracies, max_steps) if complete else None
    if stopped:
        area = stopped_area(accuracies, max_steps)
    window = max(1, len(rewards) // 10)
    return {
        "run_dir": run["run_dir"],
        "status": "complete"
        if complete
        else ("stopped" if stopped else "crashed" if crashed else "incomplete"),
        "outcome": run_result(collapsed, complete),
        "steps": rewards[-1][0] if rewards else 0,
        "accuracy_before": accuracy_before,
        "final_accuracy": final,
        "best_accuracy": best,
        "best_step": best_step,
        "auc_accuracy": area,
        "final_reward": sum(v for _, v in rewards[-window:]) / window if rewards else None,
        "collapsed": collapsed,
        "collapse_step": collapse_step,
        "collapse_reason": reason,
        "wall_seconds": summary.get("wall_seconds") if summary else None,
        **throughput(run.get("timing")),
        "provenance": run.get("provenance"),
        "curves": {"reward": rewards, "accuracy": accuracies},
    }


OUTCOMES = ("collapsed", "not collapsed", "unfinished")


def run_result(collapsed: bool, complete: bool) -> str:
    """One run's outcome (``OUTCOMES``): ``collapsed`` as soon as the criterion fires (also in a
    run still going: the collapse happened); ``not collapsed`` only for a run that completed its
    steps; else ``unfinished`` (interrupted, crashed or still running: no summary for the planned
    steps), which says nothing about collapse either way."""
    if collapsed:
        return "collapsed"
    return "not collapsed" if complete else "unfinished"


THROUGHPUT = ("steps_per_hour", "sampling_hidden", "learner_waiting")


def throughput(timing: dict | None) -> dict:
    """A run's throughput from its step timing (``runs.step_timing``); None where not logged.

    ``steps_per_hour = 3600 · steps / Σ seconds`` (the training steps alone: no warm start,
    evaluations or checkpoints); ``learner_waiting = Σ wait / Σ seconds``, the share of that
    time the learner spent waiting for its mini-batch; ``sampling_hidden = 1 − Σ wait / Σ sample``,
    the share of the producer's sampling time the learner did not wait for (it ran while the
    learner updated or evaluated; synchronous: 0, the learner waits for all of it; a concurrent
    worker that is never waited for: 1). Clamped to [0, 1]: the wait also holds the
    advantages' few milliseconds.
    """
    timing = timing or {}
    seconds, wait, sample = timing.get("seconds"), timing.get("wait"), timing.get("sample")
    timed = seconds is not None and seconds > 0
    return {
        "steps_per_hour": 3600 * timing["steps"] / seconds if timed else None,
        "learner_waiting": wait / seconds if timed and wait is not None else None,
        "sampling_hidden": min(max(1 - wait / sample, 0.0), 1.0) if sample and wait is not None else None,
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
                **{key: mean_std_ci([run[key] for run in outcomes]) for key in THROUGHPUT},
                "collapsed_runs": len(collapse_steps),
                "first_collapse_step": min(collapse_steps) if collapse_steps else None,
                # bimodal: some runs collapsed; reported by outcome, compared by the sign test
                "outcome_based": bool(collapse_steps),
                "outcomes": {
                    "collapsed": len(collapse_steps),
                    "not_collapsed": sum(run["outcome"] == "not collapsed" for run in outcomes),
                    "unfinished": sum(run["outcome"] == "unfinished" for run in outcomes),
                    "final_not_collapsed": mean_std_ci(
                        [run["final_accuracy"] for run in outcomes if run["outcome"] == "not collapsed"]
                    ),
                },
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

HOLM_FAMILY = (
    "every test the report makes: each paired comparison and each difference-in-differences, "
    "for both measures (final accuracy and area under the curve)"
)


def _by_seed(report: dict) -> tuple[dict, dict]:
    """``{(method, N, seed): run}`` and ``{(method, N): outcome_based}`` of the report's records."""
    axis, runs, bimodal = report["axis"], {}, {}
    for record in report["records"]:
        bimodal[(record["method"], record[axis])] = bool(record.get("outcome_based"))
        for run in record["runs"]:
            runs[(record["method"], record[axis], run["seed"])] = run
    return runs, bimodal


def _test(differences: list[float], outcome_based: bool) -> dict:
    """The paired t-test, or the exact sign test when a cell involved is outcome-based."""
    stat = sign_test(differences) if outcome_based else paired_t_test(differences)
    stat["excludes_zero"] = stat["ci95"] is not None and abs(stat["mean"]) > stat["ci95"]
    return stat


def paired_differences(report: dict) -> list[dict]:
    """Differences between cells paired by seed, each tested against 0.

    Every cell of one seed shares its warm start and its held-out set, so the difference
    ``d_s = x[a, s] − x[b, s]`` removes the spread between seeds that widens the per-cell
    intervals. Two kinds of comparisons, for the final accuracy and the area under the
    accuracy curve:

    * per method, the largest N minus the smallest (does staleness hurt it?);
    * per N, the reference method minus every other one (``report["reference"]``:
      ``Sweep.reference_method``).

    The test (``stats``): the paired t-test (Student t, n − 1 d.f.), or the exact sign
    test when either cell is outcome-based (some of its runs collapsed: a t-interval
    assumes a unimodal spread). Each entry: ``{"kind": "paired", "comparison", "measure",
    "mean", "std", "ci95", "n", "values", "test", "p", "excludes_zero"}`` (values are
    fractions; ``n``: the seeds both cells completed or stopped, a stopped run counting as a
    failure: ``STOPPED_ACCURACY``, ``stopped_area``). ``excludes_zero`` is the unadjusted
    95 % interval; the claim is ``holds`` (``holm_adjust``).
    """
    axis, methods, values = report["axis"], report["methods"], report["staleness"]
    runs, bimodal = _by_seed(report)
    reference = report["reference"]
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
            outcome_based = bimodal.get(first, False) or bimodal.get(second, False)
            entries.append(
                {
                    "kind": "paired",
                    "comparison": comparison,
                    "measure": key,
                    **_test(differences, outcome_based),
                }
            )
    return entries


def difference_in_differences(report: dict) -> list[dict]:
    """ "Degrades least", tested: the reference method's change from the smallest N to the
    largest minus another method's, paired by seed.

    ``DiD_s = (x[ref, N_high, s] − x[ref, N_low, s]) − (x[m, N_high, s] − x[m, N_low, s])``;
    positive: the reference loses less (or gains more). Tested like ``paired_differences``
    (sign test when any of the four cells is outcome-based); a seed counts when all four
    runs completed or stopped (a failure, as there). Entries: ``{"kind": "did", "comparison", "measure", ...}``; none with
    fewer than two N.
    """
    axis, methods, values = report["axis"], report["methods"], report["staleness"]
    if len(values) < 2:
        return []
    runs, bimodal = _by_seed(report)
    reference = report["reference"]
    low, high = min(values), max(values)
    entries = []
    for method in (m for m in methods if m != reference):
        cells = [(reference, high), (reference, low), (method, high), (method, low)]
        outcome_based = any(bimodal.get(cell, False) for cell in cells)
        for key, _ in PAIRED_MEASURES:
            differences = []
            for seed in report["seeds"]:
                x = [runs.get((*cell, seed)) for cell in cells]
                if all(run and run[key] is not None for run in x):
                    differences.append((x[0][key] - x[1][key]) - (x[2][key] - x[3][key]))
            entries.append(
                {
                    "kind": "did",
                    "comparison": f"({reference} − {method}) at {axis} = {high} − at {axis} = {low}",
                    "measure": key,
                    **_test(differences, outcome_based),
                }
            )
    return entries


def holm_adjust(entries: list[dict], alpha: float = ALPHA) -> list[dict]:
    """Adds ``p_holm`` (Holm over all ``entries``: the family) and ``holds`` (``p_holm ≤ alpha``)."""
    adjusted = holm([entry["p"] for entry in entries])
    return [
        {**entry, "p_holm": p, "holds": p is not None and p <= alpha}
        for entry, p in zip(entries, adjusted, strict=True)
    ]


def lag_profile(sweep: Sweep, runs: dict[Cell, dict]) -> list[dict]:
    """Per method × N: each diagnostic (``runs.DIAGNOSTICS``) against the lag within a rollout.

    For every lag ℓ (0 … N − 1 in sync mode: the mini-batch's position in its rollout, i.e.
    the learner steps since its samples were drawn), the mean of the metric over every step
    at that lag, over all seeds run (``n``: the steps averaged). ``clip`` is ``clip/low +
    clip/high`` (the fraction of tokens or sequences clipped either way). Entries:
    ``{"method", axis, "metric", "lags": [ℓ], "mean": [...], "n": [...]}``; a metric that no
    run of the cell logged is left out.
    """
    profiles = []
    for staleness, spec in itertools.product(sweep.staleness, sweep.methods):
        sums: dict[str, dict[int, list[float]]] = {}
        for seed in sweep.seeds:
            for lr in sweep.lrs or [None]:
                run = runs.get(Cell(spec, staleness, seed, sweep.axis, lr))
                for step in (run or {}).get("diagnostics", []):
                    if step["lag"] is None:
                        continue
                    values = {k: step[k] for k in DIAGNOSTICS if k in step}
                    if "loss/clip/low" in values or "loss/clip/high" in values:
                        values["clip"] = values.get("loss/clip/low", 0.0) + values.get("loss/clip/high", 0.0)
                    for name, value in values.items():
                        if math.isfinite(value):
                            sums.setdefault(name, {}).setdefault(step["lag"], []).append(value)
        for name, by_lag in sums.items():
            lags = sorted(by_lag)
            profiles.append(
                {
                    "method": spec.label,
                    sweep.axis: staleness,
                    "metric": name,
                    "lags": lags,
                    "mean": [sum(by_lag[lag]) / len(by_lag[lag]) for lag in lags],
                    "n": [len(by_lag[lag]) for lag in lags],
                }
            )
    return profiles


def code_versions(records: list[dict], axis: str = "N") -> dict[str, list[str]]:
    """The code of every run: ``{code description: [cell names]}`` (one key: all the same code).

    A run's code is its ``provenance`` (git commit, dirty flag, package versions); a finished
    run that recorded none (older runs) is "not recorded"; a run still going is left out. Two runs of a dirty tree at the
    same commit count as the same code, which the description says.
    """
    groups: dict[str, list[str]] = {}
    for record in records:
        lr = "" if record.get("lr") is None else f" lr={record['lr']:g}"
        for run in record["runs"]:
            if run.get("status") == "incomplete":  # running or not started: no code to pair yet
                continue
            code = run.get("provenance")
            if code is None:
                key = "not recorded"
            else:
                versions = ", ".join(f"{k} {v}" for k, v in sorted(code.get("versions", {}).items()))
                commit = code.get("git_commit") or "no git"
                key = f"commit {commit}{' (dirty)' if code.get('git_dirty') else ''}; {versions}"
            name = f"{record['method']} {axis}={record['staleness']}{lr} seed={run['seed']}"
            groups.setdefault(key, []).append(name)
    return groups


def check_same_code(groups: dict[str, list[str]], allow_mixed_code: bool) -> None:
    """Refuse (``ValueError``) to pair runs of different code, naming the cells of each code."""
    if len(groups) <= 1 or allow_mixed_code:
        return
    lines = [
        f"  {key}: {len(cells)} run(s): {', '.join(cells[:6])}{' ...' if len(cells) > 6 else ''}"
        for key, cells in groups.items()
    ]
    raise ValueError(
        "sweep: the runs were made by different code (a float-path change alone moves single runs by "
        "several points), so the report will not pair them:\n" + "\n".join(lines) + "\nrerun the cells "
        "of the older code (delete their directories), or pass --allow-mixed-code to report them anyway"
    )


def analyse(
    sweep: Sweep,
    runs: dict[Cell, dict],
    criterion: CollapseCriterion | None = None,
    wall_seconds: float | None = None,
    allow_mixed_code: bool = False,
) -> dict:
    """The report (``summary.json``) of ``sweep`` from the raw records of its cells' runs.

    Pure: ``runs`` maps each cell that has started to its ``runs.load_run`` record; cells
    without one count as not run. The report holds the grid, the collapse rule, one record
    per method x N (x lr; ``collect``), the code of the runs (``code``; a ``ValueError``
    when it differs, unless ``allow_mixed_code``), the diagnostics against the lag
    (``lag_profile``) and either the largest stable learning rates (``--lrs``) or the tests:
    the paired differences and the differences-in-differences, Holm-adjusted over all of
    them (``HOLM_FAMILY``) at ``stats.ALPHA``.
    """
    criterion = criterion or CollapseCriterion()
    records = collect(sweep, runs, criterion)
    groups = code_versions(records, sweep.axis)
    check_same_code(groups, allow_mixed_code)
    run_seconds = [
        run["wall_seconds"] for record in records for run in record["runs"] if run["wall_seconds"] is not None
    ]
    report = {
        "methods": sweep.labels,
        "reference": sweep.reference_method,
        "staleness": sweep.staleness,
        "axis": sweep.axis,
        "seeds": sweep.seeds,
        "lrs": sweep.lrs,
        "overrides": sweep.overrides,
        "collapse_criterion": {**dataclasses.asdict(criterion), "rule": criterion.describe()},
        "wall_seconds": wall_seconds,
        "run_seconds_total": sum(run_seconds),
        "code": groups,
        "mixed_code": len(groups) > 1,
        "records": records,
        "lag_profile": lag_profile(sweep, runs),
    }
    if sweep.lrs:
        report["lr_stability"] = lr_stability(report)
    else:
        tests = holm_adjust(paired_differences(report) + difference_in_differences(report))
        report["paired"] = [t for t in tests if t["kind"] == "paired"]
        report["did"] = [t for t in tests if t["kind"] == "did"]
        report["holm"] = {
            "alpha": ALPHA,
            "family": HOLM_FAMILY,
            "size": sum(t["p"] is not None for t in tests),
        }
    return report


def at_lr(report: dict, lr: float | None) -> dict:
    """The report restricted to the records of one learning rate."""
    return {**report, "records": [r for r in report["records"] if r.get("lr") == lr]}
