"""The start-up path: the .pth line, the PEP 829 .start file, and what a plain interpreter pays.

Every interpreter of an environment with the package runs this, pip and linters included, so
these run fresh interpreters of the installed package.
"""

from __future__ import annotations

import ast
import json
import pkgutil
from pathlib import Path

import pytest
from conftest import ROOT, environment, run_python

from fsdp_autopatch import _config

MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"
# What must never load at start-up (FINDINGS §6: wrapt alone costs 60-80 ms).
HEAVY = {"wrapt", "importlib.metadata", "importlib_metadata", "packaging", "logging", "typing", "torch",
         "transformers", "dataclasses", "threading"}


def pth_line() -> str:
    lines = (ROOT / "fsdp_autopatch.pth").read_text().splitlines()
    assert len(lines) == 1, "site.py runs each import line of a .pth on its own: keep it one line"
    return lines[0]


def test_pth_reads_the_switch_then_imports_only_the_package() -> None:
    line = pth_line()
    assert line.startswith("import os;"), "site.py executes .pth lines that start with 'import'"
    tree = ast.parse(line)
    literals = [node for node in ast.walk(tree) if isinstance(node, ast.Tuple)]
    assert [ast.literal_eval(node) for node in literals] == [_config.OFF_VALUES]
    (inner,) = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                and isinstance(node.value, str) and "import" in node.value]
    inner_tree = ast.parse(inner)
    imports = [node for node in ast.walk(inner_tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [("fsdp_autopatch", ["arm"])]
    (handler,) = [node for node in ast.walk(inner_tree) if isinstance(node, ast.ExceptHandler)]
    assert isinstance(handler.type, ast.Name) and handler.type.id == "Exception"


def test_start_file_names_the_same_callable() -> None:
    (entry,) = (ROOT / "fsdp_autopatch.start").read_text().split()
    import fsdp_autopatch

    assert pkgutil.resolve_name(entry) is fsdp_autopatch.arm


def test_installed_files_match_the_checkout(installed: Path) -> None:
    for name in ("fsdp_autopatch.pth", "fsdp_autopatch.start"):
        assert (installed / name).read_text() == (ROOT / name).read_text()


def loaded_modules(**env: str | None) -> set[str]:
    result = run_python(MODULES, env=environment(**env))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return set(json.loads(result.stdout))


def test_plain_interpreter_loads_one_module_of_ours_and_nothing_heavy(installed: Path) -> None:
    disabled = loaded_modules(FSDP_AUTOPATCH="0")
    default = loaded_modules()
    assert "fsdp_autopatch" not in disabled
    extra = default - disabled
    assert extra == {"fsdp_autopatch"}
    assert not (default & HEAVY) - disabled


@pytest.mark.parametrize("value", ["0", "off", " FALSE ", "no", "Disable"])
def test_disabled_interpreter_imports_nothing_of_ours(installed: Path, value: str) -> None:
    assert not {m for m in loaded_modules(FSDP_AUTOPATCH=value) if m.startswith("fsdp_autopatch")}


@pytest.mark.parametrize("value", ["force", "auto", "1", "garbage"])
def test_other_values_arm_without_reading_more_than_the_switch(installed: Path, value: str) -> None:
    extra = {m for m in loaded_modules(FSDP_AUTOPATCH=value) if m.startswith("fsdp_autopatch")}
    assert extra == {"fsdp_autopatch", "fsdp_autopatch._config"}


@pytest.mark.parametrize("env", [{}, {"FSDP_AUTOPATCH": "garbage"}, {"FSDP_AUTOPATCH_LOG": "debug"}])
def test_plain_interpreter_prints_nothing(installed: Path, env: dict[str, str]) -> None:
    result = run_python("pass", env=environment(**env))
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_watcher_waits_at_the_front_of_meta_path_and_arms_once(installed: Path) -> None:
    result = run_python("""
        import sys, fsdp_autopatch
        fsdp_autopatch.arm(); fsdp_autopatch.arm()
        watchers = [f for f in sys.meta_path if type(f).__name__ == "FirstImportWatcher"]
        print(len(watchers), sys.meta_path[0] is watchers[0], fsdp_autopatch.status().reason)
    """)
    waiting = "armed: waiting for the first import of torch or transformers\n"
    assert result.stdout.split(" ", 2) == ["1", "True", waiting]


def test_status_says_when_the_pth_did_not_run(installed: Path) -> None:
    """``python -S`` skips .pth files; PYTHONPATH still makes the package importable."""
    result = run_python("import fsdp_autopatch; print(fsdp_autopatch.status().to_dict())",
                        "-S", env=environment(PYTHONPATH=str(installed)))
    assert "not armed" in result.stdout and "fsdp_autopatch.apply()" in result.stdout, result.stderr
