"""The README's commands run as written: its ``sh`` blocks, in order, from a fresh shell.

Every ``sh`` block of README.md is run, in the order printed, by one ``bash`` in an empty
directory, with ``python3`` on ``PATH`` being this interpreter's base Python. Each command must
exit as the README shows: 0, or the ``exit N`` its comment names. Two substitutions, both so that
the test runs without the network and against this checkout:

- ``git clone`` of the project URL becomes a local ``git clone`` of this checkout (what is
  committed: uncommitted changes to the package are not in the clone);
- torch, transformers and wrapt come from this test environment: right after the clone, the
  ``.venv`` the README goes on to make is made with a ``.pth`` file pointing at a view of this
  environment's site-packages without fsdp-autopatch (pip then finds them installed, and
  ``pip install .`` installs only the package, built from the clone).

The block holding the test command (``nox -f tests/noxfile.py -s tests``) is not run: it is what
runs these tests.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, environment, layout_bug_here, lent_site_packages, repository_file
from harness import README
from verify_output import FIXED_VERDICT, assert_verify_shows_the_fix

from fsdp_autopatch._console import SOURCE_URL as PROJECT_URL

TEST_COMMAND = "nox -f tests/noxfile.py -s tests"
SH_BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
EXPECTED_EXIT = re.compile(r"#.*\bexit (\d+)\b")
VERIFY = re.compile(r"fsdp-autopatch verify\b")


def sh_blocks(text: str) -> list[str]:
    return [match.group(1) for match in SH_BLOCK.finditer(text)]


def commands(block: str) -> list[tuple[str, int]]:
    """The block's commands (backslash continuations joined), each with the exit code the
    README shows for it."""
    joined = block.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        expected = EXPECTED_EXIT.search(line)
        found.append((line.strip(), int(expected.group(1)) if expected else 0))
    return found


def script(blocks: list[str], clone: str) -> str:
    """One bash script: every command, then a check of its exit code against the README's."""
    lines = ["set -u"]
    for number, block in enumerate(blocks, 1):
        for command, expected in commands(block):
            run = command.replace(f"git clone {PROJECT_URL}", clone)
            described = shlex.quote(f"block {number}: {command}")
            shown = shlex.quote(f"$ {command}")
            lines += [
                f"echo {shown}; echo {shown} >&2",  # on both streams: per_command() splits there
                run,
                f'code=$?; if [ "$code" != {expected} ]; then printf "README COMMAND FAILED (%s): exit %s, '
                f'the README shows {expected}\\n" {described} "$code" >&2; exit 1; fi',
            ]
    return "\n".join(lines) + "\n"


def per_command(text: str, shown: list[str]) -> dict[str, str]:
    """Each command's share of a stream of the script above: from its ``$ command`` line to the
    next command's."""
    parts: dict[str, list[str]] = {}
    current = None
    waiting = list(shown)
    for line in text.splitlines():
        if waiting and line == f"$ {waiting[0]}":
            current = waiting.pop(0)
            parts[current] = []
        elif current is not None:
            parts[current].append(line)
    return {command: "\n".join(lines) + "\n" for command, lines in parts.items()}


def test_the_readme_shows_its_commands_in_sh_blocks() -> None:
    blocks = sh_blocks(README.read_text(encoding="utf-8"))
    assert any(f"git clone {PROJECT_URL}" in block for block in blocks)
    assert any(TEST_COMMAND in block for block in blocks)
    shown = [command for block in blocks for command, _ in commands(block)]
    assert any(command.endswith("fsdp-autopatch verify") for command in shown)
    assert any("FSDP_AUTOPATCH=0" in command for command in shown)
    assert any("pip uninstall -y fsdp-autopatch" in command for command in shown)
    # What .ci/run runs is the README's test command, word for word.
    test_lines = [line for block in blocks for line in block.splitlines() if TEST_COMMAND in line]
    ci = repository_file(".ci/run").read_text(encoding="utf-8").splitlines()
    assert test_lines and all(line in ci for line in test_lines)


