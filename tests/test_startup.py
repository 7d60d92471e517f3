"""The start-up path: the .pth line, the PEP 829 .start file, and what a plain interpreter pays.

Every interpreter of an environment with the package runs this, pip and linters included, so
these run fresh interpreters of the installed package. Python 3.15+ runs ``fsdp_autopatch.start``
instead of the ``.pth`` import line (PEP 829); the tests say what differs there.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    PROGRAMS,
    ROOT,
    ci_tier,
    environment,
    fake_torch,
    fake_transformers,
    json_lines,
    layout_bug_here,
    make_throwaway,
    run_python,
)

import fsdp_autopatch
from fsdp_autopatch import _config

# PEP 829: a matching .start file suppresses the .pth import line, and the entry point runs instead.
START_FILES = sys.version_info >= (3, 15)

MODULES = "import sys, json; print(json.dumps(sorted(sys.modules)))"
# What must never load at start-up (wrapt alone costs 60-80 ms to import).
HEAVY = {"wrapt", "importlib.metadata", "importlib_metadata", "packaging", "logging", "typing", "torch",
         "transformers", "dataclasses", "threading"}
# Of ours and wrapt's, what a fresh interpreter has loaded, whether the package armed, and its
# watchers on sys.meta_path; after() first imports what the test names.
STATE = PROGRAMS / "startup_state.py"


def spec_of(imports: str) -> str:
    """``"torch, torch.nn"`` as tests/programs/import_order.py reads it."""
    return imports.replace(" ", "")


def state_of(result: Any) -> dict[str, Any]:
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    (state,) = json_lines(result.stdout)
    return state


# --- the files ---------------------------------------------------------------------------------


def _pth_line(installed: Path) -> str:
    text = (installed / "fsdp_autopatch.pth").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) == 1 and text.endswith("\n"), "site.py runs each import line on its own: keep it one"
    return lines[0]


def test_pth_is_the_documented_line(installed: Path) -> None:
    """One line; imports os and then only this package's bootstrap; reads FSDP_AUTOPATCH only."""
    line = _pth_line(installed)
    # site.py executes a .pth line only if it starts with "import" followed by space or tab.
    assert line.startswith("import ")
    outer = ast.parse(line)
    statements = outer.body
    assert [type(s) for s in statements] == [ast.Import, ast.Expr]
    assert [a.name for a in statements[0].names] == ["os"]  # type: ignore[attr-defined]
    condition = statements[1].value  # type: ignore[attr-defined]
    # `<FSDP_AUTOPATCH is off> or exec("<constant>")`: the bootstrap runs unless switched off.
    assert isinstance(condition, ast.BoolOp) and isinstance(condition.op, ast.Or)
    switch, bootstrap = condition.values
    variables = [n.args[0].value for n in ast.walk(switch)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"]
    assert variables == [fsdp_autopatch.MODE_VARIABLE]
    assert "environ" in ast.dump(switch)
    (off_values,) = [n for n in ast.walk(switch) if isinstance(n, ast.Tuple)]
    # The line, the start-up module (for a .start file) and the parser agree on what "off" is.
    import _fsdp_autopatch_plugin

    assert tuple(ast.literal_eval(off_values)) == fsdp_autopatch.OFF_VALUES == _config.OFF_VALUES \
        == _fsdp_autopatch_plugin.OFF_VALUES
    assert _fsdp_autopatch_plugin.MODE_VARIABLE == fsdp_autopatch.MODE_VARIABLE
    assert _config.parse_mode(fsdp_autopatch.FORCE_VALUES[0]).name == _config.FORCE
    # exec of a string literal: what it runs is fixed in the file, never taken from outside.
    assert isinstance(bootstrap, ast.Call) and ast.unparse(bootstrap.func) == "exec"
    (argument,) = bootstrap.args
    assert isinstance(argument, ast.Constant) and isinstance(argument.value, str)
    inner = ast.parse(argument.value)
    imports = [n for n in ast.walk(inner) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [("fsdp_autopatch", ["arm"])]  # type: ignore[union-attr]
    calls = [ast.unparse(n.func) for n in ast.walk(inner) if isinstance(n, ast.Call)]
    assert calls == ["arm"]
    (handler,) = [n for n in ast.walk(inner) if isinstance(n, ast.ExceptHandler)]
    assert isinstance(handler.type, ast.Name) and handler.type.id == "Exception"
    # Every name is accounted for: no open(), no __import__, no sys.path, no other variable.
    names = {n.id for n in ast.walk(outer) if isinstance(n, ast.Name)} | {
        n.id for n in ast.walk(inner) if isinstance(n, ast.Name)}
    assert names == {"os", "exec", "arm", "Exception"}


def test_start_file_names_the_same_callable(installed: Path) -> None:
    lines = (installed / "fsdp_autopatch.start").read_text(encoding="utf-8").splitlines()
    assert lines == ["fsdp_autopatch:arm"]
    assert pkgutil.resolve_name(lines[0]) is fsdp_autopatch.arm


def test_installed_files_match_the_checkout(installed: Path) -> None:
    for name in ("fsdp_autopatch.pth", "fsdp_autopatch.start"):
        assert (installed / name).read_text() == (ROOT / name).read_text()


def test_watched_modules_are_the_sites_modules() -> None:
    """The start-up module names the modules it watches itself, to import nothing at start-up;
    the table of sites takes them from there, and every one of them is a site's or an FSDP2
    package."""
    from fsdp_autopatch import _sites

    assert set(fsdp_autopatch.WATCHED_MODULES) == {*_sites.FSDP2_PACKAGES, *(s.module for s in _sites.SITES)}


# --- what a plain interpreter pays -------------------------------------------------------------


def loaded_modules(**env: str | None) -> set[str]:
    result = run_python(MODULES, env=environment(**env))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    return set(json.loads(result.stdout))


def test_plain_interpreter_loads_one_module_of_ours_and_nothing_heavy(installed: Path) -> None:
    disabled = loaded_modules(FSDP_AUTOPATCH="0")
    default = loaded_modules()
    assert {m for m in default if m.startswith(("fsdp_autopatch", "wrapt"))} == {"fsdp_autopatch"}
    # With a .start file the entry point's module is imported even when switched off (below).
    assert default - disabled == (set() if START_FILES else {"fsdp_autopatch"})
    assert not (default & HEAVY) - disabled


@pytest.mark.parametrize("value", ["force", "auto", "1", "garbage"])
def test_other_values_arm_without_reading_more_than_the_switch(installed: Path, value: str) -> None:
    extra = {m for m in loaded_modules(FSDP_AUTOPATCH=value) if m.startswith("fsdp_autopatch")}
    assert extra == {"fsdp_autopatch"}


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
    count, first, reason = result.stdout.split(" ", 2)
    assert (count, first) == ("1", "True") and reason.startswith("armed: waiting for"), result.stderr


def test_status_says_when_the_pth_did_not_run(installed: Path) -> None:
    """``python -S`` skips .pth files; PYTHONPATH still makes the package importable."""
    where = Path(fsdp_autopatch.__file__).parent.parent  # site-packages, or an editable checkout
    result = run_python("import fsdp_autopatch; print(fsdp_autopatch.status().to_dict())",
                        "-S", env=environment(PYTHONPATH=str(where)))
    assert "not armed" in result.stdout and "fsdp_autopatch.apply()" in result.stdout, result.stderr



@pytest.mark.parametrize("position", ["ahead", "behind"])
@pytest.mark.parametrize("imports", ["torch.distributed.fsdp, transformers",
                                     "transformers, torch.distributed.fsdp"])
def test_a_finder_that_asks_every_finder_imports_as_without_the_package(
    tmp_path: Path, installed: Path, position: str, imports: str
) -> None:
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    for mode in (None, "force", "0"):
        result = env.run_program(STATE, "--finder", position, spec_of(imports), FSDP_AUTOPATCH=mode)
        state = state_of(result)  # no RecursionError, nothing on stderr
        assert state["watchers"] == [], state
        assert ("fsdp_autopatch._hooks" in state["ours"]) is (mode != "0"), state


# --- what registers the hooks: FSDP2 or transformers, never torch alone ------------------------

NOT_REGISTERING = ["torch", "torch.nn", "torch.distributed", "torch, torch.nn, torch.distributed"]


@pytest.mark.parametrize("mode", ["auto", "force"])
@pytest.mark.parametrize("imports", [*NOT_REGISTERING, *fsdp_autopatch.TORCH_MODULES, "transformers"])
def test_only_fsdp2_or_transformers_registers_the_hooks(
    tmp_path: Path, installed: Path, imports: str, mode: str
) -> None:
    """torch alone leaves the watcher waiting and loads nothing; an FSDP2 or composable DDP module
    registers the hooks; so does transformers, in auto mode (force needs torch's module only)."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    state = state_of(env.run_program(STATE, spec_of(imports), FSDP_AUTOPATCH=mode))
    registers = imports in fsdp_autopatch.TORCH_MODULES or (imports == "transformers" and mode == "auto")
    if registers:
        assert "wrapt" in state["ours"] and "fsdp_autopatch._hooks" in state["ours"], state
        assert state["watchers"] == [], state
    else:
        assert state == {"ours": ["fsdp_autopatch"], "armed": True, "watchers": ["FirstImportWatcher"]}


TORCH_THEN_FSDP2 = """
import json, sys

def ours():
    return sorted(m for m in sys.modules if m.startswith(("fsdp_autopatch", "wrapt")))

def watchers():
    return [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "FirstImportWatcher"]

steps = {}
import torch, torch.nn, torch.distributed
x = torch.nn.Linear(4, 4)(torch.ones(2, 4))  # torch in use, FSDP2 never imported
steps["torch"] = [ours(), watchers()]
import transformers
steps["transformers"] = [ours(), watchers()]
import torch.distributed.fsdp
import fsdp_autopatch
steps["status"] = fsdp_autopatch.status().to_dict()
print(json.dumps(steps))
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["auto", *ci_tier("force")])
def test_torch_alone_loads_nothing_then_fsdp2_patches(real_torch: dict[str, str], mode: str) -> None:
    """With real torch: importing and using torch loads no module of wrapt and none of the
    package beyond its start-up module; importing FSDP2 and transformers afterwards patches."""
    result = run_python(TORCH_THEN_FSDP2, env=environment(FSDP_AUTOPATCH=mode))
    assert result.returncode == 0, result.stderr[-4000:]
    (steps,) = json_lines(result.stdout)
    assert steps["torch"] == [["fsdp_autopatch"], ["FirstImportWatcher"]]
    if mode == "auto":  # transformers arms: its version decides
        ours, watchers = steps["transformers"]
        assert "wrapt" in ours and "fsdp_autopatch._hooks" in ours and watchers == []
    else:  # force waits for FSDP2 itself
        assert steps["transformers"] == [["fsdp_autopatch"], ["FirstImportWatcher"]]
    status = steps["status"]
    assert status["mode"] == mode and status["torch"] is not None, status
    assert not status["reason"].startswith("armed: waiting"), status
    assert status["applied"] == (layout_bug_here() or mode == "force"), status


# --- PEP 829: the .start file on Python 3.15+, the .pth line before ----------------------------

COUNTER_MODULE = PROGRAMS / "arm_counter.py"
COUNTERS = {
    "00_arm_counter.pth": "import _arm_counter; _arm_counter.wrap_arm()\n",
    "01_arm_counter.pth": "import _arm_counter; _arm_counter.passes += 1\n",
}
def test_start_up_entry_runs_once(tmp_path: Path, installed: Path) -> None:
    """3.15+: the .start entry point runs once, the .pth import line is suppressed. Before: the
    .pth line runs on every pass over site-packages, and arm() arms once."""
    env = make_throwaway(tmp_path / "venv", installed)
    shutil.copy2(COUNTER_MODULE, env.site_packages / "_arm_counter.py")
    for name, line in COUNTERS.items():
        (env.site_packages / name).write_text(line)
    result = env.run_program(PROGRAMS / "arm_counted.py")
    assert (result.returncode, result.stderr) == (0, ""), result.stderr
    (counted,) = json_lines(result.stdout)
    assert counted["passes"] >= 1, counted
    if START_FILES:
        assert counted["calls"] == 1, counted
    else:
        assert counted["calls"] == counted["passes"], counted
    assert counted["armed"] is True and counted["watchers"] == 1, counted


@pytest.mark.parametrize("value", ["0", "off", " FALSE ", "no", "Disable"])
def test_off_switch(tmp_path: Path, installed: Path, value: str) -> None:
    """Switched off, nothing is armed and nothing loads when FSDP2 is imported. Before 3.15 the
    .pth line keeps the package out altogether; a .start entry point is imported regardless, so
    on 3.15+ the start-up module is loaded (and does nothing)."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    expected = ({"ours": ["fsdp_autopatch"], "armed": False, "watchers": []} if START_FILES
                else {"ours": [], "armed": None, "watchers": []})
    assert state_of(env.run_program(STATE, FSDP_AUTOPATCH=value)) == expected
    imports = "torch.distributed.fsdp, transformers"
    assert state_of(env.run_program(STATE, spec_of(imports), FSDP_AUTOPATCH=value)) == expected


@pytest.mark.parametrize("variables", [{}, {"FSDP_AUTOPATCH": "force"}, {"FSDP_AUTOPATCH": "0"}],
                         ids=["unset", "force", "off"])
def test_half_removed_install(tmp_path: Path, installed: Path, variables: dict[str, str]) -> None:
    """The package directory gone, its start-up files left: every interpreter still starts and
    runs the program. Before 3.15 the .pth line's try/except keeps it silent; on 3.15+ CPython
    itself reports the .start entry point it cannot import, on stderr, at every start."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    shutil.rmtree(env.site_packages / "fsdp_autopatch")
    for code, output in (("pass", ""), ("import torch.distributed.fsdp, transformers; print('ok')", "ok\n")):
        result = env.run(code, **variables)
        assert (result.returncode, result.stdout) == (0, output), result.stderr
        if START_FILES:
            assert "fsdp_autopatch:arm" in result.stderr, result.stderr
        else:
            assert result.stderr == ""


def test_a_spec_found_before_a_watched_import_pickles_and_copies_as_without_the_package(
    tmp_path: Path, installed: Path
) -> None:
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    runs = {mode: env.run_program(PROGRAMS / "spec_copies.py", FSDP_AUTOPATCH=mode)
            for mode in (None, "0")}
    reports = [state_of(run) for run in runs.values()]
    assert reports[0] == reports[1] == {how: ["SourceFileLoader", "torch.distributed.fsdp", True]
                                        for how in ("pickled", "deep-copied")}
