"""The test run's progress lines (tests/progress.py): a long test is reported while it runs,
and what the test itself prints is still captured."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from harness import ROOT, scrubbed_environment
from progress import INTERVAL_VARIABLE

SLOW_TESTS = """
    import time

    def test_slow_pass():
        print("printed by the passing test")
        time.sleep(1.6)

    def test_slow_fail():
        print("printed by the failing test")
        time.sleep(1.6)
        assert False
"""


def run_pytest(where: Path, *options: str) -> subprocess.CompletedProcess[str]:
    (where / "test_sleepy.py").write_text(textwrap.dedent(SLOW_TESTS))
    env = scrubbed_environment(PYTHONPATH=str(ROOT / "tests"), **{INTERVAL_VARIABLE: "0.5"})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "progress", "-p", "no:cacheprovider", "--rootdir", str(where),
         "-c", str(where / "empty.ini"), "-v", *options, "test_sleepy.py"],
        cwd=where, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def check(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in ("test_slow_pass", "test_slow_fail"):
        reported = f"still running test_sleepy.py::{name} ("
        assert any(line.startswith(reported) for line in lines), result.stdout
    # Captured as usual: the passing test's output is not shown, the failing test's is, in its report.
    assert "printed by the passing test" not in result.stdout
    captured = result.stdout.split("Captured stdout call", 1)[1]
    assert "printed by the failing test" in captured.splitlines()[1]
    assert "still running" not in captured.split("short test summary")[0]


def test_a_long_test_is_reported_while_it_runs(tmp_path: Path) -> None:
    (tmp_path / "empty.ini").write_text("[pytest]\n")
    check(run_pytest(tmp_path))


def test_reported_by_the_controller_under_xdist(tmp_path: Path) -> None:
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed; the nox sessions install it")
    (tmp_path / "empty.ini").write_text("[pytest]\n")
    check(run_pytest(tmp_path, "-n", "2"))
