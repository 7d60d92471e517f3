"""Faults at start-up and at import time must never break an interpreter.

The ``.pth`` line runs in every Python process of the environment, pip included, and the hooks
run inside ``import torch`` and ``import transformers``. Each fault is injected into a fresh
interpreter: a throwaway environment holding a copy of the installed package (and fakes of torch
or transformers where only the import machinery is under test), or the test environment itself
with a fault injected before the first import. A fault may cost the patch, never the program.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import stat
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import (
    LAYOUT_ERROR,
    ROOT,
    environment,
    json_lines,
    make_throwaway,
    run_python,
    write_module,
)

WARNING_PREFIX = "fsdp-autopatch"
OFF = "0"


# --- throwaway environments --------------------------------------------------------------------


def fake_torch(where: Path) -> None:
    """Just enough of a torch package for the start-up watcher to see it imported."""
    write_module(where, "torch", '__version__ = "2.13.0"\n')
    write_module(where, "torch.distributed.fsdp", "")


def fake_transformers(where: Path, source: str = '__version__ = "4.55.2"\n') -> None:
    write_module(where, "transformers", source)


def warning_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


STATUS = "import json, fsdp_autopatch; print(json.dumps(fsdp_autopatch.status().to_dict()))"


def status_after(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    (status,) = json_lines(result.stdout)
    return status


# --- start-up faults ---------------------------------------------------------------------------


@pytest.mark.parametrize("left", ["nothing", "only __init__.py"])
def test_package_removed_but_pth_left(tmp_path: Path, installed: Path, left: str) -> None:
    """A half-finished uninstall leaves the .pth behind; every interpreter must still start."""
    env = make_throwaway(tmp_path / "venv", installed)
    fake_torch(env.site)
    fake_transformers(env.site)
    package = env.site / "fsdp_autopatch"
    if left == "nothing":
        shutil.rmtree(package)
    else:
        for path in package.iterdir():
            if path.is_dir():
                shutil.rmtree(path)
            elif path.name != "__init__.py":
                path.unlink()
    imports = "import torch.distributed.fsdp, transformers; print('imported')"
    # A set FSDP_AUTOPATCH makes arm() import the (now missing) configuration module.
    for variables in ({}, {"FSDP_AUTOPATCH": "auto"}, {"FSDP_AUTOPATCH": "force"}):
        started = env.run(**variables)
        assert (started.returncode, started.stderr) == (0, ""), variables
        result = env.run(imports, **variables)
        assert (result.returncode, result.stderr, result.stdout) == (0, "", "imported\n"), variables


@pytest.mark.parametrize("fault", ["missing", "raising"])
def test_wrapt_unusable_without_torch(tmp_path: Path, installed: Path, fault: str) -> None:
    env = make_throwaway(tmp_path / "venv", installed, wrapt=fault != "missing")
    if fault == "raising":
        shutil.rmtree(env.site / "wrapt")
        write_module(env.site, "wrapt", 'raise RuntimeError("wrapt is broken")\n')
    fake_torch(env.site)
    fake_transformers(env.site)
    started = env.run()
    assert (started.returncode, started.stderr) == (0, "")
    result = env.run(f"import torch.distributed.fsdp, transformers\n{STATUS}")
    assert result.stderr == ""
    status = status_after(result)
    assert not status["applied"]
    assert "wrapt could not be imported" in status["reason"]
    assert ("ModuleNotFoundError" if fault == "missing" else "wrapt is broken") in status["reason"]
    # Asked for, the same fault is reported on stderr: the silence above is not blindness.
    logged = env.run("import torch", FSDP_AUTOPATCH_LOG="warning")
    assert logged.returncode == 0
    assert [line for line in warning_lines(logged.stderr) if "wrapt could not be imported" in line]


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
    fake_torch(env.site)
    fake_transformers(env.site)
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


@pytest.mark.parametrize("value", ["garbage", "DEBUG; rm -rf /", "☃" * 50, "x" * 100_000, ""])
def test_log_variable_garbage(tmp_path: Path, installed: Path, value: str) -> None:
    # Without wrapt there is a warning to log, so a garbage value that turned logging on would show.
    env = make_throwaway(tmp_path / "venv", installed, wrapt=False)
    fake_torch(env.site)
    fake_transformers(env.site)
    for code in ("pass", "import torch.distributed.fsdp, transformers"):
        result = env.run(code, FSDP_AUTOPATCH_LOG=value)
        assert (result.returncode, result.stderr) == (0, ""), code
    control = env.run("import torch", FSDP_AUTOPATCH_LOG="warning")
    assert "wrapt could not be imported" in control.stderr


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
    fake_torch(env.site)
    fake_transformers(env.site)
    importtime = flags == ["-X", "importtime"]

    def own_output(stderr: str) -> list[str]:
        # -X importtime reports on stderr by design; anything else there would be ours.
        return [line for line in stderr.splitlines() if not (importtime and line.startswith("import time:"))]

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
        imported = [line.rsplit("|", 1)[-1].strip() for line in started.stderr.splitlines()]
        assert [name for name in imported if "fsdp" in name or "wrapt" in name] == ["fsdp_autopatch"]
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
    fake_torch(env.site)
    fake_transformers(env.site)
    # Without bytecode the interpreter would like to write some: it must quietly not.
    for cache in list(env.site.rglob("__pycache__")):
        shutil.rmtree(cache)
    prefix = _as_plain_owner()
    before = _tree(env.site)
    folders = [env.site, *[p for p in env.site.rglob("*") if p.is_dir()]]
    for folder in folders:
        folder.chmod(stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    try:
        for code in ("pass", f"import torch.distributed.fsdp, transformers\n{STATUS}"):
            result = subprocess.run(
                [*prefix, str(env.python), "-c", code], capture_output=True, text=True, check=False,
                env=environment(PYTHONDONTWRITEBYTECODE=None), cwd=tmp_path, timeout=120,
            )
            assert (result.returncode, result.stderr) == (0, ""), code
        assert "waiting for" in status_after(result)["reason"]
    finally:
        for folder in folders:
            folder.chmod(0o755)
    assert _tree(env.site) == before


# --- what runs at start-up, checked against the README's description ---------------------------


def _pth_line(installed: Path) -> str:
    text = (installed / "fsdp_autopatch.pth").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) == 1 and text.endswith("\n"), "the .pth must be exactly one line"
    return lines[0]


def _names(node: ast.AST) -> list[ast.AST]:
    return list(ast.walk(node))


def test_pth_is_the_documented_line(installed: Path) -> None:
    """One line; imports os and then only this package's bootstrap; reads FSDP_AUTOPATCH only."""
    line = _pth_line(installed)
    assert (ROOT / "fsdp_autopatch.pth").read_text(encoding="utf-8") == line + "\n"
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
    variables = [n.args[0].value for n in _names(switch)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"]
    assert variables == ["FSDP_AUTOPATCH"]
    assert "environ" in ast.dump(switch)
    off_values = next(n for n in _names(switch) if isinstance(n, ast.Tuple))
    from fsdp_autopatch import _config

    assert tuple(ast.literal_eval(off_values)) == _config.OFF_VALUES
    # exec of a string literal: what it runs is fixed in the file, never taken from outside.
    assert isinstance(bootstrap, ast.Call) and ast.unparse(bootstrap.func) == "exec"
    (argument,) = bootstrap.args
    assert isinstance(argument, ast.Constant) and isinstance(argument.value, str)
    inner = ast.parse(argument.value)
    imports = [n for n in _names(inner) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert [(i.module, [a.name for a in i.names]) for i in imports] == [("fsdp_autopatch", ["arm"])]  # type: ignore[union-attr]
    calls = [ast.unparse(n.func) for n in _names(inner) if isinstance(n, ast.Call)]
    assert calls == ["arm"]
    # Every name either part of the condition or the bootstrap is accounted for: no open(),
    # no __import__, no sys.path, no other variable.
    names = {n.id for n in _names(outer) if isinstance(n, ast.Name)} | {
        n.id for n in _names(inner) if isinstance(n, ast.Name)}
    assert names == {"os", "exec", "arm", "Exception"}
    assert (installed / "fsdp_autopatch.start").read_text(encoding="utf-8").splitlines() == [
        "fsdp_autopatch:arm"]


AUDIT_MODULE = """
import sys

events = []
recording = True


def _record(event, args):
    if recording:
        events.append([event, [a if isinstance(a, (str, int)) or a is None else repr(a) for a in args]])


sys.addaudithook(_record)
"""


@pytest.mark.parametrize("variables", [{}, {"FSDP_AUTOPATCH": "not a mode"}], ids=["unset", "set"])
def test_start_up_touches_only_its_own_files(
    tmp_path: Path, installed: Path, variables: dict[str, str]
) -> None:
    """Audit events between the .pth files sorted around ours: only reads of our own files."""
    env = make_throwaway(tmp_path / "venv", installed)
    (env.site / "_startup_audit.py").write_text(AUDIT_MODULE)
    (env.site / "00_startup_audit.pth").write_text("import _startup_audit\n")
    (env.site / "zz_startup_audit.pth").write_text(
        "import _startup_audit; _startup_audit.recording = False\n")
    code = "import json, _startup_audit; print(json.dumps(_startup_audit.events))"
    result = env.run(code, PYTHONDONTWRITEBYTECODE=None, **variables)
    assert (result.returncode, result.stderr) == (0, "")
    (events,) = [json.loads(line) for line in result.stdout.splitlines()]
    ours = env.site / "fsdp_autopatch"
    assert events, "the audit hook recorded nothing: the check would be blind"
    for event, args in events:
        if event == "open" and args[0].endswith("zz_startup_audit.pth"):
            break  # the next .pth: ours is done
        # Reading, compiling or unmarshalling and running the package's own code; nothing else.
        assert event in {"open", "compile", "marshal.loads", "exec", "import", "os.listdir"}, (event, args)
        if event == "open":
            path, _mode, flags = args
            # The interpreter may cache our bytecode; nothing else is ever opened for writing.
            writable = flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            allowed = ours / "__pycache__" if writable else ours
            assert path == str(env.site / "fsdp_autopatch.pth") or Path(path).is_relative_to(allowed), args
        if event == "import":
            assert args[0] in {"fsdp_autopatch", "fsdp_autopatch._config"}, args
        if event == "os.listdir":
            # The import system looking for the package (site-packages) and its modules.
            assert Path(args[0]) == env.site or Path(args[0]).is_relative_to(ours), args


# --- import-time faults ------------------------------------------------------------------------


TRY_IMPORTS = """
import json, sys, traceback
# Frames of the import machinery itself, which differ with any import hook in the chain (see below).
HIDDEN = ("fsdp_autopatch", "wrapt", "<frozen importlib")
outcomes = []
for name in {names!r}:
    for attempt in range(2):  # a failed import must fail again the same way when retried
        try:
            __import__(name)
            outcomes.append([name, "ok"])
        except BaseException as error:
            outcomes.append([name, type(error).__name__, str(error),
                             [f.name for f in traceback.extract_tb(error.__traceback__)
                              if not any(part in f.filename for part in HIDDEN)]])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({{"outcomes": outcomes, "loaded": loaded}}))
"""
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
    fake_torch(env.site)
    fake_transformers(env.site)
    write_module(env.site, raising, ('__version__ = "2.13.0"\n' if raising == "torch" else "") + error)
    code = TRY_IMPORTS.format(names=order)
    runs = {mode: env.run(code, FSDP_AUTOPATCH=mode) for mode in (None, OFF)}
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
    status = json_lines(env.run(f"{code}\n{STATUS}").stdout)[-1]
    assert not status["applied"] and "waiting for" in status["reason"]


# --- import-time faults with the real torch and transformers (slow) ----------------------------

SHARD = """
import json, sys
import torch.distributed as dist
{imports}
import fsdp_autopatch
from fsdp_autopatch import _verify

mesh = _verify.init_process_group()
result = _verify.shard_and_train("token-classification", mesh, steps=1)
dist.destroy_process_group()
print(json.dumps({{"status": fsdp_autopatch.status().to_dict(), "result": result}}))
"""
DEFAULT_IMPORTS = "import torch.distributed.fsdp, transformers"


def shard(
    prelude: str = "", imports: str = DEFAULT_IMPORTS, pythonpath: Optional[Path] = None,
    **variables: Optional[str],
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run ``prelude``, the imports, then one sharded train step of an ABC-headed model."""
    if pythonpath is not None:
        variables["PYTHONPATH"] = str(pythonpath)
    code = textwrap.dedent(prelude) + SHARD.format(imports=imports)
    result = run_python(code, env=environment(**variables))
    assert result.returncode == 0, result.stderr[-4000:]
    (report,) = json_lines(result.stdout)
    return report, result


@pytest.fixture(scope="module")
def unpatched(real_torch: dict[str, str]) -> dict[str, Any]:
    """The bug in this environment: what sharding the ABC-headed model does with the package off."""
    report, _ = shard(FSDP_AUTOPATCH=OFF)
    assert not report["status"]["applied"]
    assert not report["result"]["sharded"] and LAYOUT_ERROR in report["result"]["error"]
    return report["result"]


@pytest.fixture(scope="module")
def patched(real_torch: dict[str, str]) -> dict[str, Any]:
    """The fix in this environment, with no fault injected: patched, and the model trains."""
    report, _ = shard()
    assert report["status"]["applied"] and report["result"]["sharded"]
    assert len(report["result"]["losses"]) == 1
    return report


def assert_unpatched_like(report: dict[str, Any], unpatched: dict[str, Any]) -> None:
    assert not report["status"]["applied"]
    assert report["result"]["sharded"] is False
    assert report["result"]["error"] == unpatched["error"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["missing", "raising"])
def test_wrapt_unusable_real_imports(
    tmp_path: Path, unpatched: dict[str, Any], patched: dict[str, Any], fault: str
) -> None:
    """torch and transformers import and work, unpatched; status() says why."""
    exception = ('ModuleNotFoundError("No module named \'wrapt\'", name="wrapt")' if fault == "missing"
                 else 'RuntimeError("wrapt is broken")')
    # PYTHONPATH puts the broken wrapt ahead of the installed one.
    write_module(tmp_path, "wrapt", f"raise {exception}\n")
    report, result = shard(pythonpath=tmp_path)
    assert_unpatched_like(report, unpatched)
    assert "wrapt could not be imported" in report["status"]["reason"]
    assert WARNING_PREFIX not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_bad_mode_value_real_imports(unpatched: dict[str, Any]) -> None:
    value = "héllo; $(rm -rf ~) ✓"
    report, result = shard(FSDP_AUTOPATCH=value)
    ours = [line for line in result.stderr.splitlines() if WARNING_PREFIX in line]
    assert len(ours) == 1 and ours[0].startswith(f"{WARNING_PREFIX}: ignoring FSDP_AUTOPATCH=")
    # An unrecognised value means auto: patched, and the model trains where it did not unpatched.
    assert report["status"]["applied"] and report["status"]["mode"] == "auto"
    assert report["result"]["sharded"] and len(report["result"]["losses"]) == 1


UNUSABLE_VERSIONS = {
    # (transformers/__init__.py, METADATA Version or None for the real installed metadata)
    "missing, metadata usable": ("", None),
    "garbage, metadata garbage": ('__version__ = "not a version"\n', "not-a-version"),
    "not a string, metadata garbage": ("__version__ = (4, 55, 2)\n", "also garbage"),
    "raising": ("def __getattr__(name):\n    raise RuntimeError(f'lazy attribute {name} failed')\n", None),
}


@pytest.mark.slow
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
    assert WARNING_PREFIX not in run.stderr and "Traceback" not in run.stderr
    status = status_after(run)
    if source.startswith("def"):
        assert not status["applied"]
        assert "RuntimeError" in status["reason"] and "lazy attribute __version__ failed" in status["reason"]
    elif metadata_version is None:
        # The installed metadata is a fair witness: patched, with a note saying so.
        assert status["applied"] and status["transformers"] == real_torch["transformers"]
        assert "transformers.__version__ is unusable (None)" in status["reason"]
        assert f"read {real_torch['transformers']} from its installed metadata" in status["reason"]
    else:
        assert not status["applied"] and status["transformers"] is None
        assert "transformers.__version__ is unusable" in status["reason"]
        assert "no installed version found" in status["reason"]


# Faults injected into the package in the child, before torch is imported: (message, code).
INJECTIONS = {
    "install_fully_shard": ("injected: install_fully_shard", """
        import fsdp_autopatch._patch as patch

        def install_fully_shard():
            raise RuntimeError("injected: install_fully_shard")

        patch.install_fully_shard = install_fully_shard
    """),
    "decide": ("injected: decide", """
        import fsdp_autopatch._matrix as matrix

        def decide(*args, **kwargs):
            raise ValueError("injected: decide")

        matrix.decide = decide
    """),
    # fully_shard's site succeeds; the step after it, for replicate(), fails.
    "replicate site": ("injected: replicate site", """
        import fsdp_autopatch._patch as patch

        real_patch_site = patch.patch_site

        def patch_site(site):
            if site is patch.REPLICATE_SITE:
                raise RuntimeError("injected: replicate site")
            return real_patch_site(site)

        patch.patch_site = patch_site
    """),
}


@pytest.mark.slow
@pytest.mark.parametrize("injection", list(INJECTIONS.values()), ids=list(INJECTIONS))
def test_patch_raising(unpatched: dict[str, Any], injection: tuple[str, str]) -> None:
    """An exception inside the patch never reaches the import, and status() tells the truth.

    Either the program runs unpatched and status() says so with the cause, or it runs patched
    and status() says that: never a patched fully_shard behind a status that denies it.
    """
    message, code = injection
    report, result = shard(code)
    assert "Traceback" not in result.stderr
    applied, sharded = report["status"]["applied"], report["result"]["sharded"]
    assert applied == sharded, f"status says applied={applied}, but fully_shard fixed={sharded}: {report}"
    assert message in report["status"]["reason"]
    if not sharded:
        assert_unpatched_like(report, unpatched)


@pytest.mark.slow
def test_class_building_raising(unpatched: dict[str, Any]) -> None:
    """A failure building one class leaves fully_shard to fail exactly as torch would."""
    injection = """
        import fsdp_autopatch._layout as layout

        def build_wrapper_class(*args, **kwargs):
            raise RuntimeError("injected: build_wrapper_class")

        layout.build_wrapper_class = build_wrapper_class
    """
    report, result = shard(injection, FSDP_AUTOPATCH_LOG="warning")
    assert report["result"]["sharded"] is False
    assert report["result"]["error"] == unpatched["error"]
    assert "injected: build_wrapper_class" in result.stderr  # the log that was asked for


# torch "moves" the names this package patches: they are gone from the module global namespace
# when the package's hook looks, as they would be in a torch release that renamed them.
HIDE_FSDP_NAMES = """
import sys
import wrapt

FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
moved = {}


def move_names(module):
    # Runs before the package's own hook: wrapt calls hooks in the order they were registered.
    moved["cls_to_fsdp_cls"] = sys.modules[FULLY_SHARD].__dict__.pop("cls_to_fsdp_cls")


wrapt.register_post_import_hook(move_names, "torch.distributed.fsdp")
"""
# transformers first: the decision is then taken when torch.distributed.fsdp finishes importing.
IMPORTS_THEN_RESTORE = """
import transformers
import torch.distributed.fsdp
# torch's own code looks the cache up by this name, so it goes back for fully_shard to run.
sys.modules[FULLY_SHARD].cls_to_fsdp_cls = moved["cls_to_fsdp_cls"]
"""


@pytest.mark.slow
def test_unknown_fsdp_layout(unpatched: dict[str, Any], patched: dict[str, Any]) -> None:
    """torch's private module without the names this package knows: unpatched, reason named."""
    report, result = shard(HIDE_FSDP_NAMES, imports=IMPORTS_THEN_RESTORE)
    assert_unpatched_like(report, unpatched)
    assert "UnknownLayout" in report["status"]["reason"]
    assert "cls_to_fsdp_cls" in report["status"]["reason"]
    assert "Traceback" not in result.stderr
