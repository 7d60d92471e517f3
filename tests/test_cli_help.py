"""What ``--help`` promises: exit codes that each mean one thing, an install that works today, and
verify's measured time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT, make_throwaway, pip_in
from test_cli import add_distribution, one_object, run_cli

from fsdp_autopatch import _cli, _console

# A bare "pip install fsdp-autopatch" (options allowed before the name): the package is not on
# PyPI, so that would install nothing, or someone else's upload.
BARE_INSTALL = re.compile(r"pip install (?:--?\S+ )*[\"']?fsdp-autopatch(?![\w-]*\s*@)")


def help_of(*command: str) -> str:
    shown = run_cli(*command, "--help")
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def project_url(name: str) -> str:
    """An entry of pyproject.toml's [project.urls] (read without tomllib, absent before 3.11)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    table = text.split("[project.urls]", 1)[1].split("\n[", 1)[0]
    match = re.search(rf'^{name}\s*=\s*"([^"]+)"', table, re.MULTILINE)
    assert match is not None, f"no {name} in [project.urls]"
    return match.group(1)


def test_the_install_command_names_the_projects_source_url() -> None:
    assert _console.SOURCE_URL == project_url("Source")
    assert _console.REQUIREMENT == f'"fsdp-autopatch @ git+{project_url("Source")}"'
    assert not BARE_INSTALL.search(f"{_console.DOCKERFILE_LINE} pip {_console.REINSTALL_ARGUMENTS}")


@pytest.mark.parametrize("text, bare", [
    ("RUN pip install fsdp-autopatch && fsdp-autopatch verify", True),
    ("reinstall: pip install --force-reinstall fsdp-autopatch", True),
    ('pip install "fsdp-autopatch"', True),
    ('pip install "fsdp-autopatch @ git+https://example.invalid/x"', False),
    ("pip install wrapt", False),
])
def test_the_bare_install_pattern(text: str, bare: bool) -> None:
    assert bool(BARE_INSTALL.search(text)) is bare


def test_no_help_names_an_install_that_does_not_work_today(installed: Path) -> None:
    for command in ((), ("doctor",), ("verify",)):
        text = help_of(*command)
        assert not BARE_INSTALL.search(text), (command, text)
    assert _console.DOCKERFILE_LINE in help_of().splitlines()[-1]


def test_the_dockerfile_line_is_the_same_in_the_readme_and_the_help(installed: Path) -> None:
    """One line to copy, wherever it is read: the README's dockerfile block is the help's line."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"^```dockerfile\n(.*?)^```", readme, re.S | re.M)
    assert block.strip() == _console.DOCKERFILE_LINE
    assert help_of().splitlines()[-1].strip() == _console.DOCKERFILE_LINE


def test_doctors_remedy_for_a_half_install_reinstalls_from_the_repository(
    installed: Path, tmp_path: Path
) -> None:
    """Neither start-up file nor torch's entry point installed: a reinstall, named right. Where
    only the start-up files are gone (tooling strips .pth files) and torch's plugin arms, doctor
    is content and advises nothing (tests/test_cli.py)."""
    throwaway = make_throwaway(tmp_path / "venv", installed, pth=False)
    for dist_info in throwaway.site_packages.glob("fsdp_autopatch-*.dist-info"):
        (dist_info / "entry_points.txt").unlink()
    add_distribution(throwaway.site_packages, "torch", "2.13.0",
                     {"torch/__init__.py": '__version__ = "2.13.0"\n'})
    add_distribution(throwaway.site_packages, "transformers", "4.55.2",
                     {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
    command = [str(throwaway.python), "-m", "fsdp_autopatch"]
    shown = run_cli("doctor", command=command)
    report = one_object(run_cli("doctor", "--json", command=command).stdout)
    assert (report["startup_read"], report["plugin_arms"]) == (False, False)
    if report["in_matrix"]:
        reinstall = pip_in(throwaway.python, _console.REINSTALL_ARGUMENTS)
        assert f"        reinstall: {reinstall}" in shown.stdout.splitlines(), shown.stdout
    assert not BARE_INSTALL.search(shown.stdout)


def exit_code_lines(text: str) -> dict[int, str]:
    """``exit codes:`` section of a help text: code -> its (joined) description."""
    section = text.split("exit codes (the verdict):\n", 1)[1]
    codes: dict[int, str] = {}
    current = None
    for line in section.splitlines():
        match = re.match(r"^  (\d+)\s+(.*)$", line)
        if match:
            current = int(match.group(1))
            codes[current] = match.group(2)
        elif line.startswith("       ") and current is not None:
            codes[current] += " " + line.strip()
        elif not line.strip():
            break
        else:
            current = None
    return codes


def test_help_lists_each_exit_code_once_with_one_meaning(installed: Path) -> None:
    doctor = exit_code_lines(help_of("doctor"))
    assert set(doctor) == {0, 1, 2, 130, 141}
    assert doctor[0].startswith("OK: ") and doctor[1].startswith("PROBLEM: ")
    assert doctor[2].startswith("CANNOT TELL from files: ")
    assert all(words in doctor[2] for words in ("source tree", "newer than the version matrix", "layout"))
    verify = exit_code_lines(help_of("verify"))
    assert set(verify) == {0, 1, 2, 130, 141, 143}
    assert "never" not in verify[1] and "killed from outside" in verify[2]
    assert (_console.EXIT_CLOSED_PIPE, _console.EXIT_INTERRUPTED, _console.EXIT_CANNOT_TELL) == (141, 130, 2)


def test_verify_help_states_its_measured_time(installed: Path) -> None:
    text = " ".join(help_of("verify").split())
    assert f"It takes {_cli.VERIFY_SECONDS}" in text
    assert re.fullmatch(r"\d+ - \d+ s on 2 CPU cores with one rank", _cli.VERIFY_SECONDS)
    assert _cli.VERIFY_SECONDS in " ".join(help_of().split())

