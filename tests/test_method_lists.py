"""The docs' method lists against the registry (scripts/method_lists.py): none may drift.

README.md and docs/verl.md hold lists written from ``softtrust.METHODS``; docs/methods.md's
summary table and verl.md's mapping table are written by hand and checked here.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

import softtrust as st

ROOT = Path(__file__).resolve().parents[1]


def load_method_lists():
    spec = importlib.util.spec_from_file_location("method_lists", ROOT / "scripts" / "method_lists.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


method_lists = load_method_lists()


def test_every_method_list_of_the_docs_matches_the_registry():
    """Fails when a method is added or renamed without `python scripts/method_lists.py` (README,
    verl.md) or without its row in docs/methods.md, naming the file."""
    assert method_lists.problems() == []


@pytest.mark.parametrize("path", method_lists.GENERATED)
def test_each_generated_list_names_every_registered_method_once(path):
    """Read back from the text (not re-rendered): guards the generator itself, e.g. one that skips
    a name or spells a loss mode wrong."""
    lists = method_lists.listed((ROOT / path).read_text())
    assert lists, path
    for kind, names in lists.items():
        assert names == sorted(st.METHODS), (path, kind)


def test_verl_md_lists_exactly_the_loss_modes_the_plugin_registers():
    """verl.md's two lists against what the plugin registers in verl (not only the registry):
    fails if the plugin skips a method or names one differently."""
    pytest.importorskip("verl")
    from softtrust.integrations import verl as st_verl

    lists = method_lists.listed((ROOT / "docs" / "verl.md").read_text())
    expected = [name.removeprefix(st_verl.PREFIX) for name in st_verl.REGISTERED]
    assert lists["loss-modes"] == lists["loss-modes-printed"] == expected


def test_methods_md_summary_table_has_one_row_per_registered_method_naming_its_class():
    """The hand-written table: a method without a row, a row without a method, or a row naming
    another class (a rename) fails."""
    rows = method_lists.summary_rows((ROOT / "docs" / "methods.md").read_text())
    assert sorted(rows) == sorted(st.METHODS)
    for name, signature in rows.items():
        assert signature.startswith(st.METHODS[name].__name__ + "("), name


def test_the_check_reports_a_stale_list_a_missing_row_and_an_unknown_loss_mode(tmp_path):
    """The check can fail: a generated list missing a name, a summary row removed and a mapping
    row naming an unregistered mode are each reported; rewriting fixes the generated lists."""
    for path in (*method_lists.GENERATED, method_lists.SUMMARY):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    readme = tmp_path / "README.md"
    readme.write_text(method_lists.render(readme.read_text(), sorted(st.METHODS)[1:]))
    summary = tmp_path / method_lists.SUMMARY
    summary.write_text(summary.read_text().replace("| `topr` |", "| `tapr` |"))
    verl = tmp_path / method_lists.VERL
    verl.write_text(verl.read_text().replace("| `gpg` | `softtrust.reinforce`", "| `gpg` | `softtrust.gpg`"))
    found = method_lists.problems(tmp_path)
    assert len(found) == 3, found
    assert found[0].startswith("README.md: a generated method list is stale")
    assert "lacks ['topr'] and names unregistered ['tapr']" in found[1]
    assert "row of 'tapr'" not in " ".join(found)  # an unregistered row is reported once
    assert "unregistered loss modes ['gpg']" in found[2]
    assert method_lists.main(["--root", str(tmp_path)]) == 1  # rewrites README; the hand tables still fail
    assert len(method_lists.problems(tmp_path)) == 2
