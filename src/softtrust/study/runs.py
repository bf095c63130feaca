"""Reading a study's run directories into raw run records (the analysis's input)."""

from __future__ import annotations

from pathlib import Path

from softtrust._runfiles import jsonl_records, read_json_object

from .grid import Cell, Sweep

# Exit codes of one cell's process (``python -m softtrust.study.cell CELL.yaml``); any other is a crash.
EXIT_BAD_CONFIG = 2
EXIT_STOPPED = 3  # the trainer stopped itself (too many non-finite updates): a collapse, not a crash

# The per-step diagnostics the lag view reads from ``metrics.jsonl`` (absent ones are skipped):
# the loss's metrics (``loss/<name>``, see ``softtrust.metrics``) and the learner's KL to the
# behaviour policy. ``lag``: learner step minus the version of the weights that sampled the rows.
DIAGNOSTICS = (
    "loss/phi/mean",
    "loss/ess",
    "loss/clip/low",
    "loss/clip/high",
    "loss/ratio/mean",
    "loss/seq_log_weight/mean",
    "loss/is_weight/mean",  # the behaviour correction's weight (train/inference mismatch)
    "kl_behaviour",
)


def step_lag(record: dict, staleness: int | None) -> int | None:
    """The lag of one ``metrics.jsonl`` line: its ``lag``; else its position in the rollout
    (``rollout/minibatch``); else, in sync mode, ``(step − 1) mod N`` (step s ≥ 1 trains on
    mini-batch ``(s − 1) mod N`` of a rollout sampled by the weights of step ``s − 1 − that``)."""
    if "lag" in record:
        return int(record["lag"])
    if "rollout/minibatch" in record:
        return int(record["rollout/minibatch"])
    if staleness:
        return (int(record["step"]) - 1) % staleness
    return None


def load_run(directory: Path, staleness: int | None = None) -> dict | None:
    """The raw record of one run directory (None if it never logged anything).

    ``{"run_dir", "summary", "returncode", "rewards", "accuracies", "nonfinite_steps",
    "diagnostics", "provenance", "timing"}``: the summary (None until the run finished), the cell
    process's exit code (from ``sweep-cell.json``; None if not recorded), the per-step
    rewards and the held-out accuracies as ``[(step, value)]``, the steps whose update was
    skipped as non-finite, one ``{"step", "lag", <DIAGNOSTICS>}`` per step (``step_lag``;
    ``staleness``: the sync N, to derive the lag of runs that did not log it), and the code
    that made the run (``run_provenance``, ``softtrust._provenance``; None if not recorded),
    and the step timing (:func:`step_timing`).
    """
    directory = Path(directory)
    metrics = checked_lines(directory / "metrics.jsonl", ("reward/mean",))
    events = checked_lines(directory / "events.jsonl", ())
    summary = checked_summary(directory / "summary.json")
    evaluations = {}
    for record in events + metrics:
        if "eval/accuracy" in record:
            evaluations[int(record["step"])] = float(record["eval/accuracy"])
    if not metrics and not evaluations:
        return None
    cell = read_json_object(directory / "sweep-cell.json") or {}
    returncode = cell.get("returncode")
    if returncode is not None and not is_integer(returncode):
        raise ValueError(
            f"{directory / 'sweep-cell.json'}: 'returncode' is {returncode!r}; expected the cell's exit code"
        )
    return {
        "run_dir": str(directory),
        "summary": summary,
        "returncode": returncode,
        "rewards": [(int(r["step"]), float(r["reward/mean"])) for r in metrics],
        "accuracies": sorted(evaluations.items()),
        "nonfinite_steps": [int(r["step"]) for r in metrics if r.get("skipped")],
        "diagnostics": [
            {
                "step": int(r["step"]),
                "lag": step_lag(r, staleness),
                **{k: float(r[k]) for k in DIAGNOSTICS if isinstance(r.get(k), (int, float))},
            }
            for r in metrics
        ],
        "provenance": run_provenance(summary, events),
        "timing": step_timing(metrics),
    }


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_lines(path: Path, required: tuple[str, ...]) -> list[dict]:
    """The records of a run's JSONL file as the report reads them: each line a JSON object; a
    number under each of ``required`` and under ``eval/accuracy`` where present, and then an
    integer ``step`` >= 0 (events without one, e.g. the warm start's, are kept as they are);
    anything else (and a line that is not JSON, but for a torn last line) is a ``ValueError``
    naming the file, the line and the field (``_runfiles.jsonl_records``)."""
    records = []
    for number, record in jsonl_records(path, strict=True):
        where = f"{path}, line {number}"
        read = (*required, *(("eval/accuracy",) if "eval/accuracy" in record else ()))
        step = record.get("step")
        if read and not (is_integer(step) and step >= 0):
            found = "missing" if "step" not in record else repr(step)
            raise ValueError(f"{where}: 'step' is {found}; expected an integer >= 0")
        for key in read:
            if not is_number(record.get(key)):
                found = "missing" if key not in record else repr(record[key])
                raise ValueError(f"{where}: {key!r} is {found}; expected a number")
        records.append(record)
    return records


SUMMARY_NUMBERS = ("accuracy_before", "accuracy_after")


def checked_summary(path: Path) -> dict | None:
    """A finished run's ``summary.json`` (None if absent): an object with an integer ``steps``
    and numbers under ``SUMMARY_NUMBERS``, else a ``ValueError`` naming the file and the field."""
    summary = read_json_object(path)
    if summary is None:
        return None
    if not is_integer(summary.get("steps")):
        raise ValueError(f"{path}: 'steps' is {summary.get('steps', 'missing')!r}; expected an integer")
    for key in SUMMARY_NUMBERS:
        if not is_number(summary.get(key)):
            raise ValueError(f"{path}: {key!r} is {summary.get(key, 'missing')!r}; expected a number")
    if not isinstance(summary.get("provenance", {}), (dict, type(None))):
        raise ValueError(f"{path}: 'provenance' is {summary['provenance']!r}; expected an object")
    return summary


def run_provenance(summary: dict | None, events: list[dict]) -> dict | None:
    """The code that made a run: its summary's ``provenance``, else (a run that stopped itself,
    with no summary) that of its stop event (``RunLog.log_stop``); None when neither recorded it."""
    if summary is not None and summary.get("provenance") is not None:
        return summary["provenance"]
    stops = [event["provenance"] for event in events if isinstance(event.get("provenance"), dict)]
    return stops[-1] if stops else None


def step_timing(metrics: list[dict]) -> dict:
    """Sums over the logged steps of where the learner's time went (``metrics.jsonl``).

    ``{"steps", "seconds"}``: the steps and their wall seconds (collect + update; evaluations
    and checkpoints excluded); ``"wait"``: ``seconds/collect``, the learner waiting for its
    mini-batch; ``"sample"``: ``seconds/sample``, the producer's time for the rollouts that
    arrived (None for runs that did not log it).
    """

    def total(key: str) -> float | None:
        values = [float(r[key]) for r in metrics if isinstance(r.get(key), (int, float))]
        return sum(values) if values else None

    return {
        "steps": len(metrics),
        "seconds": total("seconds"),
        "wait": total("seconds/collect"),
        "sample": total("seconds/sample"),
    }


def load_runs(sweep: Sweep) -> dict[Cell, dict]:
    """The raw record of every cell of ``sweep`` that has started."""
    runs = {}
    for cell in sweep.cells():
        run = load_run(cell.directory(sweep.output_dir), cell.staleness if sweep.mode == "sync" else None)
        if run is not None:
            runs[cell] = run
    return runs
