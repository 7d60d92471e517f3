"""The package's modules import each other downward only, read from their source with ``ast``.

Every import counts, also those inside functions: a module that imports another only when a
function runs still needs it, and two modules that do so both ways form a cycle that only the
order of first calls keeps from failing. ``import fsdp_autopatch`` (the package itself, for its
version or its switch) is the root everyone may import; its own imports are lazy by design (its
API loads on first use), so it is left out of the graph.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

import fsdp_autopatch

PACKAGE = "fsdp_autopatch"
SOURCES = Path(fsdp_autopatch.__file__).resolve().parent
COMMAND_MODULES = ("_cli", "_doctor", "_verify_command")


def imported_modules(source: str, modules: set[str]) -> set[str]:
    """The package's modules (by short name, among ``modules``) that ``source`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != PACKAGE:
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from fsdp_autopatch import _doctor, __version__
                found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError("the package uses absolute imports only")
    return found & modules


def import_graph(directory: Path = SOURCES) -> dict[str, set[str]]:
    modules = {path.stem for path in directory.glob("*.py") if path.stem != "__init__"}
    return {name: imported_modules((directory / f"{name}.py").read_text(encoding="utf-8"), modules)
            for name in sorted(modules)}


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle, as the modules along it (first one repeated at the end), or None."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(name: str) -> Optional[list[str]]:
        state[name] = "open"
        trail.append(name)
        for imported in sorted(graph.get(name, ())):
            if state.get(imported) == "open":
                return [*trail[trail.index(imported):], imported]
            if imported not in state:
                cycle = visit(imported)
                if cycle:
                    return cycle
        trail.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert set(COMMAND_MODULES) <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_command_line_imports_its_commands_and_they_never_import_it_back() -> None:
    graph = import_graph()
    assert {"_doctor", "_verify_command", "_console"} <= graph["_cli"]
    for command in ("_doctor", "_verify_command"):
        assert "_cli" not in graph[command], f"{command} imports _cli"
        assert "_console" in graph[command], f"{command} should take the console from _console"
    assert graph["_console"] == set(), "_console is the bottom: it imports nothing of the package"


@pytest.mark.parametrize("sources, cycle", [
    ({"_a": "from fsdp_autopatch import _b\n", "_b": "def f():\n    from fsdp_autopatch._a import x\n"},
     ["_a", "_b", "_a"]),
    ({"_a": "import fsdp_autopatch._b\n", "_b": "from fsdp_autopatch import _c\n",
      "_c": "from fsdp_autopatch import _a, __version__\n"}, ["_a", "_b", "_c", "_a"]),
    ({"_a": "from fsdp_autopatch import _b, __version__\nimport fsdp_autopatch\n",
      "_b": "import os\n"}, None),
])
def test_the_cycle_finder_sees_function_level_and_package_imports(
    tmp_path: Path, sources: dict[str, str], cycle: Optional[list[str]]
) -> None:
    for name, source in sources.items():
        (tmp_path / f"{name}.py").write_text(source)
    (tmp_path / "__init__.py").write_text("from fsdp_autopatch import _a\n")
    assert find_cycle(import_graph(tmp_path)) == cycle
