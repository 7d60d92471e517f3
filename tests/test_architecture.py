"""docs/architecture.md stays true: every length its reading path names is measured here, the
total stays within what a new maintainer is promised, every test it names exists, the imports go
down its table of modules, and no function of the package outgrows a screen."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "fsdp_autopatch"
# "`_hooks.try_install` (24 lines)", "`_speaker.__doc__` (33 lines)", "`fsdp_autopatch/_wrapper_cls.py`
# (487 lines)", "`docs/how-it-works.md#the-fix` (31 lines)": what to read, and how long it is, on one
# line or across two.
READ = re.compile(r"`([^`\s]+)`\s+\(([\d,]+) lines?\)")
TESTED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
TOTAL = re.compile(r"Read in full for \(a\) \u2013 \(g\): this page and the lines named above, "
                   r"([\d,]+) lines\.")
# What a new maintainer reads to answer the seven questions, at most (issue 53).
READING_LIMIT = 1500
# No function of the package is longer than a screen.
FUNCTION_LIMIT = 60
# The start-up module loads these once a watched module is imported (never at start-up): the only
# imports that go up the table.
LOADED_BY_THE_START_UP_MODULE = {"_config", "_hooks", "_api"}


def module_file(name: str) -> Path:
    """``_hooks`` -> fsdp_autopatch/_hooks.py; ``fsdp_autopatch`` -> its __init__.py; the plugin."""
    if name == "fsdp_autopatch":
        return PACKAGE / "__init__.py"
    if name == "_fsdp_autopatch_plugin":
        return ROOT / "_fsdp_autopatch_plugin.py"
    return PACKAGE / f"{name}.py"


def definition_length(path: Path, dotted: str) -> int:
    """Lines of the function or class ``dotted`` (``Class.method``) in ``path``, decorators included;
    of the module's docstring for ``__doc__``."""
    nodes: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    if dotted == "__doc__":
        first = nodes[0]
        assert isinstance(first, ast.Expr) and first.end_lineno is not None
        return first.end_lineno - first.lineno + 1
    for part in dotted.split("."):
        node = next(node for node in nodes if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                    and node.name == part)
        nodes = node.body
    assert node.end_lineno is not None
    return node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1


def section_length(path: Path, anchor: str) -> int:
    """Lines of the markdown section whose heading's anchor is ``anchor``, to the next heading of
    its level or above."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = level = None
    for index, line in enumerate(lines):
        heading = re.match(r"(#+) (.*)", line)
        if heading is None:
            continue
        if start is None and re.sub(r"[^\w\- ]", "", heading[2].lower()).replace(" ", "-") == anchor:
            start, level = index, len(heading[1])
        elif start is not None and len(heading[1]) <= level:  # type: ignore[operator]
            return index - start
    assert start is not None, f"no section #{anchor} in {path}"
    return len(lines) - start


def length(reference: str) -> int:
    """What the doc names, measured: a file, a section of one, or a module's function or class."""
    if "#" in reference:
        path, anchor = reference.split("#")
        return section_length(ROOT / path, anchor)
    if "/" in reference or reference.endswith(".pth"):
        return len((ROOT / reference).read_text(encoding="utf-8").splitlines())
    module, dotted = reference.split(".", 1)
    return definition_length(module_file(module), dotted)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def reading_path() -> list[tuple[str, int]]:
    text = DOC.read_text(encoding="utf-8")
    return [(reference, number(stated)) for reference, stated in READ.findall(text)]


def test_every_length_the_reading_path_names_is_measured() -> None:
    found = reading_path()
    assert len(found) > 15
    wrong = {reference: (stated, length(reference)) for reference, stated in found
             if length(reference) != stated}
    assert not wrong, f"(stated, measured) lines: {wrong}"


def test_the_seven_questions_are_answered_within_the_lines_promised() -> None:
    text = DOC.read_text(encoding="utf-8")
    total = len(text.splitlines()) + sum(length(reference) for reference, _ in reading_path())
    stated = TOTAL.search(text)
    assert stated is not None and number(stated[1]) == total, f"measured: {total:,} lines"
    assert total <= READING_LIMIT
    assert [question for question in "abcdefg" if f"**({question})" in text] == list("abcdefg")


def test_every_test_it_names_exists() -> None:
    named = TESTED.findall(DOC.read_text(encoding="utf-8"))
    assert len(named) >= 7
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert name in defined, (path, name)


def package_files() -> list[Path]:
    return [*sorted(PACKAGE.glob("*.py")), ROOT / "_fsdp_autopatch_plugin.py"]


def test_no_function_of_the_package_is_longer_than_a_screen() -> None:
    long = {}
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > FUNCTION_LIMIT:
                    long[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, long


def table_order() -> list[str]:
    """The package's modules in the order of the doc's table (``fsdp_autopatch`` is __init__)."""
    names = re.findall(r"^\| `([\w./]+)\.py` \|", DOC.read_text(encoding="utf-8"), re.MULTILINE)
    renamed = {"__init__": "fsdp_autopatch", "../_fsdp_autopatch_plugin": "_fsdp_autopatch_plugin"}
    return [renamed.get(name, name) for name in names]


def imported(path: Path) -> set[str]:
    """The package's modules ``path`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[-1] if alias.name.startswith("fsdp_autopatch.") else alias.name
                      for alias in node.names if alias.name.split(".")[0] == "fsdp_autopatch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fsdp_autopatch":
            assert node.module is not None
            if node.module == "fsdp_autopatch":
                found |= {alias.name for alias in node.names if module_file(alias.name).is_file()}
                if any(not module_file(alias.name).is_file() for alias in node.names):
                    found.add("fsdp_autopatch")  # a name the start-up module defines
            else:
                found.add(node.module.split(".")[1])
    return found - {path.stem}


def test_every_module_is_in_the_table_and_imports_go_down_it() -> None:
    order = table_order()
    assert sorted(order) == sorted(
        ["fsdp_autopatch" if path.stem == "__init__" else path.stem for path in package_files()
         if path.stem != "__main__"])
    upward = {}
    for position, name in enumerate(order):
        above = set(order[:position])
        allowed = above | (LOADED_BY_THE_START_UP_MODULE if name == "fsdp_autopatch" else set())
        if imported(module_file(name)) - allowed:
            upward[name] = sorted(imported(module_file(name)) - allowed)
    assert not upward, f"modules imported from below in the table: {upward}"
