"""Running a study's cells: one ``softtrust train`` process per cell, ``--jobs`` at a time, resumable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from softtrust._runfiles import atomic_write_json, read_json_object, remove_entries
from softtrust._runlock import LOCK_FILE, holding, lock_holder
from softtrust.train.checkpoint import has_complete_checkpoint
from softtrust.train.runlog import RUN_FILES

from .grid import Cell, Sweep
from .record import RUNTIME_SETTINGS, setting_differences, write_sweep_record
from .report import require_report_dependencies, write_report
from .runs import EXIT_BAD_CONFIG, EXIT_STOPPED

# Exit codes of one cell's process (``python -m softtrust.sweep CELL.yaml``); any other is a crash.


def cell_status(directory: Path, max_steps: int) -> str:
    """``done`` (summary.json for max_steps), ``stopped`` (exited on its own), ``partial`` or ``new``."""
    if (read_or_none(directory / "summary.json") or {}).get("steps") == max_steps:
        return "done"
    if (read_or_none(directory / "sweep-cell.json") or {}).get("returncode") == EXIT_STOPPED:
        return "stopped"
    return "partial" if directory.exists() else "new"


def read_or_none(path: Path) -> dict | None:
    """The JSON object in ``path``; None when absent or unreadable (a cell whose record is torn
    is not done: it resumes, and its run rewrites the file)."""
    try:
        return read_json_object(path)
    except ValueError:
        return None


# What a cell's directory may hold when its run stopped before its first complete checkpoint: the
# sweep removes these (and only these) to start the cell over. A finished run's ``summary.json``
# and ``final/`` are not among them, nor anything the sweep and the trainer do not write.
UNSTARTED_CELL_FILES = (
    *(name for name in RUN_FILES if name not in ("summary.json", "final")),
    "sweep-cell.yaml",
    "sweep-cell.json",
    "train.log",
)
# also left alone and never deleted: the lock file (deleting a held flock file lets a second
# process lock a fresh one), and atomic writes' temporaries of the files above cut by a kill


def _unstarted(name: str) -> bool:
    if name in UNSTARTED_CELL_FILES or name == LOCK_FILE:
        return True
    return name.endswith(".tmp") and any(name.startswith(f".{kept}.") for kept in UNSTARTED_CELL_FILES)


def check_cell_can_start(sweep: Sweep, cell: Cell) -> None:
    """Refuse, before any cell runs, a cell whose directory another live process holds (a cell
    left running by an earlier sweep that was killed), or one the sweep could only start over by
    deleting what it did not write or a finished run (no checkpoint to resume from)."""
    directory = cell.directory(sweep.output_dir)
    holder = lock_holder(directory)
    if holder is not None:
        raise ValueError(
            f"{cell.name}: its run directory {str(directory)!r} is in use by {holder} (a cell of an earlier "
            "sweep still running?); wait for it to finish or stop it, then run the sweep again"
        )
    if not directory.exists() or has_complete_checkpoint(directory):
        return
    foreign = sorted(entry.name for entry in directory.iterdir() if not _unstarted(entry.name))
    if foreign:
        raise ValueError(
            f"{cell.name}: {str(directory)!r} has no checkpoint to resume from, so the sweep would start it over, "
            f"but it holds {', '.join(foreign)} (a finished run's results, or files the sweep did not write), "
            "which it does not delete; move them away, or use another --output-dir"
        )


def start_cell(sweep: Sweep, cell: Cell) -> subprocess.Popen:
    """Launch one ``softtrust train`` process for ``cell``: it resumes the cell's run from its last
    complete checkpoint; a cell without one starts over, in a directory the sweep clears of its own
    and the trainer's files (``UNSTARTED_CELL_FILES``; ``check_cell_can_start`` refused anything else)."""
    directory = cell.directory(sweep.output_dir)
    config = sweep.cell_config(cell)
    if has_complete_checkpoint(directory):
        config = config.replace(resume=str(directory))
    elif directory.exists():  # interrupted before its first complete checkpoint
        check_cell_can_start(sweep, cell)  # again: a queued cell waited, an orphan may have woken up
        ours = [
            entry.name for entry in directory.iterdir() if entry.name != LOCK_FILE and _unstarted(entry.name)
        ]
        remove_entries(directory, ours)  # never the lock file: deleting a held one lets a second process lock
    directory.mkdir(parents=True, exist_ok=True)
    request = directory / "sweep-cell.yaml"
    request.write_text(config.to_yaml())
    (directory / "sweep-cell.json").unlink(missing_ok=True)
    log = open(directory / "train.log", "a")  # noqa: SIM115 (closed when the process ends)
    process = subprocess.Popen(
        [sys.executable, "-m", "softtrust.study.cell", str(request)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    process.log = log  # type: ignore[attr-defined]
    return process


# Fields that may differ between a cell's saved config and a rerun without changing its result:
# how it runs, and max_steps (a longer run resumes the cell from its checkpoint).
SETTINGS_THAT_DO_NOT_MATTER = (*RUNTIME_SETTINGS, "max_steps")


def check_same_settings(sweep: Sweep, cell: Cell) -> None:
    """Refuse to mix results: a cell already run with other settings fails the sweep by name."""
    saved = cell.directory(sweep.output_dir) / "config.yaml"
    if not saved.is_file():
        return
    changed = setting_differences(saved, sweep.cell_config(cell), SETTINGS_THAT_DO_NOT_MATTER)
    if changed:
        details = ", ".join(f"{key}: {before!r} -> {now!r}" for key, before, now in changed)
        raise ValueError(
            f"{cell.name} in {sweep.output_dir} was run with other settings ({details}); "
            "use another --output-dir or the same settings"
        )


def run_sweep(sweep: Sweep) -> dict:
    """Run every cell that is not done yet, then write the report. Returns the report plus
    ``ran`` / ``skipped`` (cell names) and ``failed`` (cells that crashed). One live sweep per
    directory (``_runlock``: a second is refused; a killed one's lock is taken over)."""
    sweep.validate()
    require_report_dependencies()  # the report at the end needs scipy: refused before any cell runs
    sweep.output_dir.mkdir(parents=True, exist_ok=True)
    with holding(sweep.output_dir, "output_dir", "softtrust sweep"):
        return run_locked_sweep(sweep)


def run_locked_sweep(sweep: Sweep) -> dict:
    """``run_sweep`` once the sweep directory is this process's."""
    max_steps = sweep.max_steps
    write_sweep_record(sweep)
    for n in sweep.staleness:
        if sweep.mode == "sync" and max_steps % n:
            print(
                f"softtrust sweep: note: max_steps={max_steps} is not a multiple of N={n}; "
                "the last rollout is only partly used",
                file=sys.stderr,
            )
    cells = sweep.cells()
    for cell in cells:
        check_same_settings(sweep, cell)
    todo = [
        c for c in cells if cell_status(c.directory(sweep.output_dir), max_steps) not in ("done", "stopped")
    ]
    for cell in todo:
        check_cell_can_start(sweep, cell)
    skipped = [c.name for c in cells if c not in todo]
    started = time.time()
    ran, failed = execute(sweep, todo, cells, started)
    report = write_report(sweep, wall_seconds=time.time() - started)
    return {**report, "ran": ran, "skipped": skipped, "failed": failed}


def steps_done(sweep: Sweep, cells: list[Cell]) -> int:
    """The optimizer steps done over ``cells``, for the sweep's progress: ``max_steps`` for a cell
    that is done or stopped itself, else the lines of its ``metrics.jsonl`` (one per step,
    written as the cell trains; at most ``max_steps``), 0 for a cell not started."""
    max_steps, total = sweep.max_steps, 0
    for cell in cells:
        directory = cell.directory(sweep.output_dir)
        if cell_status(directory, max_steps) in ("done", "stopped"):
            total += max_steps
        elif (directory / "metrics.jsonl").is_file():
            with open(directory / "metrics.jsonl", "rb") as handle:
                total += min(sum(1 for _ in handle), max_steps)
    return total


def execute(sweep: Sweep, todo: list[Cell], cells: list[Cell], started: float):
    """Run ``todo`` (of the grid's ``cells``) with at most ``sweep.jobs`` processes at once, under
    one progress bar counting the optimizer steps of every cell (done and running ones, from their
    ``metrics.jsonl``): a cell of 128 steps takes minutes, so counting cells sat at 0 meanwhile."""
    from tqdm.auto import tqdm

    ran, failed, running = [], [], {}
    queue, finished_cells = list(todo), len(cells) - len(todo)
    bar = tqdm(
        total=len(cells) * sweep.max_steps,
        initial=steps_done(sweep, cells),
        desc="sweep",
        unit="step",
        disable=not sweep.progress,
        dynamic_ncols=True,
        mininterval=1.0,
    )
    previous_handlers = stop_on_sigterm()
    last_refresh, refresh_every = 0.0, 1.0 if sys.stderr.isatty() else 60.0
    try:
        while queue or running:
            while queue and len(running) < sweep.jobs:
                cell = queue.pop(0)
                running[cell] = (start_cell(sweep, cell), time.time())
            finished = [cell for cell, (process, _) in running.items() if process.poll() is not None]
            for cell in finished:
                record = record_cell(sweep, cell, *running.pop(cell))
                ran.append(cell.name)
                if record["returncode"] == EXIT_BAD_CONFIG:
                    raise ValueError(f"{cell.name}: bad configuration; see {record['directory']}/train.log")
                if record["returncode"] not in (0, EXIT_STOPPED):
                    failed.append(cell.name)
                bar.write(cell_line(cell, Path(record["directory"]), record))
                finished_cells += 1
            now = time.time()
            if finished or now - last_refresh >= refresh_every:  # steps move inside the running cells
                bar.n = steps_done(sweep, cells)
                bar.set_postfix(
                    cells=f"{finished_cells}/{len(cells)}",
                    running=len(running),
                    failed=len(failed),
                    elapsed=f"{now - started:.0f}s",
                )
                last_refresh = now
            if running:
                time.sleep(0.2)
    finally:
        for process, _ in running.values():  # interrupted: stop the children we started
            process.terminate()
            process.wait()
            process.log.close()
        bar.close()
        restore_signals(previous_handlers)
    return ran, failed


def record_cell(sweep: Sweep, cell: Cell, process: subprocess.Popen, started: float) -> dict:
    """A cell's process has ended: its record (exit code, seconds) in ``sweep-cell.json`` and
    a line of ``sweep-log.jsonl``."""
    process.log.close()
    directory = cell.directory(sweep.output_dir)
    record = {
        "cell": cell.name,
        "directory": str(directory),
        "returncode": process.returncode,
        "seconds": time.time() - started,
        "finished": time.time(),
    }
    atomic_write_json(directory / "sweep-cell.json", record)
    with open(sweep.output_dir / "sweep-log.jsonl", "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return record


def stop_on_sigterm() -> dict:
    """``kill PID`` (SIGTERM) stops the sweep like Ctrl-C: its running cells are terminated
    too (they resume from their last checkpoint next time)."""
    import signal
    import threading

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background with '&'
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, handler)
    return previous


def restore_signals(previous: dict) -> None:
    import signal

    for signum, handler in previous.items():
        signal.signal(signum, handler)


def cell_line(cell: Cell, directory: Path, record: dict) -> str:
    summary_path = directory / "summary.json"
    if record["returncode"] == 0 and summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        outcome = f"accuracy {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}"
    elif record["returncode"] == EXIT_STOPPED:
        outcome = "stopped (non-finite updates)"
    else:
        outcome = f"failed (exit {record['returncode']}; see {directory / 'train.log'})"
    return f"{cell.name}: {outcome} in {record['seconds']:.0f} s"
