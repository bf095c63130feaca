"""One live process per run or sweep directory (issue 37's data-loss findings).

Each test puts two processes on one directory at once, or kills the owner and goes on: two
resumes of one run, two sweeps of one directory, a cell an earlier (killed) sweep left
running, a new run inside another run's directory, and a finished cell the sweep would have
deleted. Before the lock both resumes trained and one died with a traceback (metrics with
duplicated, non-monotone steps), and the sweep ``rmtree``-d a finished cell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from softtrust._runlock import LOCK_FILE, DirectoryLock, lock_holder
from softtrust.cli import main
from softtrust.train.options import load_resume_config
from softtrust.train.trainer import train
from test_train import micro_config, read_metrics, write_micro_model

TESTS = Path(__file__).resolve().parent

HOLD = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from softtrust._runlock import DirectoryLock\n"
    "DirectoryLock(Path(sys.argv[1]), 'output_dir').acquire()\n"
    "print('held', flush=True)\n"
    "time.sleep(300)\n"
)


@pytest.fixture(scope="module")
def micro_model_dir(tmp_path_factory) -> str:
    return write_micro_model(tmp_path_factory.mktemp("micro_model"))


def hold(directory: Path) -> subprocess.Popen:
    """Another process that takes ``directory``'s lock and keeps it (until killed)."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    return process


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_a_second_process_is_refused_and_a_killed_owners_lock_is_taken_over(tmp_path):
    owner = hold(tmp_path)
    try:
        assert f"process {owner.pid}" in lock_holder(tmp_path)
        with pytest.raises(ValueError, match=rf"output_dir: .* is in use by process {owner.pid} on "):
            DirectoryLock(tmp_path, "output_dir").acquire()
    finally:
        kill(owner)
    assert lock_holder(tmp_path) is None  # the kernel dropped the dead owner's lock
    lock = DirectoryLock(tmp_path, "output_dir")
    note = lock.acquire()
    assert note is not None and f"took over {str(tmp_path)!r} from process {owner.pid}" in note
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release leaves nothing to take over
    again = DirectoryLock(tmp_path, "output_dir")
    assert again.acquire() is None
    again.release()


