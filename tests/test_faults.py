"""Faults at start-up and at import time must never break an interpreter.

The ``.pth`` line runs in every Python process of the environment, pip included, and the hooks
run inside ``import torch`` and ``import transformers``. Each fault is injected into a fresh
interpreter: a throwaway environment holding a copy of the installed package (and fakes of torch
or transformers where only the import machinery is under test), or the test environment itself
with a fault injected before the first import. A fault may cost the patch, never the program.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import (
    LAYOUT_ERROR,
    PROGRAMS,
    Throwaway,
    ci_tier,
    environment,
    fake_torch,
    fake_transformers,
    json_lines,
    layout_bug_here,
    make_throwaway,
    own_lines,
    pip_in,
    run_program,
    run_python,
    write_module,
)
from harness import split_importtime

from fsdp_autopatch import _config, _matrix

WARNING_PREFIX = "fsdp-autopatch"
OFF = "0"
TRY_IMPORTS = PROGRAMS / "try_imports.py"
# PEP 829 (3.15+): every .pth import line runs first, then the .start entry points (ours among
# them), each in file-name order; a matching .start file suppresses fsdp_autopatch.pth's line.
START_FILES = sys.version_info >= (3, 15)


# --- throwaway environments --------------------------------------------------------------------


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


STATUS = "import json, fsdp_autopatch; print(json.dumps(fsdp_autopatch.status().to_dict()))"


def status_after(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    (status,) = json_lines(result.stdout)
    return status


# --- start-up faults ---------------------------------------------------------------------------


def test_package_half_removed(tmp_path: Path, installed: Path) -> None:
    """A half-finished uninstall leaves the start-up module behind without the rest: every
    interpreter must still start, and every import still work. (The package directory gone
    altogether is tests/test_startup.py's: Python 3.15 reports it.)"""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    for path in (env.site_packages / "fsdp_autopatch").iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.name != "__init__.py":
            path.unlink()
    imports = "import torch.distributed.fsdp, transformers; print('imported')"
    # The hand-over imports the (now missing) configuration and hooks modules, in each mode.
    for variables in ({}, {"FSDP_AUTOPATCH": "auto"}, {"FSDP_AUTOPATCH": "force"}):
        started = env.run(**variables)
        assert (started.returncode, started.stderr) == (0, ""), variables
        result = env.run(imports, **variables)
        assert (result.returncode, result.stderr, result.stdout) == (0, "", "imported\n"), variables


@pytest.mark.parametrize("fault", ["missing", "raising"])
def test_wrapt_unusable_without_torch(tmp_path: Path, installed: Path, fault: str) -> None:
    env = make_throwaway(tmp_path / "venv", installed, wrapt=fault != "missing")
    if fault == "raising":
        shutil.rmtree(env.site_packages / "wrapt")
        write_module(env.site_packages, "wrapt", 'raise RuntimeError("wrapt is broken")\n')
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    started = env.run()
    assert (started.returncode, started.stderr) == (0, "")
    # Only where the patch would have been installed: transformers alone (an inference worker)
    # or FSDP2 alone imports nothing that wraps an affected head, so nothing is said.
    for alone in ("import transformers", "import torch.distributed.fsdp"):
        quiet = env.run(alone)
        assert (quiet.returncode, own_lines(quiet.stderr)) == (0, []), (alone, quiet.stderr)
    result = env.run(f"import torch.distributed.fsdp, transformers\n{STATUS}")
    status = status_after(result)
    missing = fault == "missing"
    cause = ("wrapt is not installed" if missing else
             "wrapt cannot be imported (RuntimeError: wrapt is broken)")
    assert not status["applied"] and status["reason"].startswith(cause)
    # Where the stand-in pair has the bug, the user reads the cause and the remedy, once.
    remedy = pip_in(env.python, "install wrapt" if missing else "install --force-reinstall wrapt")
    assert own_lines(result.stderr) == cannot_fix(f"{cause} ({remedy})")
    # Asked for, the log says it too.
    logged = env.run("import torch.distributed.fsdp", FSDP_AUTOPATCH_LOG="info")
    assert logged.returncode == 0
    warned = f"fsdp-autopatch INFO: {cause}"
    assert [line for line in warning_lines(logged.stderr) if line.startswith(warned)]


def cannot_fix(cause: str) -> list[str]:
    """The one line where the stand-in pair (torch 2.13.0, transformers 4.55.2) has the bug on
    this Python and the fix cannot run; nothing where the version rows say there is no bug."""
    bug = _matrix.decide(_config.AUTO, "2.13.0", "4.55.2").apply
    return [f"fsdp-autopatch: cannot fix the layout bug for ABC modules here: {cause}"] if bug else []


def undecodable() -> str:
    # Environment values are bytes on POSIX; Python hands undecodable ones over as surrogates.
    return os.fsdecode(b"\xff\xfe\x80 auto")


BAD_VALUES = {
    "empty": "",
    "blank": "   \t ",
    # Accented, symbol, astral-plane and full-width letters ("OFF" in full width is not "off").
    "unicode": "h\u00e9llo w\u00f6rld \u2713 \U0001d523\U0001d530 \uff2f\uff26\uff26",
    "shell": "$(touch {marker}); `touch {marker}` | touch {marker} && touch {marker}; '\"\\ * ? > <",
    "newlines": "off\nrm -rf /\r\n",
    "very long": "x" * 100_000,
    "undecodable": undecodable(),
}


@pytest.mark.parametrize("value", list(BAD_VALUES.values()), ids=list(BAD_VALUES))
def test_bad_mode_value(tmp_path: Path, installed: Path, value: str) -> None:
    """At start-up: silence. At the first torch/transformers import: at most one warning line."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    marker = tmp_path / "marker"
    value = value.replace("{marker}", str(marker))
    started = env.run(FSDP_AUTOPATCH=value)
    assert (started.returncode, started.stderr) == (0, "")
    result = env.run(f"import torch.distributed.fsdp, transformers, torch\n{STATUS}", FSDP_AUTOPATCH=value)
    assert result.returncode == 0, result.stderr
    lines = warning_lines(result.stderr)
    assert len(lines) <= 1, lines
    for line in lines:
        assert line.startswith(f"{WARNING_PREFIX}: ignoring FSDP_AUTOPATCH=")
        assert line.isascii() and len(line) < 300, line
    # Nothing the user typed is ever run or used as a mode; blank values are simply auto.
    assert not marker.exists()
    assert status_after(result)["mode"] == "auto"
    assert bool(lines) == bool(value.strip())


@pytest.mark.parametrize("value", ["garbage", "DEBUG; rm -rf /", "☃" * 50, "x" * 100_000, "", "  "])
def test_log_variable_garbage(tmp_path: Path, installed: Path, value: str) -> None:
    """One line names the accepted values, as for FSDP_AUTOPATCH; the log stays off. Without
    wrapt there is a warning to log, so a garbage value that turned logging on would show."""
    env = make_throwaway(tmp_path / "venv", installed, wrapt=False)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    started = env.run(FSDP_AUTOPATCH_LOG=value)
    assert (started.returncode, started.stderr) == (0, "")
    result = env.run("import torch.distributed.fsdp, transformers", FSDP_AUTOPATCH_LOG=value)
    assert result.returncode == 0
    accepted = ", ".join(_config.LOG_LEVELS)
    ignoring = [_config.ignoring(_config.LOG_VARIABLE, value, accepted)] if value.strip() else []
    remedy = pip_in(env.python, "install wrapt")
    assert own_lines(result.stderr) == [*ignoring, *cannot_fix(f"wrapt is not installed ({remedy})")]
    # ASCII, and cut short: a value of 100,000 characters is shown by its first 40.
    assert all(line.isascii() and len(line) < 400 for line in own_lines(result.stderr))
    assert "WARNING" not in result.stderr
    control = env.run("import torch.distributed.fsdp", FSDP_AUTOPATCH_LOG="info")
    assert "fsdp-autopatch INFO: wrapt is not installed" in control.stderr


FLAG_CASES = {
    "-S": ["-S"],
    "-I": ["-I"],
    "-E": ["-E"],
    "-s": ["-s"],
    "-W error": ["-W", "error"],
    "-X dev": ["-X", "dev"],
    "-X importtime": ["-X", "importtime"],
}
ARMED = (
    "import sys, json\n"
    "print(json.dumps({'ours': sorted(m for m in sys.modules if m.startswith(('fsdp_autopatch', 'wrapt'))),"
    " 'watchers': [repr(f) for f in sys.meta_path if 'fsdp_autopatch' in repr(f)]}))\n"
)


@pytest.mark.parametrize("flags", list(FLAG_CASES.values()), ids=list(FLAG_CASES))
def test_interpreter_flags(tmp_path: Path, installed: Path, flags: list[str]) -> None:
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    importtime = flags == ["-X", "importtime"]

    def own_output(stderr: str) -> list[str]:
        # -X importtime reports on stderr by design; anything else there would be ours.
        return split_importtime(stderr)[1] if importtime else stderr.splitlines()

    started = env.run(ARMED, *flags)
    assert started.returncode == 0 and own_output(started.stderr) == [], started.stderr
    (seen,) = json_lines(started.stdout)
    if flags == ["-S"]:
        # No site: the .pth is not read, and nothing of ours loads.
        assert seen == {"ours": [], "watchers": []}
    else:
        # Start-up loads the package's __init__ and nothing else: no wrapt, no hooks, no config.
        assert seen["ours"] == ["fsdp_autopatch"]
        assert len(seen["watchers"]) == 1
    if importtime:
        imported = split_importtime(started.stderr)[0]
        # 3.15+ imports a .start entry point through importlib.import_module, which -X importtime
        # does not time.
        expected = [] if START_FILES else ["fsdp_autopatch"]
        assert [name for name in imported if "fsdp" in name or "wrapt" in name] == expected
    if flags == ["-S"]:
        return  # without site, site-packages (and the fakes in it) are not importable at all
    result = env.run("import torch.distributed.fsdp, transformers; print('imported')", *flags)
    assert result.returncode == 0 and own_output(result.stderr) == [], result.stderr
    assert result.stdout == "imported\n"


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(path.relative_to(root)): (path.stat().st_mtime_ns, path.stat().st_size)
            for path in sorted(root.rglob("*"))}


def _as_plain_owner() -> list[str]:
    """A command prefix that takes away root's power to write where permissions forbid it."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only directory would still be writable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def test_read_only_site_packages(tmp_path: Path, installed: Path) -> None:
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    # Without bytecode the interpreter would like to write some: it must quietly not.
    for cache in list(env.site_packages.rglob("__pycache__")):
        shutil.rmtree(cache)
    prefix = _as_plain_owner()
    before = _tree(env.site_packages)
    folders = [env.site_packages, *[p for p in env.site_packages.rglob("*") if p.is_dir()]]
    for folder in folders:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        for code in ("pass", f"import torch.distributed.fsdp, transformers\n{STATUS}"):
            result = subprocess.run(
                [*prefix, str(env.python), "-c", code], capture_output=True, text=True, check=False,
                env=environment(PYTHONDONTWRITEBYTECODE=None), cwd=tmp_path, timeout=120,
            )
            assert (result.returncode, result.stderr) == (0, ""), code
        # The hooks ran, and the probe decided.
        assert status_after(result)["decided_by"] == "probe"
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert _tree(env.site_packages) == before


# --- what runs at start-up: the .pth line is parsed in tests/test_startup.py ------------------




Event = tuple[str, list[Any]]
# Events that name what they touch in their first argument: a module, a file, a directory.
NAMED_EVENTS = ("import", "open", "os.listdir")


def start_up_events(env: Throwaway, control: Optional[str] = None, **variables: str) -> list[Event]:
    """Audit events from the first import line to the start-up file after ours, in a fresh
    interpreter of ``env``. ``control``, a stdlib entry point such as ``os:getpid``, is written
    where our start-up file sorts (``fsdp_autopatch.start`` on 3.15+, else a ``.pth`` import line)."""
    shutil.copy2(PROGRAMS / "startup_audit.py", env.site_packages / "_startup_audit.py")
    (env.site_packages / "00_startup_audit.pth").write_text("import _startup_audit\n")
    if START_FILES:  # after every import line, after fsdp_autopatch.start's entry point
        (env.site_packages / "zz_startup_audit.start").write_text("_startup_audit:stop\n")
    else:
        audit = env.site_packages / "zz_startup_audit.pth"
        audit.write_text("import _startup_audit; _startup_audit.stop()\n")
    if control is not None:
        module, function = control.split(":")
        if START_FILES:
            (env.site_packages / "fsdp_autopatch.start").write_text(f"{control}\n")
        else:
            (env.site_packages / "fsdp_autopatch.pth").write_text(f"import {module}; {module}.{function}()\n")
    code = "import json, _startup_audit; print(json.dumps(_startup_audit.events))"
    result = env.run(code, PYTHONDONTWRITEBYTECODE=None, **variables)
    assert (result.returncode, result.stderr) == (0, "")
    (events,) = [json.loads(line) for line in result.stdout.splitlines()]
    for index, (event, args) in enumerate(events):
        if event == "open" and args[0].endswith("zz_startup_audit.pth"):
            return [(event, args) for event, args in events[:index]]  # the next .pth: ours is done
    return [(event, args) for event, args in events]


@pytest.fixture(scope="module")
def start_machinery(tmp_path_factory: pytest.TempPathFactory, installed: Path) -> set[tuple[str, str]]:
    """What the interpreter's own start-up processing touches to run one entry point, measured with
    a stdlib-only entry in the place of ours. On 3.15 resolving a ``.start`` entry point imports
    ``re`` and what it needs (enum, copyreg, ...: pkgutil.resolve_name compiles its pattern on
    first use); before 3.15 a ``.pth`` import line of an imported module touches nothing."""
    env = make_throwaway(tmp_path_factory.mktemp("control") / "venv", installed,
                         package=False, pth=False, wrapt=False)
    events = start_up_events(env, control="os:getpid")
    return {(event, str(args[0])) for event, args in events if event in NAMED_EVENTS}


@pytest.mark.parametrize("variables", [{}, {"FSDP_AUTOPATCH": "not a mode"}], ids=["unset", "set"])
def test_start_up_touches_only_its_own_files(
    tmp_path: Path, installed: Path, variables: dict[str, str], start_machinery: set[tuple[str, str]]
) -> None:
    """Audit events between the start-up files sorted around ours: only reads of our own files,
    besides what the interpreter touches to run any entry point (the control above)."""
    env = make_throwaway(tmp_path / "venv", installed)
    events = start_up_events(env, **variables)
    ours = env.site_packages / "fsdp_autopatch"
    imported = [index for index, (event, args) in enumerate(events)
                if event == "import" and args[0] == "fsdp_autopatch"]
    assert imported, f"the audit hook did not see the package imported: the check would be blind ({events})"
    for index, (event, args) in enumerate(events):
        if event in NAMED_EVENTS and (event, str(args[0])) in start_machinery:
            # The interpreter resolves the entry point before importing the package; anything
            # after that, while the package runs, is the package's.
            assert index < imported[0], (f"{event} {args[0]} after the package was imported: the "
                                         "package's own doing, not the interpreter's")
            continue
        # Reading, compiling or unmarshalling and running the package's own code; nothing else.
        assert event in {"open", "compile", "marshal.loads", "exec", "import", "os.listdir"}, (event, args)
        if event == "open":
            path, _mode, flags = args
            # The interpreter may cache our bytecode; nothing else is ever opened for writing.
            writable = flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            allowed = ours / "__pycache__" if writable else ours
            pth = str(env.site_packages / "fsdp_autopatch.pth")
            assert path == pth or Path(path).is_relative_to(allowed), args
        if event == "import":
            assert args[0] == "fsdp_autopatch", args
        if event == "os.listdir":
            # The import system looking for the package (site-packages) and its modules.
            assert Path(args[0]) == env.site_packages or Path(args[0]).is_relative_to(ours), args


# --- import-time faults ------------------------------------------------------------------------


RAISING = {
    # the exception a broken install raises, and the message the user must see
    "ImportError": 'raise ImportError("libtorch_cpu.so: cannot open shared object file")\n',
    "OSError": 'raise OSError(12, "Cannot allocate memory")\n',
    "RuntimeError": 'raise RuntimeError("CUDA driver initialization failed")\n',
}


IMPORT_FAULTS = {
    # (which module raises, the order in which the program imports)
    "torch first": ("torch", ["torch.distributed.fsdp", "transformers"]),
    "transformers first": ("transformers", ["transformers", "torch.distributed.fsdp"]),
    "transformers after torch": ("transformers", ["torch.distributed.fsdp", "transformers"]),
    "fsdp after transformers": ("torch.distributed.fsdp", ["transformers", "torch.distributed.fsdp"]),
}


@pytest.mark.parametrize("error", list(RAISING.values()), ids=list(RAISING))
@pytest.mark.parametrize("fault", list(IMPORT_FAULTS.values()), ids=list(IMPORT_FAULTS))
def test_package_raising_on_import(
    tmp_path: Path, installed: Path, fault: tuple[str, list[str]], error: str
) -> None:
    """The user's import fails exactly as it does with the package switched off."""
    raising, order = fault
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    version = '__version__ = "2.13.0"\n' if raising == "torch" else ""
    write_module(env.site_packages, raising, version + error)
    runs = {mode: env.run_program(TRY_IMPORTS, *order, FSDP_AUTOPATCH=mode) for mode in (None, OFF)}
    for run in runs.values():
        assert (run.returncode, run.stderr) == (0, "")
    with_package, without = (json_lines(r.stdout) for r in runs.values())
    assert with_package == without
    failed = [outcome for outcome in with_package[0]["outcomes"] if outcome[1] != "ok"]
    assert failed and all(outcome[2].split("] ")[-1] in error for outcome in failed)
    # Uncaught, the error the user sees ends in the same line.
    uncaught = {mode: env.run(f"import {order[0]}; import {order[1]}", FSDP_AUTOPATCH=mode)
                for mode in (None, OFF)}
    assert uncaught[None].returncode == uncaught[OFF].returncode == 1
    assert uncaught[None].stderr.splitlines()[-1] == uncaught[OFF].stderr.splitlines()[-1]
    status = json_lines(env.run_program(TRY_IMPORTS, *order, "--status").stdout)[-1]
    # Where torch's FSDP2 package did import, only transformers is waited for.
    expected = "waiting for transformers to be" if raising == "transformers" else "waiting for"
    assert not status["applied"] and status["reason"].startswith(expected), status


# --- hazards: fork, legacy loaders, no stderr ------------------------------------------------




@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX only")
def test_fork_while_another_thread_hands_over(tmp_path: Path, installed: Path) -> None:
    """A child forked while a thread of the parent holds the watcher's lock arms on its own."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    result = env.run_program(PROGRAMS / "fork_during_hand_over.py")
    assert result.returncode == 0, result.stderr
    assert json_lines(result.stdout) == [{"child": 0, "parent_armed": True}], result.stderr




@pytest.mark.parametrize("kind", ["legacy", "read-only spec"])
def test_arming_never_under_the_import_lock(tmp_path: Path, installed: Path, kind: str) -> None:
    """A loader without ``exec_module`` (load_module() only) is wrapped, and a spec whose loader
    cannot be replaced arms at the next import: never inside ``find_spec``, where the global
    import lock is held and importing wrapt could deadlock against another importing thread."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    runs = {mode: env.run_program(PROGRAMS / "stand_in_loader.py", kind, FSDP_AUTOPATCH=mode)
            for mode in (None, OFF)}
    for run in runs.values():
        assert (run.returncode, run.stderr) == (0, ""), run.stderr
    report, unpatched = (json_lines(run.stdout)[0] for run in runs.values())
    # The import itself goes exactly as without the package (3.15 may refuse load_module()).
    assert report["outcome"] == unpatched["outcome"], (report, unpatched)
    if report["outcome"] not in ("LegacyLoader", "PlainLoader"):
        assert True not in report["held"], report
        return
    assert report["held"] == [False], report
    assert not report["watching"], report
    # Armed in auto mode: transformers' hook waits; FSDP2's already ran, for the stand-in.
    assert report["waiting_hooks"] is not None and "transformers" in report["waiting_hooks"], report
    assert "torch.distributed.fsdp" not in report["waiting_hooks"], report
    # The legacy loader's own load_module() armed; a read-only spec's import could not.
    assert report["armed_in_import"] == (kind == "legacy"), report




