"""``summary.md``: the report as tables (renders ``analysis.analyse``'s report only)."""

from __future__ import annotations

import math

from .analysis import PAIRED_MEASURES, at_lr


def _paired_table(report: dict) -> list[str]:
    """The paired differences as a table (points), bold where the interval excludes 0."""
    entries = report.get("paired") or []
    if len(report["seeds"]) < 2 or not entries:
        return []
    by_comparison: dict[str, dict] = {}
    for entry in entries:
        by_comparison.setdefault(entry["comparison"], {})[entry["measure"]] = entry
    lines = [
        "## Paired differences (points; mean ± 95 % CI over seeds; bold: the interval excludes 0)",
        "",
        "| comparison | " + " | ".join(title for _, title in PAIRED_MEASURES) + " |",
        "| --- | " + " | ".join("---" for _ in PAIRED_MEASURES) + " |",
    ]
    for comparison, measures in by_comparison.items():
        cells = []
        for key, _ in PAIRED_MEASURES:
            entry = measures[key]
            text = format_stat(entry, len(report["seeds"]))
            cells.append(f"**{text}**" if entry["excludes_zero"] else text)
        lines.append(f"| {comparison} | " + " | ".join(cells) + " |")
    return [*lines, ""]


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
    lines = _report_header(report)
    lrs = report.get("lrs")
    if lrs:
        lines += _lr_stability_table(report)
    for lr in lrs or [None]:
        if lr is not None:
            lines += [f"## Learning rate {lr:g}", ""]
        lines += _measure_tables(at_lr(report, lr), heading="###" if lr is not None else "##")
    lines += _paired_table(report)
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
    lines += [f"{heading} Collapsed runs (collapsed / runs, first collapse step)", ""]
    lines += [
        "| " + " | ".join([axis, *methods]) + " |",
        "| " + " | ".join(["---"] * (len(methods) + 1)) + " |",
    ]
    for value in report["staleness"]:
        cells = []
        for m in methods:
            record = by_cell[(m, value)]
            text = f"{record['collapsed_runs']}/{len(record['runs'])}"
            if record["first_collapse_step"] is not None:
                reasons = sorted({run["collapse_reason"] for run in record["runs"] if run["collapsed"]})
                text += f" (step {record['first_collapse_step']}, {'/'.join(reasons)})"
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
