"""Atomic writes (``softtrust._runfiles``): a run's files, a sweep's record and the exported data
are written through ``mkstemp`` and a rename. The temporary is 0600, and the rename kept that:
every file a run wrote was private to its user, where a plain write gives the umask's mode."""

from __future__ import annotations

import os
import stat

from softtrust._runfiles import PLAIN_FILE_MODE, atomic_write_json, atomic_write_text


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_atomic_write_gives_the_mode_of_a_plain_write(tmp_path):
    (tmp_path / "plain.txt").write_text("x")
    atomic_write_text(tmp_path / "new.txt", "x")
    atomic_write_json(tmp_path / "new.json", {"a": 1})
    assert mode(tmp_path / "new.txt") == mode(tmp_path / "new.json") == mode(tmp_path / "plain.txt")
    umask = os.umask(0)
    os.umask(umask)
    assert 0o666 & ~umask == PLAIN_FILE_MODE
    (tmp_path / "kept.txt").write_text("old")  # a rewrite replaces the file: content and mode
    os.chmod(tmp_path / "kept.txt", 0o600)
    atomic_write_text(tmp_path / "kept.txt", "new")
    assert (tmp_path / "kept.txt").read_text() == "new" and mode(tmp_path / "kept.txt") == PLAIN_FILE_MODE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "new.json", "new.txt", "plain.txt"]