def test_bad_mode_value_without_stderr(tmp_path: Path, installed: Path) -> None:
    """No stderr to warn on (pythonw): the hand-over still registers every hook."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site_packages)
    fake_transformers(env.site_packages)
    result = env.run_program(PROGRAMS / "no_stderr.py", FSDP_AUTOPATCH="garbage")
    assert (result.returncode, result.stderr) == (0, "")
    (report,) = json_lines(result.stdout)
    # The hooks ran on torch.distributed.fsdp, found its site, and wait for transformers.
    assert report["reason"] == "waiting for transformers to be imported", report
    assert "transformers" in report["waiting_hooks"], report


# --- import-time faults with the real torch and transformers (slow) ----------------------------

SHARD_WITH_FAULT = PROGRAMS / "shard_with_fault.py"


def shard(
    fault: Optional[str] = None, imports: Optional[str] = None, pythonpath: Optional[Path] = None,
    prepared: bool = False, **variables: Optional[str],
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """tests/programs/shard_with_fault.py: the ``fault`` injected, the imports, then one sharded train step
    of an ABC-headed model, in a fresh interpreter or (``prepared``, no fault: nothing before the
    default imports) a prepared one's child."""
    assert not prepared or (fault is None and imports is None and pythonpath is None)
    if pythonpath is not None:
        variables["PYTHONPATH"] = str(pythonpath)
    args = [*(("--fault", fault) if fault else ()), *(("--imports", imports) if imports else ())]
    result = run_program(SHARD_WITH_FAULT, *args, env=environment(**variables), prepared=prepared)
    (report,) = json_lines(result.stdout)
    return report, result


