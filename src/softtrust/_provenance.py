"""Which code produced a run: the git commit (and whether the tree was dirty) and the package versions.

A run records ``provenance()`` in its ``summary.json``; the study's report compares these
records and refuses to pair runs made by different code (``softtrust.study.analysis``),
since a change of float path alone moves single runs by several points (docs/results.md).
"""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

# The packages whose version can change a run's numbers (trl only when installed).
PACKAGES = ("softtrust", "torch", "transformers", "trl")


def _git(*arguments: str, cwd: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", *arguments], cwd=cwd, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def provenance(source: Path | None = None) -> dict:
    """``{"git_commit", "git_dirty", "versions": {package: version}}`` of the running code.

    ``source``: a directory inside the git checkout softtrust runs from (default: this
    package's own directory). ``git_commit`` is None when softtrust is not run from a git
    checkout (an installed wheel); ``git_dirty`` is True when tracked files differ from
    the commit (None without git). ``versions`` holds each of ``PACKAGES`` that is installed.
    """
    source = Path(source) if source is not None else Path(__file__).resolve().parent
    commit = _git("rev-parse", "HEAD", cwd=source)
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=source) if commit else None
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "versions": versions,
    }
