"""Files of run and sweep directories: atomic writes, tolerant JSONL reading, curve smoothing.

One place for each: the trainer's run directory (``train/runlog.py``), its checkpoints and
the study (``study/``) all write and read through these.
"""

from __future__ import annotations

import json
import os
import shutil
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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# The mode ``open()`` gives a new file (0644 under the usual umask). ``mkstemp``'s temporaries are
# 0600 and a rename keeps that, so a file written atomically is given this mode before the
# rename. The umask is read once, at import, while nothing else runs.
PLAIN_FILE_MODE = 0o666 & ~_umask()


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, ``fsync`` and ``os.replace``:
    a reader sees the old content or the new, never a torn file. The file gets the mode a plain
    write would give it (``PLAIN_FILE_MODE``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(temporary, PLAIN_FILE_MODE)
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


def remove_entries(directory: Path, names) -> None:
    """Delete ``directory/name`` for each of ``names`` that exists (a file, or a directory with
    its content): the files a run left that a new run there replaces."""
    for name in names:
        path = Path(directory) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def read_text_file(path: Path) -> str:
    """The text of ``path``; a ``ValueError`` naming it when it cannot be read (a directory,
    no permission, bytes that are not UTF-8)."""
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise ValueError(f"{path}: cannot be read ({reason})") from error


def jsonl_records(path: Path, strict: bool = False) -> list[tuple[int, dict]]:
    """``(line number, record)`` for each JSON object of a JSONL file (1-based; blank lines
    skipped); ``[]`` if absent. Tolerant (``strict=False``): any line that is not a JSON object
    is skipped. Strict: only a torn last line (no newline after it: a write cut by a kill) is
    skipped; any other line that is not valid JSON or not an object is a ``ValueError`` naming
    the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    text = read_text_file(path) if strict else path.read_text(errors="replace")
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            torn = number == len(lines) and not text.endswith("\n")
            if strict and not torn:
                raise ValueError(f"{path}, line {number}: not valid JSON ({error.msg})") from error
            continue
        if isinstance(record, dict):
            records.append((number, record))
        elif strict:
            raise ValueError(
                f"{path}, line {number}: expected a JSON object, got {type(record).__name__} {line.strip()[:40]!r}"
            )
    return records


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, skipping blank lines and a line cut by an interruption
    (only a torn *last* line is expected; any unreadable line is skipped). ``[]`` if absent.
    ``jsonl_records(path, strict=True)`` refuses unreadable lines instead, naming them."""
    return [record for _, record in jsonl_records(path)]


def read_json_object(path: Path) -> dict | None:
    """The JSON object in ``path`` (None if absent); a ``ValueError`` naming the file (and the
    line) when it is not valid JSON or holds something other than an object."""
    path = Path(path)
    if not path.exists():
        return None
    text = read_text_file(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}, line {error.lineno}: not valid JSON ({error.msg})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__} {text.strip()[:40]!r}")
    return value


def trailing_mean(values: list[float], window: int) -> list[float]:
    """``out[i]`` = mean of ``values[max(0, i - window + 1) : i + 1]`` (a plot's smoothed curve)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out
