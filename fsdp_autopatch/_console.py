"""What the command's modules share: names, exit codes, the install command, the console.
It imports none of them, so the command's modules import downward only."""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import IO, Optional

PROG = DISTRIBUTION = "fsdp-autopatch"
TRAINING_PACKAGES = ("torch", "transformers")
# pyproject.toml's [project.urls] Source (tests/test_cli_help.py keeps them in step). The package
# is not on PyPI: a bare "pip install fsdp-autopatch" would find nothing, or someone else's
# upload, so every install the command suggests names the repository.
SOURCE_URL = "https://github.com/fsdp-autopatch/fsdp-autopatch"
REQUIREMENT = f'"fsdp-autopatch @ git+{SOURCE_URL}"'
# What follows "<python> -m pip" in a remedy that reinstalls (_config.pip_command names the python).
REINSTALL_ARGUMENTS = f"install --force-reinstall {REQUIREMENT}"
# An image's Python is its python3, not the one that prints this: the README shows the same line
# (tests/test_cli_help.py).
DOCKERFILE_LINE = f"RUN python3 -m pip install {REQUIREMENT} && python3 -m fsdp_autopatch verify"

# Each exit code is a verdict. 1: the bug is here and not fixed (doctor's PROBLEM, verify's FAIL);
# 2: no verdict (doctor's CANNOT TELL, verify cannot run here, a usage error, argparse's 2 too).
# 130 and 141: what a shell reports for a command stopped by Ctrl-C (128 + SIGINT) or cut off by
# its reader (128 + SIGPIPE, which Python ignores: the command says it with its code).
EXIT_OK, EXIT_NOT_FIXED, EXIT_CANNOT_TELL, EXIT_INTERRUPTED, EXIT_CLOSED_PIPE = 0, 1, 2, 130, 141
COLOURS = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}


class Terminated(SystemExit):
    """SIGTERM or SIGHUP ended a command once it had stopped what it started: exit 128 + N, the
    code a shell reports for a command killed by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Console:
    """Where output goes: details and progress can be silenced, verdicts and warnings cannot.
    The streams are sys's at each write (a caller may replace them; pythonw has them None)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def paint(self, text: str, colour: str, on_err: bool = False) -> str:
        # https://no-color.org; TERM=dumb is what editors and some CI runners set for plain terminals.
        if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
            return text
        try:
            terminal = (sys.stderr if on_err else sys.stdout).isatty()
        except (AttributeError, ValueError):  # None, or closed
            terminal = False
        return f"\x1b[{COLOURS[colour]}m{text}\x1b[0m" if terminal else text

    def write(self, stream: Optional[IO[str]], text: str, always: bool = True) -> None:
        if stream is not None and (always or not self.quiet):
            print(text, file=stream, flush=True)

    def detail(self, text: str) -> None:
        self.write(sys.stdout, text, always=False)

    def progress(self, text: str) -> None:
        self.write(sys.stderr, text, always=False)

    def verdict(self, text: str, colour: str) -> None:
        self.write(sys.stdout, self.paint(text, colour))

    def warning(self, text: str) -> None:
        self.write(sys.stderr, self.paint(text, "yellow", on_err=True))


def installed_version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
