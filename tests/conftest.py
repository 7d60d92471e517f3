"""Shared test helpers: fresh interpreters of the environment under test, and what they print.

Claims about start-up and about fully_shard are checked in fresh subprocesses of
``sys.executable``, so the installed ``fsdp_autopatch.pth`` is what runs, exactly as for a user.
``nox -f tests/noxfile.py -s tests`` builds that environment: the package from a wheel, torch
2.13.0 (CPU) and transformers 4.55.2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = ROOT / "tests" / "scenario.py"
# Set by the nox sessions: a missing prerequisite there is a failure, not a skip.
REQUIRE_VARIABLE = "FSDP_AUTOPATCH_TEST_REQUIRE"


def environment(**overrides: Optional[str]) -> dict[str, str]:
    """This process's environment without any FSDP_AUTOPATCH* switch, plus ``overrides``
    (a None value removes the variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_AUTOPATCH")}
    env.pop("PYTHONPATH", None)
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_python(
    code: str = "pass",
    *flags: str,
    env: Optional[dict[str, str]] = None,
    python: str = sys.executable,
    cwd: Optional[Path] = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (``python *flags -c code``) away from the checkout."""
    return subprocess.run(
        [python, *flags, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=environment() if env is None else env,
        cwd=cwd or Path(sysconfig.get_paths()["purelib"]).parent, timeout=timeout, check=False,
    )


def json_lines(output: str) -> list[dict[str, Any]]:
    """The JSON objects a child printed one per line, ignoring anything else it printed."""
    objects = []
    for line in output.splitlines():
        if line.startswith("{"):
            try:
                objects.append(json.loads(line))
            except ValueError:
                pass
    return objects


def run_scenario(
    *args: str, env: Optional[dict[str, str]] = None, timeout: float = 600
) -> list[dict[str, Any]]:
    """Run tests/scenario.py in a fresh interpreter; fail with its stderr if it fails."""
    result = subprocess.run(
        [sys.executable, str(SCENARIO), *args], capture_output=True, text=True,
        env=environment() if env is None else env, timeout=timeout, check=False,
        cwd=Path(sysconfig.get_paths()["purelib"]).parent,
    )
    assert result.returncode == 0, f"scenario {args} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return json_lines(result.stdout)


def _missing(what: str) -> None:
    if os.environ.get(REQUIRE_VARIABLE):
        pytest.fail(f"{what}; this session requires it")
    pytest.skip(f"{what}; run the tests with: nox -f tests/noxfile.py -s tests")


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="session")
def installed() -> Path:
    """site-packages of this interpreter, holding an installed (not source) fsdp_autopatch."""
    where = site_packages()
    if not (where / "fsdp_autopatch.pth").is_file():
        _missing(f"fsdp_autopatch.pth is not installed in {where}")
    return where


@pytest.fixture(scope="session")
def real_torch(installed: Path) -> dict[str, str]:
    """torch and transformers versions of the environment (read without importing them)."""
    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            _missing(f"{package} is not installed")
    return versions
