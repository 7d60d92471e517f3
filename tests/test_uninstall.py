"""The package's life in an environment, through real pip: install, reinstall, upgrade, uninstall.

pip itself runs in the environment under test (``pip --python``), so it also shows that pip keeps
working with the start-up line in place. Each step is checked in a new interpreter: exactly one
start-up line of ours, run once; and after ``pip uninstall``, nothing of ours left at all.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import PROGRAMS, ROOT, environment, json_lines, run_program, run_python
from harness import build_wheel, make_venv

# Builds wheels and runs pip: seconds each, so with the slow tests.
pytestmark = pytest.mark.slow

PIP_TIMEOUT = 600
# What the wheel is built from (pyproject.toml's wheel target, force-include, readme, license, and
# hatch_build.py, the hook that writes the long description).
SOURCES = ("fsdp_autopatch", "fsdp_autopatch.pth", "fsdp_autopatch.start", "_fsdp_autopatch_plugin.py",
           "pyproject.toml", "README.md", "LICENSE", "hatch_build.py")


@dataclass(frozen=True)
class Wheels:
    current: Path
    upgrade: Path
    version: str
    upgraded_version: str


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Wheels:
    """This checkout's wheel, and the same code as a later version for the upgrade."""
    work = tmp_path_factory.mktemp("wheels")
    current = build_wheel(work / "current")
    copy = work / "source"
    copy.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif path.exists():
            shutil.copy2(path, copy / name)
    init = copy / "fsdp_autopatch" / "__init__.py"
    text = init.read_text()
    match = re.search(r'^__version__ = "([^"]+)"$', text, flags=re.MULTILINE)
    assert match, "the version is read from fsdp_autopatch/__init__.py"
    version = match.group(1)
    upgraded = f"{version}.post1"
    init.write_text(text.replace(match.group(0), f'__version__ = "{upgraded}"'))
    return Wheels(current, build_wheel(work / "upgrade", copy), version, upgraded)


@dataclass(frozen=True)
class Environment:
    python: Path
    site_packages: Path
    scripts: Path

    @property
    def root(self) -> Path:
        return self.python.parent.parent

    def pip(self, *args: str) -> subprocess.CompletedProcess[str]:
        """pip run by this environment's own interpreter, which reads the start-up line."""
        # Installs are of local wheels only: no index, and no dependency is needed to start up.
        offline = ("--no-index", "--no-deps") if args[0] == "install" else ()
        result = subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(self.python), *args, *offline],
            capture_output=True, text=True, env=environment(), timeout=PIP_TIMEOUT, check=False,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        # site.py reports a failing .pth line as "Error processing line N of ...".
        assert "Traceback" not in result.stderr and "Error processing" not in result.stderr, result.stderr
        return result

    def tree(self) -> list[str]:
        return sorted(str(path.relative_to(self.root)) for path in self.root.rglob("*"))


@pytest.fixture
def target(tmp_path: Path) -> Environment:
    venv = make_venv(tmp_path / "venv")
    return Environment(venv.python, venv.site_packages, venv.scripts)


def ours(site_packages: Path) -> list[str]:
    """What the package put at the root of site-packages: itself, its dist-info, its start-up
    files and the module of torch's plugin entry point."""
    return sorted(path.name for path in site_packages.iterdir()
                  if path.name.lower().lstrip("_").startswith("fsdp_autopatch"))


def start_up_lines(site_packages: Path) -> list[str]:
    """Every line of every .pth in site-packages that would import this package."""
    return [f"{pth.name}: {line}" for pth in sorted(site_packages.glob("*.pth"))
            for line in pth.read_text().splitlines() if "fsdp_autopatch" in line]


COUNTER_MODULE = PROGRAMS / "startup_counter.py"
PROBES = {
    # Sorted before fsdp_autopatch.pth, so the counter is in place when our line runs.
    "00_startup_counter.pth": "import _startup_counter\n",
    "01_startup_counter.pth": "import _startup_counter; _startup_counter.passes += 1\n",
}


def started(env: Environment) -> dict[str, object]:
    """What a new interpreter of ``env`` shows about the start-up code."""
    shutil.copy2(COUNTER_MODULE, env.site_packages / "_startup_counter.py")
    for name, line in PROBES.items():
        (env.site_packages / name).write_text(line)
    try:
        result = run_program(PROGRAMS / "startup_report.py", python=str(env.python),
                             check=False)
    finally:
        for name in ("_startup_counter.py", *PROBES):
            (env.site_packages / name).unlink()
    assert (result.returncode, result.stderr) == (0, "")
    (report,) = json_lines(result.stdout)
    return report


def assert_installed_once(env: Environment, version: str) -> None:
    assert ours(env.site_packages) == ["_fsdp_autopatch_plugin.py", "fsdp_autopatch",
                              f"fsdp_autopatch-{version}.dist-info",
                              "fsdp_autopatch.pth", "fsdp_autopatch.start"]
    assert len(start_up_lines(env.site_packages)) == 1, start_up_lines(env.site_packages)
    report = started(env)
    assert report["version"] == version
    assert report["passes"] >= 1 and report["runs"] == report["passes"], report
    assert report["watchers"] == 1, report
    assert str(report["file"]).startswith(str(env.site_packages))


def test_reinstall_and_upgrade_keep_one_start_up_line(target: Environment, wheels: Wheels) -> None:
    target.pip("install", str(wheels.current))
    assert_installed_once(target, wheels.version)
    target.pip("install", "--force-reinstall", str(wheels.current))
    assert_installed_once(target, wheels.version)
    target.pip("install", "--upgrade", str(wheels.upgrade))
    assert_installed_once(target, wheels.upgraded_version)
    # And back down, as a pinned requirement would do.
    target.pip("install", str(wheels.current))
    assert_installed_once(target, wheels.version)


def test_uninstall_leaves_nothing(target: Environment, wheels: Wheels) -> None:
    # Stands for the rest of an environment: pip removes a directory it leaves empty.
    (target.site_packages / "other_package.py").write_text("")
    before = target.tree()
    target.pip("install", str(wheels.current))
    # Load every module once, so the interpreter has had its chance to leave bytecode behind.
    loaded = run_python(
        "import fsdp_autopatch, fsdp_autopatch._api, fsdp_autopatch._hooks, fsdp_autopatch._verify",
        env=environment(PYTHONDONTWRITEBYTECODE=None), python=str(target.python))
    assert loaded.returncode == 0, loaded.stderr
    target.pip("uninstall", "--yes", "fsdp-autopatch")
    after = target.tree()
    assert ours(target.site_packages) == []
    assert [path for path in after if "fsdp" in path.lower()] == []
    assert after == before
    # A new interpreter imports nothing of ours, and says nothing.
    result = run_python(
        "import importlib.util, json, sys\n"
        "print(json.dumps({'modules': [m for m in sys.modules if 'fsdp' in m],"
        " 'finders': [repr(f) for f in sys.meta_path if 'fsdp' in repr(f)],"
        " 'findable': importlib.util.find_spec('fsdp_autopatch') is not None}))",
        env=environment(), python=str(target.python))
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(result.stdout) == {"modules": [], "finders": [], "findable": False}
