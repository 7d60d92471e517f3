"""What the command's modules share: names, exit codes, the install command, the console.

``_cli`` imports ``_doctor`` and ``_verify_command``, and all three import this module; it
imports nothing of theirs, so the command's modules import downward only.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from typing import IO, ClassVar, Optional

PROG = "fsdp-autopatch"
DISTRIBUTION = "fsdp-autopatch"
PACKAGES = ("torch", "transformers")

# pyproject.toml's [project.urls] Source; tests/test_cli_help.py keeps the two in step.
SOURCE_URL = "https://github.com/fsdp-autopatch/fsdp-autopatch"
# The package is not on PyPI: a bare "pip install fsdp-autopatch" would find nothing (or
# someone else's upload), so every install the command suggests names the repository.
INSTALL_REQUIREMENT = f"fsdp-autopatch @ git+{SOURCE_URL}"
INSTALL_COMMAND = f'pip install "{INSTALL_REQUIREMENT}"'
REINSTALL_COMMAND = f'pip install --force-reinstall "{INSTALL_REQUIREMENT}"'

EXIT_OK = 0
# doctor --strict: the bug is present (or FSDP_AUTOPATCH=force asks for the patch) and the
# patch will not be applied; verify: a model failed, or a rank crashed while sharding.
EXIT_BROKEN = 1
# No verdict: a usage error (argparse's code), verify cannot run here, or doctor cannot tell
# from files alone (a torch newer than the matrix, an FSDP2 layout it does not recognise, a
# source tree instead of an installation).
EXIT_CANNOT_TELL = 2
# 128 + SIGPIPE: what a shell reports for a coreutils command whose reader went away
# (``yes | head -1``). Python ignores SIGPIPE, so the command says it with its exit code.
EXIT_CLOSED_PIPE = 141
# 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C.
EXIT_INTERRUPTED = 130


class Terminated(SystemExit):
    """SIGTERM or SIGHUP ended a command once it had stopped what it started: exit 128 + N, the
    code a shell reports for a command killed by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Console:
    """Where output goes: details and progress can be silenced, verdicts and warnings cannot.

    The streams are looked up when something is written, not when the console is made, so that
    output follows ``sys.stdout``/``sys.stderr`` when a caller (or a test) replaces them.
    """

    COLOURS: ClassVar[dict[str, str]] = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}

    def __init__(self, quiet: bool, out: Optional[IO[str]] = None, err: Optional[IO[str]] = None) -> None:
        self.quiet = quiet
        self._out = out
        self._err = err

    @property
    def out(self) -> IO[str]:
        return self._out if self._out is not None else sys.stdout

    @property
    def err(self) -> IO[str]:
        return self._err if self._err is not None else sys.stderr

    def paint(self, text: str, colour: str, on_err: bool = False) -> str:
        if not colour_wanted(self.err if on_err else self.out):
            return text
        return f"\x1b[{self.COLOURS[colour]}m{text}\x1b[0m"

    def detail(self, text: str) -> None:
        if not self.quiet:
            write(self.out, text)

    def progress(self, text: str) -> None:
        if not self.quiet:
            write(self.err, text)

    def verdict(self, text: str, colour: str) -> None:
        write(self.out, self.paint(text, colour))

    def warning(self, text: str) -> None:
        write(self.err, self.paint(text, "yellow", on_err=True))


def write(stream: Optional[IO[str]], text: str) -> None:
    # pythonw and some service managers run with sys.stdout/sys.stderr set to None.
    if stream is not None:
        print(text, file=stream, flush=True)


def colour_wanted(stream: IO[str]) -> bool:
    # https://no-color.org; TERM=dumb is what editors and some CI runners set for plain terminals.
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def installed_version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
