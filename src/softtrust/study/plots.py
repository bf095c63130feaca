"""The study's figures (render ``analysis.analyse``'s report only). Each raises
``softtrust._optional.MissingDependency`` without matplotlib (``report.write_report`` skips
the figures with a notice)."""

from __future__ import annotations

from pathlib import Path

from softtrust._optional import pyplot
from softtrust._runfiles import trailing_mean


def _mean_curve(curves: list[list[tuple[int, float]]]) -> tuple[list[int], list[float]]:
    """Average curves over seeds at the steps they share."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            by_step.setdefault(step, []).append(value)
    steps = sorted(step for step, values in by_step.items() if len(values) == len(curves))
    return steps, [sum(by_step[s]) / len(by_step[s]) for s in steps]


def plot_curves(report: dict, path: Path) -> None:
    """Reward (top) and held-out accuracy (bottom) against step; one panel per N, one line per method."""
    plt = pyplot("the sweep's figures")

    axis_name, values, methods = report["axis"], report["staleness"], report["methods"]
    figure, axes = plt.subplots(
        2, len(values), figsize=(3.2 * len(values) + 1, 5.5), squeeze=False, sharey="row"
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_cell = {(r["method"], r[axis_name]): r for r in report["records"]}
    for column, value in enumerate(values):
        for index, method in enumerate(methods):
            runs = by_cell[(method, value)]["runs"]
            if not runs:
                continue
            color = colors[index % len(colors)]
            steps, rewards = _mean_curve([run["curves"]["reward"] for run in runs])
            if steps:
                window = max(1, len(steps) // 16)
                axes[0][column].plot(steps, trailing_mean(rewards, window), color=color, label=method)
            steps, accuracies = _mean_curve([run["curves"]["accuracy"] for run in runs])
            if steps:
                axes[1][column].plot(steps, accuracies, "o-", markersize=3, color=color, label=method)
        axes[0][column].set_title(f"{axis_name} = {value}")
        axes[1][column].set_xlabel("optimizer step")
        for row in (0, 1):
            axes[row][column].grid(alpha=0.3)
    axes[0][0].set_ylabel("training reward (smoothed)")
    axes[1][0].set_ylabel("held-out accuracy")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_final_vs_staleness(report: dict, path: Path) -> None:
    """Final held-out accuracy (mean ± 95 % CI over seeds) against staleness, one line per method."""
    plt = pyplot("the sweep's figures")

    axis_name = report["axis"]
    figure, axis = plt.subplots(figsize=(6, 4))
    for method in report["methods"]:
        points = [
            (r[axis_name], r["final_accuracy"]["mean"], r["final_accuracy"]["ci95"] or 0.0)
            for r in report["records"]
            if r["method"] == method and r["final_accuracy"]["mean"] is not None
        ]
        if points:
            xs, ys, errors = zip(*points, strict=True)
            axis.errorbar(xs, ys, yerr=errors, marker="o", capsize=3, label=method)
    before = [
        r["accuracy_before"]["mean"] for r in report["records"] if r["accuracy_before"]["mean"] is not None
    ]
    if before:
        axis.axhline(sum(before) / len(before), color="gray", linestyle="--", label="warm start")
    if all(value > 0 for value in report["staleness"]):
        axis.set_xscale("log", base=2)
    axis.set_xticks(report["staleness"])
    axis.set_xticklabels([str(v) for v in report["staleness"]])
    axis.set_xlabel("staleness N" if axis_name == "N" else "async lag bound K")
    axis.set_ylabel("final held-out accuracy")
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_lr_stability(report: dict, path: Path) -> None:
    """The largest stable learning rate against staleness, one line per method (log-log)."""
    plt = pyplot("the sweep's figures")
    from matplotlib.ticker import NullFormatter  # matplotlib is there: pyplot() imported it

    axis_name, lrs = report["axis"], report["lrs"]
    floor = lrs[0] / 2  # where "unstable even at the smallest" is drawn
    figure, axis = plt.subplots(figsize=(6, 4))
    for offset, method in enumerate(report["methods"]):
        rows = [row for row in report["lr_stability"] if row["method"] == method]
        xs = [row[axis_name] * (1 + 0.04 * offset) for row in rows]  # a small shift: no hidden lines
        ys = [row["largest_stable_lr"] or floor for row in rows]
        axis.plot(xs, ys, marker="o", label=method)
    axis.axhline(floor, color="gray", linestyle=":", label=f"< {lrs[0]:g} (none stable)")
    if all(value > 0 for value in report["staleness"]):
        axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_yticks(lrs)
    axis.set_yticklabels([f"{lr:g}" for lr in lrs])
    axis.yaxis.set_minor_formatter(NullFormatter())
    axis.set_xticks(report["staleness"])
    axis.set_xticklabels([str(v) for v in report["staleness"]])
    axis.set_xlabel("staleness N" if axis_name == "N" else "async lag bound K")
    axis.set_ylabel("largest stable learning rate")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_paired(report: dict, path: Path) -> None:
    """The paired tests, final accuracy: each comparison's per-seed differences (dots), their mean
    and 95 % interval (bar); filled where the claim holds after Holm. Points, 0 marked."""
    plt = pyplot("the sweep's figures")

    entries = [
        e
        for e in report.get("paired", []) + report.get("did", [])
        if e["measure"] == "final_accuracy" and e["n"]
    ]
    if not entries:
        return
    figure, axis = plt.subplots(figsize=(7, 0.42 * len(entries) + 1.2))
    for row, entry in enumerate(entries):
        y = len(entries) - 1 - row
        axis.scatter(
            [100 * v for v in entry["values"]], [y] * len(entry["values"]), s=14, color="gray", zorder=2
        )
        color = "C3" if entry["kind"] == "did" else "C0"
        error = 0.0 if entry["ci95"] is None else 100 * entry["ci95"]
        axis.errorbar(
            100 * entry["mean"],
            y,
            xerr=error,
            fmt="o",
            markerfacecolor=color if entry.get("holds") else "white",
            color=color,
            capsize=3,
            zorder=3,
        )
    axis.axvline(0, color="black", linewidth=0.8)
    axis.set_yticks(range(len(entries)))
    axis.set_yticklabels(
        [e["comparison"] + (" (sign test)" if e["test"] == "sign" else "") for e in reversed(entries)],
        fontsize=7,
    )
    axis.set_xlabel("paired difference, final accuracy (points); filled: holds (Holm)")
    axis.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def plot_lag(report: dict, path: Path) -> None:
    """φ, ESS, clipped fraction and KL to the behaviour policy against the lag within a rollout:
    one panel per diagnostic, one line per method x N (mean over steps and seeds)."""
    plt = pyplot("the sweep's figures")

    from .markdown import LAG_METRICS

    profiles = report.get("lag_profile") or []
    metrics = [(key, title) for key, title in LAG_METRICS if any(p["metric"] == key for p in profiles)]
    if not metrics:
        return
    axis_name = report["axis"]
    figure, axes = plt.subplots(1, len(metrics), figsize=(3.4 * len(metrics) + 1, 3.4), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    values = sorted(report["staleness"])
    for column, (key, title) in enumerate(metrics):
        axis = axes[0][column]
        for index, method in enumerate(report["methods"]):
            for position, value in enumerate(values):
                profile = next(
                    (p for p in profiles if (p["method"], p[axis_name], p["metric"]) == (method, value, key)),
                    None,
                )
                if profile is None:
                    continue
                axis.plot(
                    profile["lags"],
                    profile["mean"],
                    styles[position % len(styles)],
                    color=colors[index % len(colors)],
                    label=f"{method} {axis_name}={value}",
                )
        axis.set_title(title)
        axis.set_xlabel("lag (learner steps since sampling)")
        axis.grid(alpha=0.3)
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
