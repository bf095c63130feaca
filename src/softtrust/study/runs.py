"""Reading a study's run directories into raw run records (the analysis's input)."""

from __future__ import annotations

import json
from pathlib import Path

from softtrust._runfiles import read_jsonl

from .grid import Cell, Sweep

# Exit codes of one cell's process (``python -m softtrust.study.cell CELL.yaml``); any other is a crash.
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 3  # the trainer stopped itself (too many non-finite updates): a collapse, not a crash


def load_run(directory: Path) -> dict | None:
    """The raw record of one run directory (None if it never logged anything).

    ``{"run_dir", "summary", "returncode", "rewards", "accuracies", "nonfinite_steps"}``:
    the summary (None until the run finished), the cell process's exit code (from
    ``sweep-cell.json``; None if not recorded), the per-step rewards and the held-out
    accuracies as ``[(step, value)]``, and the steps whose update was skipped as non-finite.
    """
    directory = Path(directory)
    metrics = read_jsonl(directory / "metrics.jsonl")
    events = read_jsonl(directory / "events.jsonl")
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    evaluations = {}
    for record in events + metrics:
        if "eval/accuracy" in record:
            evaluations[int(record["step"])] = float(record["eval/accuracy"])
    if not metrics and not evaluations:
        return None
    record_path = directory / "sweep-cell.json"
    returncode = json.loads(record_path.read_text()).get("returncode") if record_path.is_file() else None
    return {
        "run_dir": str(directory),
        "summary": summary,
        "returncode": returncode,
        "rewards": [(int(r["step"]), float(r["reward/mean"])) for r in metrics],
        "accuracies": sorted(evaluations.items()),
        "nonfinite_steps": [int(r["step"]) for r in metrics if r.get("skipped")],
    }


def load_runs(sweep: Sweep) -> dict[Cell, dict]:
    """The raw record of every cell of ``sweep`` that has started."""
    runs = {}
    for cell in sweep.cells():
        run = load_run(cell.directory(sweep.output_dir))
        if run is not None:
            runs[cell] = run
    return runs
