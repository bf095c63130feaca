"""``summary.md``: the report as tables (renders ``analysis.analyse``'s report only)."""

from __future__ import annotations

import math

from .analysis import PAIRED_MEASURES, at_lr


def _format_p(p: float | None) -> str:
    return "—" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _tests_table(report: dict, key: str, title: str) -> list[str]:
    """One row per comparison x measure: mean ± 95 % CI (points), the test, p, Holm-adjusted p;
    bold where the claim holds after Holm."""
    entries = report.get(key) or []
    if len(report["seeds"]) < 2 or not entries:
        return []
    titles = dict(PAIRED_MEASURES)
    lines = [
        f"## {title}",
        "",
        "| comparison | measure | mean ± 95 % CI (points) | seeds + / − | test | p | p (Holm) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for entry in entries:
        text = format_stat(entry, len(report["seeds"]))
        signs = f"{sum(v > 0 for v in entry['values'])} / {sum(v < 0 for v in entry['values'])}"
        holds = entry.get("holds")
        lines.append(
            f"| {entry['comparison']} | {titles[entry['measure']]} | {f'**{text}**' if holds else text} | "
            f"{signs} | {'paired t' if entry['test'] == 't' else 'sign (exact)'} | {_format_p(entry['p'])} | "
            f"{'**' + _format_p(entry.get('p_holm')) + '**' if holds else _format_p(entry.get('p_holm'))} |"
        )
    return [*lines, ""]


def _tests_section(report: dict) -> list[str]:
    """The paired differences and the differences-in-differences, with the Holm adjustment."""
    if "holm" not in report or len(report["seeds"]) < 2:
        return []
    holm, seeds, axis = report["holm"], len(report["seeds"]), report["axis"]
    smallest = 2 * 0.5**seeds  # the exact two-sided sign test's smallest p: every seed one way
    lines = [
        "## Tests (paired by seed, Holm-adjusted)",
        "",
        f"Family for the Holm adjustment: {holm['family']} ({holm['size']} tests), family-wise "
        f"α = {holm['alpha']:g}. **Bold**: the claim holds after the adjustment. The test is the paired "
        "t-test, or the exact sign test where a cell involved has collapsed runs (outcome-based: the spread "
        f"is bimodal; with {seeds} seeds its smallest p is {smallest:.3g}"
        + (", so such a comparison cannot hold)." if smallest > holm["alpha"] else ").")
        + " A run stopped on non-finite updates counts as a failure: accuracy 0 from its last evaluation on.",
        "",
    ]
    lines += _tests_table(report, "paired", "Paired differences")
    lines += _tests_table(
        report,
        "did",
        'Difference-in-differences ("degrades least": the reference\'s change from the smallest to the '
        f"largest {axis} minus the other method's; positive: the reference loses less)",
    )
    return lines


def _outcome_table(report: dict) -> list[str]:
    """Cells with collapsed runs, by outcome (collapsed / not) instead of a t-interval."""
    axis = report["axis"]
    rows = [r for r in report["records"] if r.get("outcome_based")]
    if not rows:
        return []
    lines = [
        "## Outcome-based cells (some runs collapsed: the spread is bimodal, a t-interval does not describe it)",
        "",
        "| method | "
        + axis
        + " | collapsed | not collapsed | unfinished | final accuracy per seed (collapsed marked ×; "
        "× stopped: stopped on non-finite updates, counted 0) | "
        "final of the runs that did not collapse |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for record in rows:
        outcomes = record["outcomes"]
        per_seed = ", ".join(
            f"{run['seed']}: "
            + ("—" if run["final_accuracy"] is None else f"{100 * run['final_accuracy']:.1f}")
            + (" × stopped" if run["status"] == "stopped" else "")
            + (" ×" if run["collapsed"] and run["status"] != "stopped" else "")
            + (" (unfinished)" if run["outcome"] == "unfinished" else "")
            for run in record["runs"]
        )
        lines.append(
            f"| {record['method']} | {record[axis]} | {outcomes['collapsed']} | {outcomes['not_collapsed']} | "
            f"{outcomes['unfinished']} | {per_seed} | {format_stat(outcomes['final_not_collapsed'])} |"
        )
    return [*lines, ""]


def _unfinished_lines(report: dict) -> list[str]:
    """The runs that started but have no result for the planned steps (interrupted, crashed or
    still running): named, so that a missing number is not read as a run that did not collapse."""
    axis = report["axis"]
    names = [
        f"{record['method']} {axis}={record[axis]}"
        + ("" if record.get("lr") is None else f" lr={record['lr']:g}")
        + f" seed={run['seed']} (step {run['steps']}, {run['status']})"
        for record in report["records"]
        for run in record["runs"]
        if run["outcome"] == "unfinished"
    ]
    if not names:
        return []
    return [
        f"**Unfinished runs ({len(names)})**: started, no result for the planned steps (interrupted, crashed or "
        "still running; the same `softtrust sweep` command resumes them); counted neither as collapsed nor "
        "as not collapsed: " + ", ".join(names) + ".",
        "",
    ]


LAG_METRICS = (
    ("loss/phi/mean", "φ"),
    ("loss/ess", "ESS"),
    ("clip", "clipped"),
    ("kl_behaviour", "KL(behaviour ‖ current)"),
)


def _lag_table(report: dict) -> list[str]:
    """Per method at the largest N: each diagnostic at a few lags within a rollout."""
    axis = report["axis"]
    profiles = report.get("lag_profile") or []
    if not profiles:
        return []
    high = max(report["staleness"])
    at_high = {(p["method"], p["metric"]): p for p in profiles if p[axis] == high}
    lags = sorted({lag for p in at_high.values() for lag in p["lags"]})
    if not lags:
        return []
    shown = sorted(
        {lags[0], lags[len(lags) // 4], lags[len(lags) // 2], lags[(3 * len(lags)) // 4], lags[-1]}
    )
    lines = [
        f"## Diagnostics against the lag ({axis} = {high}; mean over steps and seeds)",
        "",
        "The lag: learner steps since the mini-batch's samples were drawn (`lag` in `metrics.jsonl`; "
        "sync: the mini-batch's position within its rollout; async: the lag observed). "
        f"`lag.png` draws every lag and {axis}.",
        "",
        "| method | diagnostic | " + " | ".join(f"lag {lag}" for lag in shown) + " |",
        "| --- | --- | " + " | ".join("---" for _ in shown) + " |",
    ]
    steps = {}  # the steps behind each mean: async lags below K occur only while the worker fills up
    for profile in at_high.values():
        for lag, n in zip(profile["lags"], profile["n"], strict=True):
            steps[lag] = max(steps.get(lag, 0), n)
    lines.append("| all | steps at this lag | " + " | ".join(str(steps.get(lag, 0)) for lag in shown) + " |")
    for method in report["methods"]:
        for metric, title in LAG_METRICS:
            profile = at_high.get((method, metric))
            if profile is None:
                continue
            by_lag = dict(zip(profile["lags"], profile["mean"], strict=True))
            cells = ["—" if lag not in by_lag else f"{by_lag[lag]:.3g}" for lag in shown]
            lines.append(f"| {method} | {title} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _throughput_table(report: dict) -> list[str]:
    """Steps per hour and how much sampling the learner waited for, next to final accuracy."""
    axis = report["axis"]
    rows = [r for r in report["records"] if r.get("steps_per_hour", {}).get("n")]
    if not rows:
        return []

    def share(stat: dict) -> str:
        return "—" if stat["mean"] is None else f"{100 * stat['mean']:.0f} %"

    lines = [
        "## Throughput (training steps only: no warm start, evaluations or checkpoints)",
        "",
        "Steps per hour: mean ± 95 % CI over seeds. Learner waiting: the share of the step time "
        "spent waiting for the mini-batch. Sampling hidden: the share of the sampler's time the "
        "learner did not wait for (it ran while the learner updated or evaluated; synchronous: 0; "
        "a concurrent worker never waited for: 100 %). Throughput on a shared machine is only comparable between cells that ran "
        "alone (`--jobs 1`).",
        "",
        f"| method | {axis} | steps per hour | learner waiting | sampling hidden | final accuracy |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for record in rows:
        per_hour = record["steps_per_hour"]
        rate = f"{per_hour['mean']:.0f}" + ("" if per_hour["ci95"] is None else f" ± {per_hour['ci95']:.0f}")
        lines.append(
            f"| {record['method']} | {record[axis]} | {rate} | {share(record['learner_waiting'])} | "
            f"{share(record['sampling_hidden'])} | {format_stat(record['final_accuracy'])} |"
        )
    return [*lines, ""]


def _code_lines(report: dict) -> list[str]:
    groups = report.get("code") or {}
    if len(groups) == 1:
        return [f"Code of every run: {next(iter(groups))}.", ""]
    if not groups:
        return []
    return [
        "**Mixed code (reported with --allow-mixed-code): the runs were made by different code, and "
        "pairing them mixes float paths with the effects compared.**",
        "",
        *[f"- {key}: {len(cells)} run(s)" for key, cells in groups.items()],
        "",
    ]


def format_stat(stat: dict, seeds: int | None = None) -> str:
    """``mean ± ci`` in points; `` (n = k)`` when fewer than ``seeds`` runs (but some) went into it."""
    if stat["mean"] is None:
        return "—"
    text = (
        f"{100 * stat['mean']:.1f}"
        if stat["ci95"] is None
        else f"{100 * stat['mean']:.1f} ± {100 * stat['ci95']:.1f}"
    )
    return text + (f" (n = {stat['n']})" if seeds is not None and stat["n"] < seeds else "")


def markdown_table(report: dict) -> str:
    """Rows N, columns methods (the VESPO paper's Table 2 layout), one table per measure;
    with a learning-rate axis, one set of tables per learning rate and the stability table."""
    lines = _report_header(report) + _unfinished_lines(report)
    lrs = report.get("lrs")
    if lrs:
        lines += _lr_stability_table(report)
    for lr in lrs or [None]:
        if lr is not None:
            lines += [f"## Learning rate {lr:g}", ""]
        lines += _measure_tables(at_lr(report, lr), heading="###" if lr is not None else "##")
    lines += _outcome_table(report)
    lines += _tests_section(report)
    lines += _lag_table(report)
    lines += _throughput_table(report)
    lines += _code_lines(report)
    warm_starts = {}
    for record in report["records"]:
        for run in record["runs"]:
            if run["accuracy_before"] is not None and math.isfinite(run["accuracy_before"]):
                warm_starts.setdefault(run["seed"], run["accuracy_before"])
    lines += [
        "Warm start (held-out accuracy before RL, shared by every cell of a seed): "
        + (", ".join(f"seed {s}: {100 * a:.1f} %" for s, a in sorted(warm_starts.items())) or "not measured")
        + ".",
        f"Collapse criterion: {report['collapse_criterion']['rule']}.",
        "",
    ]
    return "\n".join(lines)


def _report_header(report: dict) -> list[str]:
    axis, seeds = report["axis"], len(report["seeds"])
    return [
        "# Staleness sweep",
        "",
        f"Held-out greedy accuracy (%), mean over {seeds} seed(s)"
        + (" ± 95 % CI (Student t; `(n = k)`: only k of them ran)" if seeds > 1 else "")
        + f"; {axis} = "
        + ("synchronous staleness" if axis == "N" else "async lag bound")
        + ". Shared settings: "
        + (", ".join(f"`{k}={v}`" for k, v in report["overrides"].items()) or "trainer defaults")
        + ".",
        "",
    ]


def _lr_stability_table(report: dict) -> list[str]:
    axis, methods = report["axis"], report["methods"]
    rows = {(row["method"], row[axis]): row for row in report["lr_stability"]}
    tried, smallest = ", ".join(f"{lr:g}" for lr in report["lrs"]), f"{report['lrs'][0]:g}"
    lines = [
        "## Largest stable learning rate",
        "",
        f"Learning rates tried: {tried}. Stable: every seed completed without collapsing at that "
        f"rate and at every smaller one; `< {smallest}` means the smallest already failed.",
        "",
        "| " + " | ".join([axis, *methods]) + " |",
        "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
    ]
    for value in report["staleness"]:
        cells = []
        for m in methods:
            stable = rows[(m, value)]["largest_stable_lr"]
            cells.append(f"< {smallest}" if stable is None else f"{stable:g}")
        lines.append("| " + " | ".join([str(value), *cells]) + " |")
    return [*lines, ""]


def _measure_tables(report: dict, heading: str = "##") -> list[str]:
    axis, methods = report["axis"], report["methods"]
    by_cell = {(r["method"], r[axis]): r for r in report["records"]}
    seeds = len(report["seeds"])
    lines = []
    tables = [
        ("Final accuracy", "final_accuracy"),
        ("Best accuracy during the run", "best_accuracy"),
        ("Area under the accuracy curve (mean accuracy along the run)", "auc_accuracy"),
    ]
    for title, key in tables:
        lines += [f"{heading} {title}", "", "| " + " | ".join([axis, *methods]) + " |"]
        lines.append("| " + " | ".join(["---"] * (len(methods) + 1)) + " |")
        for value in report["staleness"]:
            cells = [format_stat(by_cell[(m, value)][key], seeds) for m in methods]
            lines.append("| " + " | ".join([str(value), *cells]) + " |")
        lines.append("")
    lines += [
        f"{heading} Collapsed runs (collapsed / runs with an outcome, first collapse step; unfinished runs apart)",
        "",
    ]
    lines += [
        "| " + " | ".join([axis, *methods]) + " |",
        "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
    ]
    for value in report["staleness"]:
        cells = []
        for m in methods:
            record = by_cell[(m, value)]
            outcomes = record["outcomes"]
            text = f"{outcomes['collapsed']}/{outcomes['collapsed'] + outcomes['not_collapsed']}"
            if record["first_collapse_step"] is not None:
                reasons = sorted({run["collapse_reason"] for run in record["runs"] if run["collapsed"]})
                text += f" (step {record['first_collapse_step']}, {'/'.join(reasons)})"
            if outcomes["unfinished"]:
                text += f", {outcomes['unfinished']} unfinished"
            cells.append(text)
        lines.append("| " + " | ".join([str(value), *cells]) + " |")
    if seeds > 1:
        lines += [
            "",
            f"{heading} Final accuracy per seed (" + " / ".join(f"seed {s}" for s in report["seeds"]) + ")",
            "",
        ]
        lines += [
            "| " + " | ".join([axis, *methods]) + " |",
            "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
        ]
        for value in report["staleness"]:
            cells = []
            for m in methods:
                by_seed = {run["seed"]: run["final_accuracy"] for run in by_cell[(m, value)]["runs"]}
                cells.append(
                    " / ".join(
                        "—" if by_seed.get(s) is None else f"{100 * by_seed[s]:.1f}" for s in report["seeds"]
                    )
                )
            lines.append("| " + " | ".join([str(value), *cells]) + " |")
    return [*lines, ""]
