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

# pyproject.toml's [project.urls] Source; tests/test_cli_help.py keeps the two in step. The
# package is not on PyPI: a bare "pip install fsdp-autopatch" would find nothing (or someone
# else's upload), so every install the command suggests names the repository.
SOURCE_URL = "https://github.com/fsdp-autopatch/fsdp-autopatch"
INSTALL_REQUIREMENT = f"fsdp-autopatch @ git+{SOURCE_URL}"
INSTALL_COMMAND = f'pip install "{INSTALL_REQUIREMENT}"'
REINSTALL_COMMAND = f'pip install --force-reinstall "{INSTALL_REQUIREMENT}"'

# The exit codes, each a verdict: OK; the bug is here and not fixed (doctor's PROBLEM, verify's
# FAIL); no verdict (doctor's CANNOT TELL, verify cannot run here, a usage error, which is
# argparse's 2 too); what a shell reports for a coreutils command whose reader went away (128 +
# SIGPIPE: Python ignores SIGPIPE, so the command says it with its code) and for Ctrl-C (128 +
# SIGINT).
EXIT_OK = 0
EXIT_BROKEN = 1
EXIT_CANNOT_TELL = 2
EXIT_CLOSED_PIPE = 141
EXIT_INTERRUPTED = 130


class Terminated(SystemExit):
    """SIGTERM or SIGHUP ended a command once it had stopped what it started: exit 128 + N, the
    code a shell reports for a command killed by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Console:
    """Where output goes: details and progress can be silenced, verdicts and warnings cannot.
    The streams are looked up at each write, so output follows ``sys.stdout``/``sys.stderr``
    when a caller (or a test) replaces them."""

    COLOURS: ClassVar[dict[str, str]] = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}

    def __init__(self, quiet: bool, out: Optional[IO[str]] = None, err: Optional[IO[str]] = None) -> None:
        self.quiet = quiet
        self._out, self._err = out, err

    @property
    def out(self) -> IO[str]:
        return self._out if self._out is not None else sys.stdout

    @property
    def err(self) -> IO[str]:
        return self._err if self._err is not None else sys.stderr

    def paint(self, text: str, colour: str, on_err: bool = False) -> str:
        stream = self.err if on_err else self.out
        # https://no-color.org; TERM=dumb is what editors and some CI runners set for plain terminals.
        if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb" or not getattr(
                stream, "isatty", lambda: False)():
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


def installed_version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