@pytest.fixture(scope="module")
def unpatched(real_torch: dict[str, str]) -> dict[str, Any]:
    """What sharding the ABC-headed model does here with the package off: the layout error,
    or (where this torch and Python have no bug) a sharded model."""
    report, _ = shard(FSDP_AUTOPATCH=OFF, prepared=True)
    assert not report["status"]["applied"]
    if layout_bug_here():
        assert not report["result"]["sharded"] and LAYOUT_ERROR in report["result"]["error"]
    else:
        assert report["result"]["sharded"], report
    return report["result"]


@pytest.fixture(scope="module")
def patched(real_torch: dict[str, str]) -> dict[str, Any]:
    """No fault injected: patched where the bug is (standing aside where not), and the model trains."""
    report, _ = shard(prepared=True)
    assert report["status"]["applied"] is layout_bug_here() and report["result"]["sharded"]
    assert len(report["result"]["losses"]) == 1
    return report


def assert_unpatched_like(report: dict[str, Any], unpatched: dict[str, Any]) -> None:
    assert not report["status"]["applied"]
    assert report["result"]["sharded"] is unpatched["sharded"]
    assert report["result"].get("error") == unpatched.get("error")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", *ci_tier("raising")])
def test_wrapt_unusable_real_imports(
    tmp_path: Path, unpatched: dict[str, Any], patched: dict[str, Any], fault: str
) -> None:
    """torch and transformers import and work, unpatched; status() says why, and, where the bug is
    here, so does one line on stderr, by default: the cause and what to type."""
    exception = ('ModuleNotFoundError("No module named \'wrapt\'", name="wrapt")' if fault == "missing"
                 else 'RuntimeError("wrapt is broken")')
    # PYTHONPATH puts the broken wrapt ahead of the installed one.
    write_module(tmp_path, "wrapt", f"raise {exception}\n")
    report, result = shard(pythonpath=tmp_path)
    assert_unpatched_like(report, unpatched)
    cause, remedy = (("wrapt is not installed", pip_in(sys.executable, "install wrapt")) if fault == "missing"
                     else ("wrapt cannot be imported (RuntimeError: wrapt is broken)",
                           pip_in(sys.executable, "install --force-reinstall wrapt")))
    # The cause first, then what the probe found: torch asked, not the version rows.
    assert report["status"]["reason"].startswith(f"{cause}; {remedy}; ")
    assert ("(probed)" in report["status"]["reason"]) is layout_bug_here()
    said = [f"fsdp-autopatch: cannot fix the layout bug for ABC modules here: {cause} ({remedy})"]
    assert own_lines(result.stderr) == said[:layout_bug_here()] and "Traceback" not in result.stderr
    # Under a launcher, the first process of a node speaks for it: the others say nothing.
    assert own_lines(shard(pythonpath=tmp_path, LOCAL_RANK="1")[1].stderr) == []


