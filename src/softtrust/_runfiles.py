"""Files of run and sweep directories: atomic writes, tolerant JSONL reading, curve smoothing.

One place for each: the trainer's run directory (``train/runlog.py``), its checkpoints and
the study (``study/``) all write and read through these.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def fsync_directory(path: Path) -> None:
    """Flush a directory entry (a rename into it) to disk; a no-op where that is unsupported."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, ``fsync`` and ``os.replace``:
    a reader sees the old content or the new, never a torn file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def atomic_write_json(path: Path, value, indent: int | None = 2) -> None:
    """``value`` as JSON (NaN allowed), written atomically."""
    atomic_write_text(path, json.dumps(value, indent=indent, allow_nan=True) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, skipping blank lines and a line cut by an interruption
    (only a torn *last* line is expected; any unreadable line is skipped). ``[]`` if absent."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def trailing_mean(values: list[float], window: int) -> list[float]:
    """``out[i]`` = mean of ``values[max(0, i - window + 1) : i + 1]`` (a plot's smoothed curve)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out