@pytest.mark.slow
def test_the_readme_commands_run_as_printed(
    installed: Path, real_torch: dict[str, str], tmp_path: Path
) -> None:
    if sys.platform == "win32":
        pytest.skip("the README's commands are POSIX shell")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout to clone")
    blocks = [block for block in sh_blocks(README.read_text(encoding="utf-8")) if TEST_COMMAND not in block]

    # python3 on PATH: this environment's base interpreter, whose version the lent torch was built for.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    base = getattr(sys, "_base_executable", None) or sys.executable
    (bin_dir / "python3").symlink_to(os.path.realpath(base))
    lent = lent_site_packages(tmp_path / "lent")
    prepare = tmp_path / "prepare-venv.py"
    prepare.write_text(
        "import sys, sysconfig\n"
        "from pathlib import Path\n"
        f"sys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from harness import make_venv\n"
        "venv = make_venv(Path(sys.argv[1]))\n"
        f"(venv.site_packages / 'zz-readme-test-lent.pth').write_text({str(lent)!r} + '\\n')\n"
    )
    clone = (f"git clone --quiet {shlex.quote(str(ROOT))} fsdp-autopatch && "
             f"python3 {shlex.quote(str(prepare))} fsdp-autopatch/.venv")
    work = tmp_path / "shell"
    work.mkdir()
    env = environment(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                      PIP_DISABLE_PIP_VERSION_CHECK="1")
    text = script(blocks, clone)
    result = subprocess.run(["bash", "-c", text], cwd=work, capture_output=True, text=True, env=env,
                            timeout=1800, check=False)
    assert result.returncode == 0, (
        f"{result.stderr[-4000:]}\n--- output ---\n{result.stdout[-6000:]}\n--- script ---\n{text}")
    # The commands ran: verify shards and trains every model with the patch, and shows the bug
    # without it (the switch off), line by line.
    shown = [(command, code) for block in blocks for command, code in commands(block)]
    stdout = per_command(result.stdout, [command for command, _ in shown])
    stderr = per_command(result.stderr, [command for command, _ in shown])
    verifies = {"FSDP_AUTOPATCH=0" in command: subprocess.CompletedProcess(command, code, stdout[command],
                                                                           stderr[command])
                for command, code in shown if VERIFY.search(command)}
    assert sorted(verifies) == [False, True], shown
    assert_verify_shows_the_fix(verifies[False], verifies[True], layout_bug_here())


README_LINES = 170
UV_BLOCK = re.compile(r"^```bash\n(uv venv.*?)^```", re.S | re.M)


def test_the_readme_fits_its_lines_and_quotes_verify_as_it_prints() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_LINES
    # The OK line verify prints where the start-up file armed it (tests/verify_output.py checks
    # that verify prints exactly this, in the README's own commands above).
    assert f"```text\n{FIXED_VERDICT}\n```" in text


def test_the_uv_steps_are_the_pip_steps_with_uvs_cpu_torch() -> None:
    """The uv block is not run here (its CPU index, download.pytorch.org, is out of this
    machine's reach): it must be the pip block's install, verify and uninstall, with uv's own
    switch for torch's CPU build."""
    text = README.read_text(encoding="utf-8")
    (uv,) = UV_BLOCK.findall(text)
    pip = next(block for block in sh_blocks(text) if "pip install ." in block)
    (pip_install,) = [line for line in pip.splitlines() if "pip install ." in line]
    packages = re.search(r"pip install (\. [^&]+?) &&", pip_install).group(1)  # type: ignore[union-attr]
    installing, uninstalling = uv.splitlines()
    assert installing == (f"uv venv && uv pip install {packages} --torch-backend=cpu && "
                          ".venv/bin/fsdp-autopatch verify")
    assert installing.endswith(pip_install.split(" && ")[-1])
    assert uninstalling.startswith("uv pip uninstall fsdp-autopatch ")


def test_commands_and_their_expected_exit_codes_are_read_from_the_block() -> None:
    block = "# a comment\necho one \\\n  two\nfalse   # fails: exit 1\n\ntrue\n"
    assert commands(block) == [("echo one    two", 0), ("false   # fails: exit 1", 1), ("true", 0)]
    assert sh_blocks("text\n```sh\nls\n```\n```text\nno\n```\n") == ["ls\n"]