@pytest.mark.slow
@pytest.mark.ci_tier
def test_bad_mode_value_real_imports(unpatched: dict[str, Any]) -> None:
    value = "héllo; $(rm -rf ~) ✓"
    report, result = shard(FSDP_AUTOPATCH=value)
    (ours,) = own_lines(result.stderr)
    assert ours.startswith(f"{WARNING_PREFIX}: ignoring FSDP_AUTOPATCH=")
    # An unrecognised value means auto: patched where the bug is, and the model trains.
    assert report["status"]["applied"] is layout_bug_here() and report["status"]["mode"] == "auto"
    assert report["result"]["sharded"] and len(report["result"]["losses"]) == 1


UNUSABLE_VERSIONS = {
    # (transformers/__init__.py, METADATA Version or None for the real installed metadata)
    "missing, metadata usable": ("", None),
    "garbage, metadata garbage": ('__version__ = "not a version"\n', "not-a-version"),
    "not a string, metadata garbage": ("__version__ = (4, 55, 2)\n", "also garbage"),
    "raising": ("def __getattr__(name):\n    raise RuntimeError(f'lazy attribute {name} failed')\n", None),
}


@pytest.mark.slow
@pytest.mark.ci_tier
@pytest.mark.parametrize("fake", list(UNUSABLE_VERSIONS.values()), ids=list(UNUSABLE_VERSIONS))
def test_transformers_without_usable_version(
    tmp_path: Path, real_torch: dict[str, str], fake: tuple[str, Optional[str]]
) -> None:
    source, metadata_version = fake
    write_module(tmp_path, "transformers", source)
    if metadata_version is not None:
        # Found ahead of the real transformers' metadata, as the fake is ahead of the real package.
        info = tmp_path / "transformers-0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: transformers\nVersion: {metadata_version}\n")
    # The fake imports cleanly on its own, so it must import cleanly here too.
    run = run_python(f"import torch.distributed.fsdp, transformers\n{STATUS}",
                     env=environment(PYTHONPATH=str(tmp_path)))
    assert run.returncode == 0, run.stderr[-4000:]
    assert own_lines(run.stderr) == [] and "Traceback" not in run.stderr
    status = status_after(run)
    if source.startswith("def"):
        assert not status["applied"]
        assert "RuntimeError" in status["reason"] and "lazy attribute __version__ failed" in status["reason"]
    elif metadata_version is None:
        # The installed metadata is a fair witness: decided on it, with a note saying so.
        assert status["applied"] is layout_bug_here() and status["transformers"] == real_torch["transformers"]
        assert "transformers.__version__ is unusable (None)" in status["reason"]
        assert f"read {real_torch['transformers']} from its installed metadata" in status["reason"]
    else:
        assert not status["applied"] and status["transformers"] is None
        assert "transformers.__version__ is unusable" in status["reason"]
        assert "no installed version found" in status["reason"]


