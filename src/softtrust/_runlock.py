"""One live owner per run or sweep directory: an advisory lock that a killed process cannot leave stuck.

``DirectoryLock(directory, what).acquire()`` takes ``fcntl.flock`` on ``DIRECTORY/.softtrust-lock``
and writes its owner (pid, host, start time, command) into it. The kernel drops a ``flock`` when
its process ends, however it ends, so a SIGKILLed owner leaves the file but not the lock: the
next process takes the lock, finds the dead owner's record (a clean ``release`` empties the file)
and says it took over. A second live process gets a ``ValueError`` naming the owner.

Within one process the lock is re-entrant (a count per directory), so a process that trains
twice into its own directory (a resume in the same Python session) is not refused by itself.
Where ``fcntl`` does not exist (Windows) nothing is locked.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Linux/macOS
    fcntl = None

LOCK_FILE = ".softtrust-lock"

# directory (resolved) -> [file descriptor, acquisitions] held by this process
_HELD: dict[str, list[int]] = {}


class DirectoryLock:
    """The lock of ``directory`` (which must exist); ``what`` names it in messages (``output_dir``)."""

    def __init__(self, directory: Path, what: str) -> None:
        self.directory = Path(directory)
        self.what = what
        self.key = str(self.directory.resolve())
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a one-line note when it was taken over from a dead owner (or when the
        filesystem cannot lock at all: then nothing is held), else None.

        Raises:
            ValueError: another live process holds it (naming the field, the directory and the owner).
        """
        if fcntl is None:
            return None
        if self.key in _HELD:
            _HELD[self.key][1] += 1
            self.held = True
            return None
        try:
            descriptor = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # another user's lock file, a read-only directory
            return self._unlocked(error)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe(_read(descriptor))
            os.close(descriptor)
            raise ValueError(
                f"{self.what}: {str(self.directory)!r} is in use by {owner}; wait for it to finish or stop it "
                "(one process at a time may write a run or sweep directory)"
            ) from None
        except OSError as error:  # a filesystem without flock (NFS without lockd, some FUSE mounts)
            os.close(descriptor)
            return self._unlocked(error)
        previous = _read(descriptor)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.time(),
            "command": sys.argv,
        }
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, json.dumps(record).encode(), 0)
        _HELD[self.key] = [descriptor, 1]
        self.held = True
        if previous:
            return (
                f"{self.what}: took over {str(self.directory)!r} from {_describe(previous)}, which ended without "
                "releasing it (stopped or killed)"
            )
        return None

    def _unlocked(self, error: OSError) -> str:
        """The note when the directory cannot be locked at all: the run goes on without the check."""
        return (
            f"{self.what}: could not lock {str(self.directory)!r} ({error.strerror or error}); going on "
            "without the one-writer check: make sure no other process writes this directory"
        )

    def release(self) -> None:
        """Give the lock back (empty the record, unlock); a no-op when not held by this object."""
        if not self.held:
            return
        self.held = False
        entry = _HELD.get(self.key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        descriptor = _HELD.pop(self.key)[0]
        try:
            os.ftruncate(descriptor, 0)
            fcntl.flock(descriptor, fcntl.LOCK_UN)
        finally:
            os.close(descriptor)


def lock_holder(directory: Path) -> str | None:
    """Who holds ``directory``'s lock, if another live process does (``"process 123 on host ..."``);
    None when it is free, held by this process, or absent. Takes nothing."""
    path = Path(directory) / LOCK_FILE
    if fcntl is None or not path.is_file() or str(Path(directory).resolve()) in _HELD:
        return None
    descriptor = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(_read(descriptor))
    else:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)


def _read(descriptor: int) -> dict:
    try:
        text = os.pread(descriptor, 65536, 0).decode()
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"pid": "?"}  # a record cut by a kill, or not ours: an owner all the same


def _describe(record: dict) -> str:
    started = record.get("started")
    when = (
        ""
        if not isinstance(started, (int, float))
        else time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started))
    )
    host = f" on {record['host']}" if record.get("host") else ""
    return f"process {record.get('pid', '?')}{host}{when}"


@contextlib.contextmanager
def holding(directory: Path, what: str, program: str):
    """Hold ``directory``'s lock for the block; a takeover note goes to stderr as
    ``{program}: warning: ...``. Raises the lock's ``ValueError`` when another process holds it."""
    lock = DirectoryLock(directory, what)
    note = lock.acquire()
    if note is not None:
        print(f"{program}: warning: {note}", file=sys.stderr, flush=True)
    try:
        yield lock
    finally:
        lock.release()
