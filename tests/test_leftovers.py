"""The suite's guard against leftover processes (``conftest.pytest_sessionfinish``), in a pytest
run of its own: a process a test leaves running fails the run and is killed, whether the tests
ran in one process or under xdist, whose workers carry the session's marker too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import util
from pathlib import Path

import pytest
from conftest import ROOT, alive, environment, needs_proc

LEAVES_A_PROCESS = """
import pathlib, subprocess, sys

def test_starts_a_process(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pathlib.Path({pid_file!r}).write_text(str(process.pid))
    if not {leave}:
        process.kill()
        process.wait()
"""
# The nox session of the tests that need no torch installs no xdist either.
WITH_XDIST = pytest.mark.skipif(util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
# The files the suite's conftest.py needs beside it.
SCAFFOLDING = ("conftest.py", "harness.py", "progress.py", "stress.py")


@needs_proc
@pytest.mark.parametrize("workers", [(), pytest.param(("-n", "2"), marks=WITH_XDIST)],
                         ids=["one process", "xdist"])
@pytest.mark.parametrize("leave", [True, False], ids=["left running", "stopped"])
def test_a_process_left_running_fails_the_session_and_is_killed(
    tmp_path: Path, workers: tuple[str, ...], leave: bool
) -> None:
    for name in SCAFFOLDING:
        shutil.copy2(ROOT / "tests" / name, tmp_path / name)
    pid_file = tmp_path / "started.pid"
    (tmp_path / "test_one.py").write_text(LEAVES_A_PROCESS.format(pid_file=str(pid_file), leave=leave))
    # Not a worker of this session's xdist, whatever this process is.
    env = environment(PYTEST_XDIST_WORKER=None, PYTEST_XDIST_WORKER_COUNT=None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *workers, "test_one.py"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    said = [line for line in result.stdout.splitlines() if "still ran at the end" in line]
    if leave:
        assert result.returncode == 1, result.stdout + result.stderr
        (line,) = said
        assert line.startswith(f"1 process(es) started by the tests still ran at the end and were killed; "
                               f"find the test that left them: {pid_file.read_text()}: ")
    else:
        assert (result.returncode, said) == (0, []), result.stdout + result.stderr
    assert not alive(int(pid_file.read_text()))