# Faults injected into the package in the child, before torch is imported (programs/shard_with_fault.py):
# the message each must leave in the status.
INJECTIONS = {
    "install": "injected: install",
    "decide": "injected: decide",
    # fully_shard's site succeeds; the step after it, for another site, fails.
    "replicate site": "injected: replicate site",
}


# replicate()'s site is patched once its module is imported.
WITH_REPLICATE = "torch.distributed.fsdp,transformers,torch.distributed._composable.replicate_with_fsdp"


@pytest.mark.slow
# An install that raises in the README's tests; the other injections in CI's tier.
@pytest.mark.parametrize("injection", ["install", *ci_tier(*(injection for injection in INJECTIONS
                                                                  if injection != "install"))])
def test_patch_raising(unpatched: dict[str, Any], injection: str) -> None:
    """An exception inside the patch never reaches the import, and status() tells the truth.

    Either the program runs unpatched and status() says so with the cause, or it runs patched
    and status() says that: never a patched fully_shard behind a status that denies it.
    """
    message = INJECTIONS[injection]
    report, result = shard(injection, imports=WITH_REPLICATE)
    assert "Traceback" not in result.stderr
    applied, sharded = report["status"]["applied"], report["result"]["sharded"]
    if not layout_bug_here():  # nothing to patch: standing aside, the injected step never runs
        assert not applied and sharded, report
        return
    assert applied == sharded, f"status says applied={applied}, but fully_shard fixed={sharded}: {report}"
    assert message in report["status"]["reason"]
    if not sharded:
        assert_unpatched_like(report, unpatched)
    said = spoken(result.stderr)
    if injection == "decide":  # whether the bug is here is what failed: nothing to say it about
        assert said == []
        return
    # One line: which wrapper stays broken, the cause, what to do.
    (line,) = said
    assert line.startswith("fsdp-autopatch: cannot fix ") and message in line, line
    assert line.endswith("(upgrade fsdp-autopatch, or report it)"), line


