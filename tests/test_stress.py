"""The stress mark (tests/stress.py): exactly the tests its table names are kept out of the
default session, and a table entry without its test stops the run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness import ROOT, scrubbed_environment
from stress import STRESS


def collect(*options: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", *options],
        cwd=cwd, env=scrubbed_environment(), capture_output=True, text=True, timeout=300, check=False,
    )


def test_the_stress_session_selects_exactly_the_table() -> None:
    result = collect("-m", "stress", "tests")
    assert result.returncode == 0, result.stdout + result.stderr
    selected = {line for line in result.stdout.splitlines() if "::" in line}
    assert selected == {f"tests/{module}::{name}" for module, names in STRESS.items() for name in names}


def test_a_stale_table_entry_is_an_error(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    stress: x\n")
    (tests / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
                                       "pytest_plugins = ['stress']\n")
    # Named in the table, but its test was renamed.
    module, _ = next(iter(STRESS.items()))
    (tests / module).write_text("def test_renamed():\n    pass\n")
    result = collect("tests", cwd=tmp_path)
    assert result.returncode != 0
    assert "tests/stress.py names" in result.stdout + result.stderr