def test_two_resumes_of_one_run_at_once_and_a_resume_after_killing_one(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, method="clip", max_steps=2, save_every=1))
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "softtrust", "train", "--resume", str(run), "--max-steps", "100000"]
    first = subprocess.Popen(
        command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 120
        while lock_holder(run) is None:  # the first resume has opened the run
            assert first.poll() is None, first.stderr.read()
            assert time.time() < deadline, "the first resume never took the run"
            time.sleep(0.05)
        with pytest.raises(ValueError, match=rf"output_dir: .* is in use by process {first.pid}"):
            train(load_resume_config({"resume": str(run), "max_steps": 4}))
        second = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr
        assert f"is in use by process {first.pid}" in second.stderr
        deadline = time.time() + 120
        while len(read_metrics(run)) < 4 and time.time() < deadline:  # let it write a few steps
            time.sleep(0.1)
    finally:
        kill(first)  # SIGKILL: no chance to release the lock
    steps_before = len(read_metrics(run))
    summary = train(load_resume_config({"resume": str(run), "max_steps": steps_before + 2}))
    assert summary["steps"] == steps_before + 2
    steps = [m["step"] for m in read_metrics(run)]
    assert steps == list(range(1, steps_before + 3))  # one writer: no duplicated or missing step
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert any(f"from process {first.pid}" in e.get("warning", "") for e in events)


def test_a_new_run_inside_another_runs_directory_is_refused(micro_model_dir, tmp_path):
    run = tmp_path / "run"
    train(micro_config(micro_model_dir, run, method="clip", max_steps=2, save_every=1))
    inside = run / "checkpoints" / "step-000001" / "new"
    with pytest.raises(ValueError, match=r"output_dir: .* lies inside the run directory"):
        train(micro_config(micro_model_dir, inside, method="clip", max_steps=1))
    assert not inside.exists()


# ---------------------------------------------------------------------- sweeps
def sweep_argv(model_dir: str, output: Path, max_steps: int) -> list[str]:
    return [
        "sweep", "--methods", "clip", "--staleness", "1", "--seeds", "1", "--output-dir", str(output),
        "--jobs", "1", "--no-progress", "--model", model_dir, "--dataset", str(Path(model_dir) / "sums.jsonl"),
        "--reward", "test_train:digit_reward", "--group-size", "4", "--prompts-per-step", "2",
        "--max-new-tokens", "3", "--max-steps", str(max_steps), "--eval-every", "0", "--eval-size", "8",
        "--lr", "1e-2", "--sft-steps", "0",
    ]  # fmt: skip


@pytest.fixture
def cells_can_import_the_reward(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SOFTTRUST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_a_second_sweep_into_a_running_sweeps_directory_is_refused(
    micro_model_dir, tmp_path, capsys, cells_can_import_the_reward
):
    output = tmp_path / "sweep"
    output.mkdir()
    owner = hold(output)  # a sweep running there
    try:
        assert main(sweep_argv(micro_model_dir, output, 2)) == 2
        assert main([*sweep_argv(micro_model_dir, output, 2), "--report-only"]) == 2
    finally:
        kill(owner)
    err = capsys.readouterr().err
    assert err.count(f"is in use by process {owner.pid}") == 2 and "Traceback" not in err
    assert not (output / "runs").exists()  # no cell started
    assert main(sweep_argv(micro_model_dir, output, 2)) == 0  # the killed sweep's lock is taken over
    assert f"took over {str(output)!r} from process {owner.pid}" in capsys.readouterr().err


def test_a_sweep_refuses_a_cell_still_trained_by_an_earlier_sweeps_orphan(
    micro_model_dir, tmp_path, capsys, cells_can_import_the_reward
):
    output = tmp_path / "sweep"
    assert main(sweep_argv(micro_model_dir, output, 2)) == 0
    cell = output / "runs" / "clip" / "N1" / "seed0"
    orphan = hold(cell)  # the killed sweep's cell process, still training
    try:
        assert main(sweep_argv(micro_model_dir, output, 4)) == 2
    finally:
        kill(orphan)
    err = capsys.readouterr().err
    assert f"clip N=1 seed=0: its run directory {str(cell)!r} is in use by process {orphan.pid}" in err
    assert [m["step"] for m in read_metrics(cell)] == [1, 2]  # untouched


def test_the_sweep_never_deletes_a_finished_cell_or_files_it_did_not_write(
    micro_model_dir, tmp_path, capsys, cells_can_import_the_reward
):
    output = tmp_path / "sweep"
    assert main(sweep_argv(micro_model_dir, output, 2)) == 0
    cell = output / "runs" / "clip" / "N1" / "seed0"
    shutil.rmtree(cell / "checkpoints")  # no checkpoint to resume from
    (cell / "my-notes.txt").write_text("mine")
    before = sorted(str(path.relative_to(cell)) for path in cell.rglob("*"))
    assert main(sweep_argv(micro_model_dir, output, 4)) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint to resume from" in err and "final, my-notes.txt, summary.json" in err
    assert sorted(str(path.relative_to(cell)) for path in cell.rglob("*")) == before
    assert (cell / "my-notes.txt").read_text() == "mine"


def test_a_filesystem_that_cannot_lock_runs_unlocked_with_a_note(tmp_path, monkeypatch):
    import errno

    import softtrust._runlock as runlock

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)
    lock = DirectoryLock(tmp_path, "output_dir")
    note = lock.acquire()
    assert "could not lock" in note and "No locks available" in note and not lock.held
    lock.release()  # nothing held: nothing to do


def test_a_run_that_fails_while_opening_its_directory_releases_it(micro_model_dir, tmp_path, monkeypatch):
    from softtrust.train import runlog

    def broken(path, text):
        raise OSError("disk full")

    monkeypatch.setattr(runlog, "atomic_write_text", broken)
    with pytest.raises(OSError, match="disk full"):
        train(micro_config(micro_model_dir, tmp_path / "run", method="clip", max_steps=1))
    monkeypatch.undo()
    assert lock_holder(tmp_path / "run") is None
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released, not left to a takeover


def test_a_project_folder_with_a_config_and_checkpoints_is_not_a_run(micro_model_dir, tmp_path):
    project = tmp_path / "project"
    (project / "checkpoints").mkdir(parents=True)
    (project / "config.yaml").write_text("model: bert\nlayers: 4\n")  # the project's own, not a run's
    (project / "metrics.jsonl").write_text("")
    summary = train(micro_config(micro_model_dir, project / "runs" / "new", method="clip", max_steps=1))
    assert summary["steps"] == 1


def test_the_sweep_checks_a_queued_cell_again_and_never_deletes_a_lock_file(
    micro_model_dir, tmp_path, cells_can_import_the_reward
):
    """A cell without a checkpoint is cleared of the sweep's own files only when it starts, after a
    second look: an orphan that took the cell meanwhile is refused, and the lock file (deleting a
    held one lets a second process lock a fresh file) and a write cut by a kill stay or go safely."""
    from softtrust.cli import build_parser
    from softtrust.study.cli import sweep_from_arguments
    from softtrust.study.runner import check_cell_can_start, start_cell

    output = tmp_path / "sweep"
    sweep = sweep_from_arguments(*build_parser().parse_known_args(sweep_argv(micro_model_dir, output, 2)))
    (cell,) = sweep.cells()
    directory = cell.directory(output)
    directory.mkdir(parents=True)
    (directory / "train.log").write_text("killed before its first checkpoint\n")
    (directory / ".metrics.jsonl.x1y2.tmp").write_text("cut")  # atomic_write_text's temporary
    check_cell_can_start(sweep, cell)  # only the sweep's and the trainer's files: may start over
    orphan = hold(directory)  # ... but an orphan takes the cell before its turn comes
    try:
        with pytest.raises(ValueError, match=rf"is in use by process {orphan.pid}"):
            start_cell(sweep, cell)
        assert (directory / "train.log").is_file()  # nothing cleared
    finally:
        kill(orphan)
    process = start_cell(sweep, cell)
    process.wait()
    process.log.close()
    assert (directory / LOCK_FILE).is_file() and not (directory / ".metrics.jsonl.x1y2.tmp").exists()


def holder_pid(directory: Path) -> int:
    """The pid of the live process holding ``directory``'s lock (``lock_holder``: "process 123 on ...")."""
    return int(re.match(r"process (\d+)", lock_holder(directory)).group(1))


def test_two_real_sweeps_at_once_then_a_killed_sweeps_orphaned_cell(micro_model_dir, tmp_path, capsys):
    """The attack round's sequence with real sweeps, not stand-in lock holders: a second sweep
    into a running sweep's directory is refused; after the first sweep is SIGKILLed its cell
    trains on (an orphan) and a restarted sweep refuses that cell; once the orphan is killed too,
    the next sweep resumes the cell from its checkpoint with one writer: steps 1..n, none twice."""
    output = tmp_path / "sweep"
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "SOFTTRUST_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }

    def sweep(max_steps: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "softtrust",
            *sweep_argv(micro_model_dir, output, max_steps),
            "--save-every",
            "1",
        ]

    cell = output / "runs" / "clip" / "N1" / "seed0"
    first = subprocess.Popen(
        sweep(100_000), env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    orphan = None
    try:
        deadline = time.time() + 180
        while lock_holder(cell) is None or not (cell / "checkpoints" / "latest").is_file():  # the cell trains
            assert first.poll() is None, first.stderr.read()
            assert time.time() < deadline, "the first sweep's cell never started"
            time.sleep(0.05)
        orphan = holder_pid(cell)
        second = subprocess.run(sweep(100_000), env=environment, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert f"is in use by process {first.pid}" in second.stderr
        kill(first)  # the sweep dies; its cell does not
        assert holder_pid(cell) == orphan
        third = subprocess.run(sweep(100_000), env=environment, capture_output=True, text=True, timeout=300)
        assert third.returncode == 2 and "Traceback" not in third.stderr, third.stderr
        assert f"its run directory {str(cell)!r} is in use by process {orphan}" in third.stderr
    finally:
        if first.poll() is None:
            kill(first)
        if orphan is not None:
            os.kill(orphan, signal.SIGKILL)
    deadline = time.time() + 60
    while lock_holder(cell) is not None and time.time() < deadline:  # the kernel drops the orphan's lock
        time.sleep(0.05)
    done = len(read_metrics(cell))
    last = subprocess.run(sweep(done + 2), env=environment, capture_output=True, text=True, timeout=600)
    assert last.returncode == 0, last.stderr
    assert [m["step"] for m in read_metrics(cell)] == list(range(1, done + 3))
