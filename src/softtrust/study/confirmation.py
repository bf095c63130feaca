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
        [--mismatch sweeps/confirm-mismatch] [--output docs/confirmation.md]
"""

from __future__ import annotations

import argparse
import math
import subprocess
from pathlib import Path

from .analysis import CollapseCriterion, run_outcome
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


def registered_values(outcome: dict) -> dict:
    """``{"final", "area", "failed"}`` of one run (``analysis.run_outcome``) under the registration:
    a completed run's measured values; a stopped run's registered ones (``analysis.STOPPED_ACCURACY``
    final, ``analysis.stopped_area``), which ``run_outcome`` already gives; ``failed``: stopped or
    collapsed (the comparison then takes the sign test). None values: no value (unfinished)."""
    failed = outcome["status"] == "stopped" or bool(outcome["collapsed"])
    return {"final": outcome["final_accuracy"], "area": outcome["auc_accuracy"], "failed": failed}


REGISTRATION = "e767df9"  # the commit of docs/preregistration.md: every counted cell descends from it
SEEDS = tuple(range(5, 15))  # the registered seeds


def load_outcomes(
    sweep_dir: Path,
    max_steps: int = MAX_STEPS,
    registration: str | None = REGISTRATION,
    excluded: list[str] | None = None,
) -> dict[Key, dict]:
    """Every run under ``sweep_dir/runs/<slug>/<N|K><value>/seed<s>`` of a registered seed whose
    recorded commit descends from ``registration`` (None: no check), as registered values.
    ``excluded`` receives a line for every run left out (another seed, another commit, no record
    of its code, a commit git cannot check)."""
    values, criterion = {}, CollapseCriterion()
    excluded = [] if excluded is None else excluded
    for seed_dir in sorted(Path(sweep_dir).glob("runs/*/*/seed*")):
        run = load_run(seed_dir)
        if run is None:
            continue
        slug, axis_dir = seed_dir.parent.parent.name, seed_dir.parent.name
        key = (slug, int(axis_dir.lstrip("NK").split("-")[0]), int(seed_dir.name.removeprefix("seed")))
        reason = f"seed {key[2]} is not a registered seed" if key[2] not in SEEDS else None
        if reason is None and registration is not None:
            reason = lineage_problem(run.get("provenance"), registration)
        if reason is not None:
            excluded.append(f"{seed_dir}: {reason}")
            continue
        values[key] = registered_values(run_outcome(run, max_steps, criterion))
    return values


def lineage_problem(provenance: dict | None, registration: str) -> str | None:
    """Why a run whose ``provenance`` this is may not count (its commit does not descend from
    ``registration``: ``git merge-base --is-ancestor``), or None when it may."""
    commit = (provenance or {}).get("git_commit")
    if not commit:
        return "no recorded commit"
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
        spread = "—" if e["std"] is None else f"{100 * e['std']:.1f}"
        mean = "—" if e["mean"] is None else f"{100 * e['mean']:+.1f} ± {spread}"
        lines.append(
            f"| {e['name']} | {e['claim']} | {e['measure']} | {mean} (n = {e['n']}) | {e['positive']} / "
            f"{e['negative']} | {e['test']} | {e['p']:.4f} | {e['p_holm']:.4f} | "
            f"{'**yes**' if e['holds'] else 'no'}{' (' + e['note'] + ')' if e.get('note') else ''} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--sync", required=True, type=Path, help="the sync presets' sweep directory")
    parser.add_argument("--async", dest="asynchronous", required=True, type=Path, help="the async presets'")
    parser.add_argument("--mismatch", type=Path, help="S2's sweep directory, when it ran")
    parser.add_argument("--output", type=Path, help="also write the tables to this Markdown file")
    arguments = parser.parse_args(argv)
    for name in ("sync", "asynchronous", "mismatch"):
        path = getattr(arguments, name)
        if path is not None and not path.is_dir():
            parser.error(f"--{name.replace('asynchronous', 'async')}: {str(path)!r} is not a directory")
    excluded: list[str] = []
    sync = load_outcomes(arguments.sync, excluded=excluded)
    asynchronous = load_outcomes(arguments.asynchronous, excluded=excluded)
    mismatch = load_outcomes(arguments.mismatch, excluded=excluded) if arguments.mismatch else None
    left_out = "none" if not excluded else "\n" + "\n".join(f"- {line}" for line in excluded)
    text = (
        "Primary family (Holm over H1–H4):\n\n" + markdown(primary_family(sync, asynchronous))
        + "\nSecondary family (Holm over its tests):\n\n" + markdown(secondary_family(sync, mismatch))
        + f"\nRuns left out: {left_out}\n"
    )  # fmt: skip
    print(text)
    if arguments.output:
        arguments.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
