"""The confirmation study's registered tests (``docs/preregistration.md``, issue 36), computed as written.

From the cells' run directories (``softtrust sweep --preset confirm-*``), one value per run
and measure, paired by seed:

* a completed run: its ``final`` (held-out accuracy after the last step) and ``area`` (mean
  accuracy along the run, ``analysis.area_under_curve``);
* a run stopped on non-finite updates: ``final = 0`` and accuracy 0 at every evaluation after
  the stop (the registered value: a method cannot gain by stopping);
* any other unfinished run: no value (its seed leaves the comparisons that need it).

A comparison involving a cell with a stopped or collapsed run uses the exact sign test; an
equivalence (TOST) cannot be shown by it and does not hold. The primary family (H1–H4) and the
secondary one (S1, S2) are each adjusted by Holm at α = 0.05.

    python -m softtrust.study.confirmation --sync sweeps/confirm --async sweeps/confirm-async \\
        [--mismatch sweeps/confirm-mismatch] [--lr sweeps/confirm-lr] [--output docs/confirmation.md]
    python -m softtrust.study.confirmation --export sweeps/confirm docs/data/confirm.json  # adds finished runs
    python -m softtrust.study.confirmation --sync docs/data/confirm.json --async docs/data/confirm-async.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import subprocess
from pathlib import Path

import yaml

from softtrust._runfiles import atomic_write_text

from .analysis import CollapseCriterion, run_outcome
from .grid import Cell
from .presets import REGISTERED_SEEDS
from .runs import load_run
from .stats import ALPHA, holm, mean_std_ci, paired_t_test, sign_test

MARGIN = 0.03  # the equivalence margin of H4 and S1: ±3 points
MAX_STEPS = 256  # STUDY_SETUP's
DECOUPLED = (
    "clip-proximal=held-proximal_every=16"  # the cell directory of clip[proximal=held,proximal_every=16]
)
EPS_028 = "clip-eps_high=0.28"
MIS = "clip-correction=mis"

# key of a run: (cell directory slug, N or K, seed)
Key = tuple[str, int, int]


REGISTRATION = "e767df9"  # the commit of docs/preregistration.md: every counted cell descends from it


def cell_records(sweep_dir: Path, max_steps: int = MAX_STEPS) -> list[dict]:
    """One compact record per run under ``sweep_dir/runs/<slug>/<N|K><value>[/lr<lr>]/seed<s>`` (the per-cell
    data of ``docs/data/``, issue 36 item 4): the cell, its status and collapse, the registered
    ``final`` and ``area``, the evaluation curve, the reward per step, the recorded commit and the
    settings that define the cell (its ``config.yaml`` without paths and display fields)."""
    records, criterion = [], CollapseCriterion()
    for seed_dir, parts in Cell.run_directories(Path(sweep_dir)):
        run = load_run(seed_dir)
        if run is None:
            continue
        outcome = run_outcome(run, max_steps, criterion)
        settings = {}
        if (seed_dir / "config.yaml").is_file():
            settings = yaml.safe_load((seed_dir / "config.yaml").read_text()) or {}
        records.append({
            "cell": parts["slug"], "axis": parts["axis"], "value": parts["value"],
            "seed": parts["seed"], "status": outcome["status"],
            "collapsed": bool(outcome["collapsed"]), "final": outcome["final_accuracy"], "area": outcome["auc_accuracy"],
            "accuracy": [list(point) for point in run["accuracies"]], "reward": [value for _, value in run["rewards"]],
            "commit": (run.get("provenance") or {}).get("git_commit"),
            "settings": {k: v for k, v in settings.items() if k not in _NOT_SETTINGS},
        })  # fmt: skip
    return records


def export(sweep_dir: Path, target: Path) -> str:
    """Add the finished runs (complete or stopped) of ``sweep_dir`` to the per-cell data file
    ``target``, keeping the runs it already holds: the study runs over several sittings, each
    in a sweep directory of its own, and a run that is unfinished at a sitting's end is left for
    the next. A run in both must be the same record (a rerun of a cell on another float path
    differs: a ``ValueError`` naming the run). Returns a line saying what was written."""
    finished = [record for record in cell_records(sweep_dir) if record["status"] in ("complete", "stopped")]
    held = json.loads(target.read_text()) if target.is_file() else []
    merged = {_record_key(record): record for record in held}
    for record in finished:
        key = _record_key(record)
        if merged.get(key, record) != record:
            raise ValueError(
                f"{target} already holds {_run_name(record)} with other values than {sweep_dir}'s run; "
                "keep one of them"
            )
        merged[key] = record
    records = [merged[key] for key in sorted(merged, key=str)]
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(records, separators=(",", ":")) + "\n")
    added = len(merged) - len(held)
    return f"{len(finished)} finished runs in {sweep_dir} ({added} new); {len(records)} runs in {target}"


def _run_name(record: dict) -> str:
    lr = record["settings"].get("lr")
    return f"{record['cell']} {record['axis']}={record['value']} seed {record['seed']}" + (
        f" (lr {lr})" if lr is not None else ""
    )


def _record_key(record: dict) -> tuple:
    return (record["cell"], record["axis"], record["value"], record["seed"], record["settings"].get("lr"))


_NOT_SETTINGS = ("output_dir", "resume", "progress", "cache_dir", "report_to", "num_threads", "device")


def load_outcomes(
    source: Path,
    max_steps: int = MAX_STEPS,
    registration: str | None = REGISTRATION,
    excluded: list[str] | None = None,
) -> dict[Key, dict]:
    """The registered values of every run of a registered seed whose recorded commit descends from
    ``registration`` (None: no check). ``source``: a sweep directory, or the JSON file its
    ``cell_records`` were exported to (``docs/data/``): the same values either way. ``excluded``
    receives a line for every run left out (another seed, another commit, no recorded commit, a
    commit git cannot check)."""
    values = {}
    for record in counted_records(source, max_steps, registration, excluded):
        failed = record["status"] == "stopped" or record["collapsed"]
        values[record["cell"], record["value"], record["seed"]] = {
            "final": record["final"], "area": record["area"], "failed": failed,
        }  # fmt: skip
    return values


def counted_records(
    source: Path,
    max_steps: int = MAX_STEPS,
    registration: str | None = REGISTRATION,
    excluded: list[str] | None = None,
) -> list[dict]:
    """The ``cell_records`` of ``source`` (a sweep directory or its exported JSON) that count: a
    registered seed and a recorded commit descending from ``registration``; a line in
    ``excluded`` for each other one."""
    source = Path(source)
    records = json.loads(source.read_text()) if source.is_file() else cell_records(source, max_steps)
    excluded = [] if excluded is None else excluded
    counted = []
    for record in records:
        reason = (
            f"seed {record['seed']} is not a registered seed"
            if record["seed"] not in REGISTERED_SEEDS
            else None
        )
        if reason is None and registration is not None:
            reason = lineage_problem({"git_commit": record["commit"]}, registration)
        if reason is not None:
            excluded.append(f"{_run_name(record)}: {reason}")
            continue
        counted.append(record)
    return counted


def lr_sensitivity(records: list[dict]) -> list[dict]:
    """The registered sensitivity check (descriptive, no test): per learning rate and measure
    (``final``, ``area``), ``d_s = value(VESPO, N = 64, seed s) − value(clip, N = 64, seed s)`` for
    every seed where both runs have a value (a stopped run at its registered values; an
    unfinished one has none), with their mean ± std.
    ``records``: ``counted_records`` of the ``confirm-lr`` sweep (the lr is each run's setting)."""
    by_key = {(r["cell"], r["value"], r["settings"].get("lr"), r["seed"]): r for r in records}
    rows = []
    for lr in sorted({key[2] for key in by_key if key[2] is not None}):
        for measure in ("final", "area"):
            seeds = sorted(
                s
                for c, n, rate, s in by_key
                if (c, n, rate) == ("vespo", 64, lr)
                and by_key[c, n, rate, s][measure] is not None
                and by_key.get(("clip", 64, lr, s), {}).get(measure) is not None
            )
            differences = [
                by_key["vespo", 64, lr, s][measure] - by_key["clip", 64, lr, s][measure] for s in seeds
            ]
            rows.append({"lr": lr, "measure": measure, "seeds": seeds, "differences": differences,
                         **mean_std_ci(differences)})  # fmt: skip
    return rows


def lr_markdown(rows: list[dict]) -> str:
    """``lr_sensitivity`` as a Markdown table (points)."""
    lines = ["| lr | measure | VESPO − clip at N = 64, per seed (points) | mean ± std | mean > 0 |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in rows:
        per_seed = ", ".join(
            f"{s}: {100 * d:+.1f}" for s, d in zip(row["seeds"], row["differences"], strict=True)
        )
        mean = "—" if row["mean"] is None else f"{_points(row)} (n = {row['n']})"
        sign = "—" if row["mean"] is None else ("yes" if row["mean"] > 0 else "no")
        lines.append(f"| {row['lr']:g} | {row['measure']} | {per_seed} | {mean} | {sign} |")
    return "\n".join(lines) + "\n"


def _points(stat: dict) -> str:
    """``stat``'s (``mean_std_ci``'s) mean ± std in points, or "—" where it has no mean."""
    if stat["mean"] is None:
        return "—"
    spread = "—" if stat["std"] is None else f"{100 * stat['std']:.1f}"
    return f"{100 * stat['mean']:+.1f} ± {spread}"


def lineage_problem(provenance: dict | None, registration: str) -> str | None:
    """Why a run whose ``provenance`` this is may not count (its commit does not descend from
    ``registration``: ``git merge-base --is-ancestor``), or None when it may."""
    commit = (provenance or {}).get("git_commit")
    if not commit:
        return "no recorded commit"
    return _descent_problem(commit, registration)


@functools.cache
def _descent_problem(commit: str, registration: str) -> str | None:
    """``lineage_problem``'s git check, once per commit (the study's cells share a few)."""
    result = subprocess.run(  # in this repository (an installed copy without git: cannot check, left out)
        ["git", "merge-base", "--is-ancestor", registration, commit],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    if result.returncode == 1:
        return f"commit {commit[:12]} does not descend from the registration {registration}"
    if result.returncode != 0:
        return f"git cannot check commit {commit[:12]} ({result.stderr.strip() or 'unknown commit'})"
    return None


def tost(differences: list[float], margin: float = MARGIN) -> dict:
    """Two one-sided paired t-tests of ``mean(d)`` against ``−margin`` and ``+margin``:
    ``p = max(p_low, p_high)``, each one-sided (``t`` with ``n − 1`` d.f.); equivalence at level α
    when ``p ≤ α`` (the 1 − 2α interval lies inside ±margin). None with fewer than two values."""
    from softtrust._optional import import_optional

    stats = import_optional("scipy.stats", "the confirmation study's tests")
    stat = mean_std_ci(differences)
    p = None
    if stat["n"] >= 2:
        if stat["std"] == 0:
            p = 0.0 if abs(stat["mean"]) < margin else 1.0
        else:
            error = stat["std"] / math.sqrt(stat["n"])
            p_low = float(stats.t.sf((stat["mean"] + margin) / error, stat["n"] - 1))  # H0: mean <= -margin
            p_high = float(stats.t.sf((margin - stat["mean"]) / error, stat["n"] - 1))  # H0: mean >= +margin
            p = max(p_low, p_high)
    return {**stat, "test": "tost", "p": p}


def _differences(values: dict[Key, dict], measure: str, terms: list[tuple[float, Key]]) -> tuple[list, bool]:
    """Per seed ``Σ weight · value(key)`` over ``terms`` (keys without their seed), for the seeds
    where every term has a value; and whether any run of the cells involved failed, at any seed
    (the registration switches the test by cell, not by the seeds that pair up)."""
    seeds = sorted({key[2] for key in values})
    cells = {key[:2] for _, key in terms}
    failed = any(run["failed"] for key, run in values.items() if key[:2] in cells)
    differences = []
    for seed in seeds:
        runs = [values.get((*key[:2], seed)) for _, key in terms]
        if all(run is not None and run[measure] is not None for run in runs):
            differences.append(
                sum(weight * run[measure] for (weight, _), run in zip(terms, runs, strict=True))
            )
    return differences, failed


def _entry(name: str, claim: str, measure: str, differences: list[float], failed: bool, kind: str) -> dict:
    """One registered test: ``kind`` "greater" (mean > 0 claimed) or "equivalent" (TOST)."""
    if kind == "equivalent" and failed:  # the sign test cannot show equivalence: registered as not holding
        stat = {**mean_std_ci(differences), "test": "tost", "p": 1.0}
        stat["note"] = "a stopped or collapsed run: equivalence not testable"
    elif kind == "equivalent":
        stat = tost(differences)
        if stat["p"] is None:
            stat = {**stat, "p": 1.0, "note": "fewer than two seeds"}
    else:
        stat = sign_test(differences) if failed else paired_t_test(differences)
        if stat["p"] is None:
            stat = {**stat, "p": 1.0, "note": "fewer than two seeds"}
    positive = sum(d > 0 for d in differences)
    return {"name": name, "claim": claim, "measure": measure, "kind": kind, "positive": positive,
            "negative": sum(d < 0 for d in differences), **stat}  # fmt: skip


def _adjusted(entries: list[dict]) -> list[dict]:
    adjusted = holm([entry["p"] for entry in entries])
    result = []
    for entry, p in zip(entries, adjusted, strict=True):
        direction = entry["kind"] == "equivalent" or (entry["mean"] is not None and entry["mean"] > 0)
        result.append({**entry, "p_holm": p, "holds": p is not None and p <= ALPHA and direction})
    return result


def primary_family(sync: dict[Key, dict], asynchronous: dict[Key, dict]) -> list[dict]:
    """H1–H4 in the registered order, Holm-adjusted over the four."""
    did = [(1, ("vespo", 64)), (-1, ("vespo", 4)), (-1, ("clip", 64)), (1, ("clip", 4))]
    did_async = [(1, ("vespo", 16)), (-1, ("vespo", 1)), (-1, ("clip", 16)), (1, ("clip", 1))]
    entries = [
        _entry("H1", "sync: VESPO degrades less than clip, N 4 → 64 (DiD)", "area", *_differences(sync, "area", did), "greater"),
        _entry("H2", "async: VESPO degrades less than clip, K 1 → 16 (DiD)", "area",
               *_differences(asynchronous, "area", did_async), "greater"),
        _entry("H3", "decoupled clip (held π_prox, M = K = 16) − naive clip at K = 16", "area",
               *_differences(asynchronous, "area", [(1, (DECOUPLED, 16)), (-1, ("clip", 16))]), "greater"),
        _entry("H4", "VESPO − DPPO at N = 64 within ±3 points", "final",
               *_differences(sync, "final", [(1, ("vespo", 64)), (-1, ("dppo", 64))]), "equivalent"),
    ]  # fmt: skip
    return _adjusted(entries)


def secondary_family(sync: dict[Key, dict], mismatch: dict[Key, dict] | None) -> list[dict]:
    """S1 (and S2 when the mismatch cells exist), Holm-adjusted over the family."""
    entries = [
        _entry("S1", "clip ε_high 0.28 − 0.2 at N = 64 within ±3 points", "final",
               *_differences(sync, "final", [(1, (EPS_028, 64)), (-1, ("clip", 64))]), "equivalent"),
    ]  # fmt: skip
    if mismatch:
        terms = [(1, (MIS, 1)), (-1, ("clip", 1))]
        entries.append(_entry("S2", "sequence MIS − none, perturbed sampler, N = 1", "area",
                              *_differences(mismatch, "area", terms), "greater"))  # fmt: skip
    return _adjusted(entries)


def markdown(family: list[dict]) -> str:
    """The family as a Markdown table, in the registered order (points, mean ± std over seeds)."""
    lines = [
        "| | claim | measure | mean ± std (points) | seeds +/− | test | p | p (Holm) | holds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in family:
        lines.append(
            f"| {e['name']} | {e['claim']} | {e['measure']} | {_points(e)} (n = {e['n']}) | {e['positive']} / "
            f"{e['negative']} | {e['test']} | {e['p']:.4f} | {e['p_holm']:.4f} | "
            f"{'**yes**' if e['holds'] else 'no'}{' (' + e['note'] + ')' if e.get('note') else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--sync", type=Path, help="the sync presets' sweep directory (or its exported data)")
    parser.add_argument("--async", dest="asynchronous", type=Path, help="the async presets' (or their data)")
    parser.add_argument("--mismatch", type=Path, help="S2's sweep directory (or its data), when it ran")
    parser.add_argument(
        "--lr", type=Path, help="confirm-lr's sweep directory (or its data): the sensitivity table"
    )
    parser.add_argument("--output", type=Path, help="also write the tables to this Markdown file")
    parser.add_argument(
        "--export", nargs=2, type=Path, metavar=("SWEEP_DIR", "FILE"),
        help="write the sweep's per-cell data (docs/data/) to FILE as JSON, and nothing else",
    )  # fmt: skip
    arguments = parser.parse_args(argv)
    if arguments.export:
        sweep_dir, target = arguments.export
        if not sweep_dir.is_dir():
            parser.error(f"--export: {str(sweep_dir)!r} is not a directory")
        try:
            print(export(sweep_dir, target))
        except ValueError as error:
            parser.error(f"--export: {error}")
        return 0
    if arguments.sync is None or arguments.asynchronous is None:
        parser.error("--sync and --async are required (or --export SWEEP_DIR FILE)")
    for name in ("sync", "asynchronous", "mismatch", "lr"):
        path = getattr(arguments, name)
        if path is not None and not path.exists():
            parser.error(f"--{name.replace('asynchronous', 'async')}: {str(path)!r} does not exist")
    excluded: list[str] = []
    sync = load_outcomes(arguments.sync, excluded=excluded)
    asynchronous = load_outcomes(arguments.asynchronous, excluded=excluded)
    mismatch = load_outcomes(arguments.mismatch, excluded=excluded) if arguments.mismatch else None
    text = (
        "Primary family (Holm over H1–H4):\n\n" + markdown(primary_family(sync, asynchronous))
        + "\nSecondary family (Holm over its tests):\n\n" + markdown(secondary_family(sync, mismatch))
    )  # fmt: skip
    if arguments.lr:
        rows = lr_sensitivity(counted_records(arguments.lr, excluded=excluded))
        text += "\nSensitivity to the learning rate (descriptive, no test):\n\n" + lr_markdown(rows)
    left_out = "none" if not excluded else "\n" + "\n".join(f"- {line}" for line in excluded)
    text += f"\nRuns left out: {left_out}\n"
    print(text)
    if arguments.output:
        arguments.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