def spoken(stderr: str) -> list[str]:
    """The lines the package prints by default (not its log, which a test may have asked for)."""
    return [line for line in stderr.splitlines() if line.startswith("fsdp-autopatch: ")]


@pytest.mark.slow
@pytest.mark.ci_tier
def test_the_fix_raising(unpatched: dict[str, Any]) -> None:
    """A failure of the fix itself leaves fully_shard to fail exactly as torch would: the
    self-check meets it first, so the status says unpatched, and the log says why."""
    report, result = shard("mirror", FSDP_AUTOPATCH_LOG="info")
    assert report["result"]["sharded"] is unpatched["sharded"]
    assert report["result"].get("error") == unpatched.get("error")
    if layout_bug_here():  # a class was needed, and the log that was asked for says why there is none
        assert report["status"]["applied"] is False, report["status"]
        assert "self-check" in report["status"]["reason"]
        assert "RuntimeError: injected: _mirror_for" in report["status"]["reason"]
        assert "injected: _mirror_for" in result.stderr
        # A failed self-check is said by default too: one line, the cause and what to do.
        (line,) = spoken(result.stderr)
        assert line.startswith("fsdp-autopatch: cannot fix FSDP2 fully_shard's layout bug for ABC modules "
                               "here: the fix failed its self-check: ") and "injected: _mirror_for" in line
        assert line.endswith("(upgrade fsdp-autopatch, or report it)")


# transformers first: the decision is then taken when torch.distributed.fsdp finishes importing.
TRANSFORMERS_FIRST = "transformers,torch.distributed.fsdp"


@pytest.mark.slow
@pytest.mark.ci_tier
def test_unknown_fsdp_layout(unpatched: dict[str, Any], patched: dict[str, Any]) -> None:
    """torch's private module without the names this package knows: fully_shard unpatched, reason
    named (composable DDP, imported with FSDP2 and where it always was, is still patched)."""
    report, result = shard("hide fsdp names", imports=TRANSFORMERS_FIRST)
    assert not any(site.endswith(".fully_shard") for site in report["status"]["sites"]), report["status"]
    assert report["result"]["sharded"] is unpatched["sharded"]
    assert report["result"].get("error") == unpatched.get("error")
    assert "FSDP2 layout is unknown" in report["status"]["reason"], report["status"]
    assert "Traceback" not in result.stderr
    said = spoken(result.stderr)
    assert len(said) == layout_bug_here(), said
    start = "fsdp-autopatch: cannot fix FSDP2 fully_shard's layout bug for ABC modules here: "
    assert all(line.startswith(start) and line.endswith("(upgrade fsdp-autopatch)") for line in said)
