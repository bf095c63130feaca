"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import softtrust as st

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart_code() -> str:
    text = README.read_text()
    section = text.split("## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match, "README's Quickstart has no python block"
    return match.group(1)


def test_readme_quickstart_runs_as_written(capsys):
    namespace: dict = {}
    exec(compile(quickstart_code(), str(README), "exec"), namespace)
    out = namespace["out"]
    assert out.loss.dim() == 0
    assert namespace["logprobs"].grad is not None
    assert namespace["logprobs"].grad.abs().sum() > 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == str(sorted(st.METHODS))


def test_readme_states_the_two_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    assert "bash scripts/train.sh" in text
    assert "bash scripts/test.sh" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci


def test_readme_and_training_doc_name_every_file_a_run_writes():
    """``RUN_FILES`` is what a run writes; the README listed neither ``events.jsonl`` nor
    ``samples.jsonl`` (nor ``tensorboard/``)."""
    from softtrust.train.runlog import RUN_FILES

    readme = README.read_text()
    run_directory = readme[readme.index("The run directory") :].split("Every option:", 1)[0]
    table = (README.parent / "docs" / "training.md").read_text().split("## The run directory", 1)[1]
    for name in RUN_FILES:
        assert f"`{name}`" in run_directory or f"`{name}/`" in run_directory, name
        assert f"| `{name}" in table, name


def test_no_install_line_fetches_softtrust_from_pypi():
    """softtrust is not on PyPI: docs/verl.md said ``pip install softtrust`` and the integrations'
    errors ``pip install 'softtrust[trl]'``, which fail (or fetch another project's package)."""
    import re

    root = README.parent
    texts = [README, *sorted((root / "docs").glob("*.md")), *sorted((root / "src").rglob("*.py"))]
    from_pypi = re.compile(r"pip install (-U |--upgrade )?[\"']?softtrust\b")
    for path in texts:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            assert not from_pypi.search(line), f"{path.relative_to(root)}:{number}: {line.strip()}"
    verl = (root / "docs" / "verl.md").read_text()
    assert "transformers-5.10.4" in verl and "not on PyPI" in verl
