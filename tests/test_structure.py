"""The shape of the source tree: no import cycle (function-local imports counted), no function
over 80 lines of code, no module over 600 lines.

These are the limits a newcomer reads by: a module is one idea, a function fits a screen, and
the import graph is a ladder (``options`` depends on ``config``, never the reverse). Each check
reads the source as text (``ast``), so it costs nothing and runs nothing of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "softtrust"
MAX_FUNCTION_LINES, MAX_MODULE_LINES = 80, 600


def module_files() -> dict[str, Path]:
    """``softtrust.train.learner`` -> its file, for every module of the package."""
    files = {}
    for path in sorted((SOURCE / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import statement in ``tree``, at any depth (inside functions too), except those
    under ``if TYPE_CHECKING:`` (they never run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports. ``from .a import b`` imports ``a.b`` when that is
    a module, else ``a`` (whose ``__init__`` runs); importing ``a.b`` also runs ``a``'s
    ``__init__``, but a package's ``__init__`` is left out of cycles through its own children
    (Python imports the package first, so they are not circles of loading order)."""
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    for alias in node.names
                ]
            edges.update(target for target in targets if target in files and target != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            # a package's children importing the package itself is not a loading circle
            if node.startswith(target + "."):
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def lines_of_code(node: ast.AST, lines: list[str]) -> int:
    """A function's lines from ``def`` to its end, without its docstring, blank lines and
    comment-only lines."""
    body = node.body
    docstring = (
        range(body[0].lineno, body[0].end_lineno + 1)
        if isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
        else range(0)
    )
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number not in docstring
        and lines[number - 1].strip()
        and not lines[number - 1].strip().startswith("#")
    )


def test_the_package_has_no_import_cycle_counting_function_local_imports():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_function_local_import(tmp_path):
    """The check can fail: two modules that import each other, one inside a function."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import f\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import g\n"
    )
    files = {f"{PACKAGE}.{name}": package / f"{name}.py" for name in ("a", "b", "c")}
    graph = import_graph(files)
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]
    assert graph[f"{PACKAGE}.c"] == set()  # a TYPE_CHECKING import never runs


@pytest.mark.parametrize("name", sorted(module_files()))
def test_no_function_over_80_lines_and_no_module_over_600(name):
    path = module_files()[name]
    text = path.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_MODULE_LINES, f"{path.name}: {len(lines)} lines"
    long = {
        node.name: count
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (count := lines_of_code(node, lines)) > MAX_FUNCTION_LINES
    }
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines of code: {long}"
