"""The method lists of README.md and docs/verl.md, written from the registry (``softtrust.METHODS``).

Usage:
    python scripts/method_lists.py            # rewrite the generated lists, then check every list
    python scripts/method_lists.py --check    # only check: exit 1, naming the file, if one is stale

A generated list sits between ``<!-- methods:KIND -->`` and ``<!-- /methods -->`` on one line
(in a sentence or a table cell); everything outside the markers is written by hand. KIND says
how the names are spelled (:data:`RENDER`). The hand-written tables that name methods one by
one are checked against the registry instead: the summary table of docs/methods.md (formula,
defaults, paper: it must have one row per registered method) and verl.md's mapping table
(every ``softtrust.<name>`` it names must be registered). ``tests/test_method_lists.py`` runs
the check on the repository; ``tests/test_adding_a_method.py`` runs it on copies with a new
method registered, as ``docs/adding_a_method.md`` describes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: files with generated lists
GENERATED = ("README.md", "docs/verl.md")
SUMMARY = "docs/methods.md"
VERL = "docs/verl.md"
BLOCK = re.compile(r"<!-- methods:(?P<kind>[\w-]+) -->(?P<body>.*?)<!-- /methods -->")
#: how each kind of list spells the (sorted) registry names
RENDER = {
    "names": lambda names: ", ".join(f"`{name}`" for name in names),
    "loss-modes": lambda names: ", ".join(f"`softtrust.{name}`" for name in names),
    # what `print(sorted(k for k in POLICY_LOSS_REGISTRY if k.startswith('softtrust.')))` prints
    "loss-modes-printed": lambda names: f"`{[f'softtrust.{name}' for name in names]}`",
}
_LOSS_MODE = re.compile(r"softtrust\.([a-z0-9][a-z0-9-]*)")


def registered() -> list[str]:
    """The registry's names, sorted: the order of every generated list."""
    import softtrust as st

    return sorted(st.METHODS)


def render(text: str, names: Iterable[str]) -> str:
    """``text`` with every generated list rewritten from ``names``."""
    names = sorted(names)

    def body(match: re.Match) -> str:
        kind = match["kind"]
        if kind not in RENDER:
            raise ValueError(f"unknown list kind {kind!r} (known: {sorted(RENDER)})")
        return f"<!-- methods:{kind} -->{RENDER[kind](names)}<!-- /methods -->"

    return BLOCK.sub(body, text)


def listed(text: str) -> dict[str, list[str]]:
    """The names each generated list of ``text`` holds, read back from the text: ``{kind: names}``."""
    lists: dict[str, list[str]] = {}
    for match in BLOCK.finditer(text):
        body = match["body"]
        names = (
            _LOSS_MODE.findall(body)
            if match["kind"].startswith("loss-modes")
            else re.findall(r"`([^`]+)`", body)
        )
        lists.setdefault(match["kind"], []).extend(names)
    return lists


def summary_rows(text: str) -> dict[str, str]:
    """docs/methods.md's summary table: registry name -> the class column (``Clip(eps_low, ...)``)."""
    section = text.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \|", section, flags=re.M)
    return dict(rows)


def mapping_modes(text: str) -> set[str]:
    """The ``softtrust.<name>`` loss modes named in verl.md's mapping table (its second column)."""
    section = text.split("verl's built-in loss modes and their softtrust spelling", 1)[1]
    table = section.split("\n\n", 2)[1]
    return {name for row in table.splitlines()[2:] for name in _LOSS_MODE.findall(row.split("|")[2])}


def problems(root: Path = ROOT, names: Iterable[str] | None = None) -> list[str]:
    """Every way the lists under ``root`` differ from ``names`` (default: the registry); empty when none."""
    import softtrust as st

    names = registered() if names is None else sorted(names)
    found = []
    for path in GENERATED:
        text = (root / path).read_text()
        if not BLOCK.search(text):
            found.append(f"{path}: no generated method list (<!-- methods:KIND --> ... <!-- /methods -->)")
        elif render(text, names) != text:
            found.append(f"{path}: a generated method list is stale: run `python scripts/method_lists.py`")
    rows = summary_rows((root / SUMMARY).read_text())
    if sorted(rows) != names:
        missing, extra = sorted(set(names) - set(rows)), sorted(set(rows) - set(names))
        found.append(f"{SUMMARY}: the summary table lacks {missing} and names unregistered {extra}")
    for name, signature in rows.items():
        cls = st.METHODS.get(name)
        if cls is not None and not signature.startswith(f"{cls.__name__}("):
            found.append(f"{SUMMARY}: the row of {name!r} gives {signature!r}, not class {cls.__name__}")
    stale = sorted(mapping_modes((root / VERL).read_text()) - set(names))
    if stale:
        found.append(f"{VERL}: the mapping table names unregistered loss modes {stale}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="only check; rewrite nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    if not args.check:
        for path in GENERATED:
            file = args.root / path
            text = file.read_text()
            if render(text, registered()) != text:
                file.write_text(render(text, registered()))
                print(f"rewrote the method lists of {path}")
    found = problems(args.root)
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
