"""docs/adding_a_method.md, walked end to end, so that the page cannot drift from the code.

The page's snippets (CFPO), renamed to a toy method ``toycfpo`` / ``ToyCFPO``, are added to
copies of the four files the page names; the page's step-5 commands then run on the copies in
a subprocess (the toy registered as the page says, by importing its module): the method lists
are regenerated and checked, and the registry-driven tests run filtered to the toy.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "adding_a_method.md").read_text()
#: what the walkthrough below edits, in the page's order
WALKED = (
    "src/softtrust/methods/<family>.py",
    "tests/expected_methods.py",
    "tests/test_methods.py",
    "docs/methods.md",
)


def toy(text: str) -> str:
    """The page's CFPO renamed: a second registration of the same formula under a new name."""
    return text.replace("CFPO", "ToyCFPO").replace("cfpo", "toycfpo")


def snippet(language: str, containing: str) -> str:
    """The page's one ``language`` code block that contains ``containing``."""
    blocks = [code for lang, code in re.findall(r"```(\w+)\n(.*?)```", DOC, flags=re.S) if lang == language]
    found = [code for code in blocks if containing in code]
    assert len(found) == 1, f"docs/adding_a_method.md needs one {language} block with {containing!r}"
    return found[0]


def test_the_page_lists_the_four_files_the_walkthrough_adds():
    section = DOC.split("## The four files", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\d+\. `([^`]+)`", section, flags=re.M)
    assert tuple(listed) == WALKED
    assert "that is the whole change" not in DOC.lower()


def family_module(tmp_path: Path) -> Path:
    """Step 1: the class in a module with the namespace of ``methods/trust_region.py``, and its ``__all__``."""
    code = textwrap.dedent(
        """\
        from softtrust.methods import trust_region as _family

        # the class goes in methods/trust_region.py: the names it uses are that module's
        globals().update({key: value for key, value in vars(_family).items() if not key.startswith("__")})

        """
    )
    package = tmp_path / "package"
    package.mkdir()
    module = package / "toy_family.py"
    module.write_text(code + toy(snippet("python", "@register_method")) + '\n__all__ = ["ToyCFPO"]\n')
    return package


def copied_repository(tmp_path: Path) -> Path:
    """Copies of what the step-5 commands read: the tests, the docs with method lists, the script."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__", "data"))
    for path in ("README.md", "docs/methods.md", "docs/verl.md", "scripts/method_lists.py", "pyproject.toml"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, root / path)
    return root


def add_the_other_three(root: Path) -> None:
    """Steps 2-4 on the copies: the expected formula, the facts, the summary row."""
    expected = root / "tests" / "expected_methods.py"
    text = expected.read_text()
    assert text.count("EXPECTED = {\n") == 1
    entry = toy(snippet("python", '"cfpo": lambda x')).strip()
    expected.write_text(text.replace("EXPECTED = {\n", f"EXPECTED = {{\n    {entry}\n"))
    facts = root / "tests" / "test_methods.py"
    facts.write_text(facts.read_text() + "\n\n" + toy(snippet("python", "def test_cfpo_")))
    summary = root / "docs" / "methods.md"
    head, rest = summary.read_text().split("## Summary", 1)
    separator = rest.index("| --- |")
    end_of_separator = rest.index("\n", separator) + 1
    row = toy(snippet("markdown", "| `cfpo` |")).strip()
    summary.write_text(head + "## Summary" + rest[:end_of_separator] + row + "\n" + rest[end_of_separator:])


def step_five(root: Path, package: Path) -> subprocess.CompletedProcess:
    """The page's step-5 commands, on the copies, in one process that imports the toy's module first."""
    commands = snippet("bash", "scripts/method_lists.py").strip().splitlines()
    assert commands[0] == "python scripts/method_lists.py"
    pytest_args = commands[1].split("-m pytest", 1)[1]
    files = re.findall(r"tests/\S+\.py", pytest_args)
    keyword = toy(re.search(r'-k "([^"]+)"', pytest_args).group(1))
    script = textwrap.dedent(
        f"""\
        import runpy, sys
        import toy_family  # registers ToyCFPO, as importing softtrust.methods would import its module
        sys.argv = ["method_lists.py"]
        try:
            runpy.run_path("scripts/method_lists.py", run_name="__main__")
        except SystemExit as done:
            if done.code:
                raise
        import pytest
        sys.exit(pytest.main([*{files!r}, "-q", "-p", "no:cacheprovider", "-k", {keyword!r}]))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )


def test_the_page_walked_end_to_end_registers_a_method_that_passes_its_tests(tmp_path):
    """Fails when a snippet no longer runs (a renamed helper, a missing import in the family
    module), when the snippet's class differs from the real CFPO, when a registry-driven test
    fails for a new method, or when the page's -k filter selects none of the toy's tests."""
    package = family_module(tmp_path)
    root = copied_repository(tmp_path)
    add_the_other_three(root)
    sys.path.insert(0, str(package))
    try:
        import softtrust as st

        module = __import__("toy_family")
        toy_class = module.ToyCFPO
        assert st.METHODS["toycfpo"] is toy_class
        for attribute in ("levels", "default_level", "level_note", "folds_correction", "supports_proximal"):
            assert getattr(toy_class, attribute) == getattr(st.CFPO, attribute), attribute
        batch = _batch()
        for level in st.CFPO.levels:
            assert st.PolicyLoss("toycfpo", level=level, eps=0.3)(*batch).loss.item() == pytest.approx(
                st.PolicyLoss("cfpo", level=level, eps=0.3)(*batch).loss.item(), rel=1e-12
            )
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("toy_family", None)
        st.METHODS.pop("toycfpo", None)
    done = step_five(root, package)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "rewrote the method lists of README.md" in output
    assert "`toycfpo`" in (root / "README.md").read_text()
    assert "`softtrust.toycfpo`" in (root / "docs" / "verl.md").read_text()
    passed = int(re.search(r"(\d+) passed", output).group(1))
    # 15 value/gradient cases (3 levels x 5 aggregations) + 3 compiled + 2 facts + the table
    # checks + test_loss's cases for the toy, far more than the real CFPO-free selection would give
    assert passed >= 200, output[-2000:]


def _batch():
    import torch

    gen = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(3, 5, generator=gen, dtype=torch.float64)
    old = logprobs + 0.3 * torch.randn(3, 5, generator=gen, dtype=torch.float64)
    return (
        logprobs,
        old,
        torch.randn(3, generator=gen, dtype=torch.float64),
        torch.rand(3, 5, generator=gen) < 0.8,
    )
