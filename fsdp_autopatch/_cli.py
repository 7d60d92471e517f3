"""The ``fsdp-autopatch`` command: parse, dispatch to ``doctor`` (``_doctor``) or ``verify``
(``_verify_command``), and turn a closed pipe and Ctrl-C into quiet exits with their own codes."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
from typing import IO, Optional, Sequence

import fsdp_autopatch
from fsdp_autopatch import _console, _doctor, _matrix, _verify, _verify_command
from fsdp_autopatch._console import PROG

STOPPED_EXIT_CODES = """\
  130  interrupted by Ctrl-C
  141  whatever read the output went away (`| head -1`)
"""
DOCTOR_EXIT_CODES = f"""\
exit codes (the verdict):
  0    OK: nothing to fix, or the installed patch is set up to fix it
  1    PROBLEM: the bug is here (or FSDP_AUTOPATCH=force is set) and the patch
       will not be applied: switched off, not armed, wrapt missing
  2    CANNOT TELL from files: torch newer than the version matrix, a layout
       doctor does not know, a source tree instead of an installation; or a
       usage error
{STOPPED_EXIT_CODES}"""

# Measured on 2 CPU cores with torch 2.13.0 (CPU) and transformers 4.55.2 (2026-12-03).
VERIFY_SECONDS = "10 - 20 s on 2 CPU cores with one rank"
GRACE, STOPS_WITHIN = _verify_command.STOP_GRACE_SECONDS, _verify_command.STOPS_WITHIN_SECONDS
VERIFY_EXIT_CODES = f"""\
exit codes (the verdict):
  0    every model wrapped, and trained as well as torch trains its own classes
       here (the causal LM, which the patch never touches, is the control)
  1    a model failed (the layout error, another error, a loss unlike the
       control's), or a rank failed while wrapping and training
  2    cannot run here: torch or transformers missing, a source tree, no gloo,
       the process group did not form, a rank killed from outside, --timeout
       reached; or a usage error
{STOPPED_EXIT_CODES}  143  stopped by SIGTERM (129: SIGHUP)
however it is stopped, verify stops its ranks (SIGTERM, then SIGKILL {GRACE:g} s
later) and returns within {STOPS_WITHIN:g} s; nothing it started is left running
"""


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that a closed pipe under ``--help`` or ``--version`` is not
    swallowed: argparse ignores OSError when it prints, which would make ``--help | head -1``
    exit 0 where every other output exits 141."""

    def _print_message(self, message: str, file: Optional[IO[str]] = None) -> None:
        write_to = file if file is not None else sys.stderr
        if message and write_to is not None:
            write_to.write(message)


def positive(kind: type) -> object:
    """An argparse type: a finite number above 0 (``nan`` and ``inf`` parse as floats, and would
    leave no deadline at all)."""
    def parse(text: str) -> object:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number more than 0, not {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check that PyTorch FSDP2 and composable DDP work on models with abc.ABC ahead of "
                    f"nn.Module (transformers {_matrix.ABC_HEADS_TRANSFORMERS} heads) in this Python.",
        epilog=f"in a Dockerfile:\n  {_console.DOCKERFILE_LINE}\n",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {fsdp_autopatch.__version__}")
    quiet = {"action": "store_true", "help": "print only the one-line verdict (and warnings)"}
    parser.add_argument("-q", "--quiet", **quiet)  # type: ignore[arg-type]
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor", help="check this environment from its files, in well under a second",
        description="Say whether this environment has the bug and whether the installed patch will "
                    "fix it, one line per fact, from installed metadata, site configuration and "
                    f"torch's source files, without importing torch. `{PROG} verify` is the proof.",
        epilog=DOCTOR_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object with every fact")
    doctor.add_argument("--strict", action="store_true",
                        help="as in 0.2.0; the exit code is always the verdict now")
    doctor.set_defaults(run=_doctor.run_doctor)

    verify = commands.add_parser(
        "verify", help=f"prove the fix: wrap and train tiny models ({VERIFY_SECONDS})",
        description="Build tiny transformers models from configs (the three affected heads and a "
                    "causal LM), fully_shard each layer and the root on a gloo CPU group, replicate "
                    "each with composable DDP, and train each next to an unwrapped copy, in ranks "
                    "that are fresh interpreters of this Python with its flags (-S, -I, ...), armed "
                    f"as training processes are. It takes {VERIFY_SECONDS}.",
        epilog=VERIFY_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("--nproc", type=positive(int), default=1, metavar="N", help="ranks (default: 1)")
    verify.add_argument("--model", action="append", choices=list(_verify.MODELS),
                        help="check only this model (repeatable); the causal LM always runs, as the control")
    verify.add_argument("--timeout", type=positive(float), default=_verify_command.DEFAULT_TIMEOUT,
                        metavar="SECONDS", help="stop and exit 2 after this long (default: %(default)g)")
    verify.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    verify.set_defaults(run=_verify_command.run_verify)
    for command in (doctor, verify):  # accepted after the command too
        command.add_argument("-q", "--quiet", **quiet, default=argparse.SUPPRESS)  # type: ignore[arg-type]
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; a closed pipe and Ctrl-C end it quietly, with their own exit codes."""
    command: list[Optional[str]] = [None]
    try:
        code = dispatch(argv, command)
        # Output still buffered (argparse's --help) meets a closed pipe here, not at exit.
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        return code
    except BrokenPipeError:
        silence_closed_pipe()
        return _console.EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        say_stopped(command[0], "interrupted")
        return _console.EXIT_INTERRUPTED
    except _console.Terminated as terminated:  # verify, once it has stopped its ranks
        say_stopped(command[0], f"stopped by {signal.Signals(terminated.signum).name}")
        return int(terminated.code or 0)


def say_stopped(command: Optional[str], how: str) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed or missing stderr
        print(f"{PROG} {command}: {how}" if command else f"{PROG}: {how}", file=sys.stderr, flush=True)


def dispatch(argv: Optional[Sequence[str]], command: list[Optional[str]]) -> int:
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version and usage errors: argparse has printed them
        return exit.code if isinstance(exit.code, int) else _console.EXIT_CANNOT_TELL
    if options.command is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: choose a command: doctor (check this environment) or verify (prove the fix)",
              file=sys.stderr)
        return _console.EXIT_CANNOT_TELL
    command[0] = options.command
    return int(options.run(options, _console.Console(quiet=options.quiet or options.json)))


def silence_closed_pipe() -> None:
    """Point stdout and stderr at the null device: Python flushes them at exit, where the closed pipe
    would print "Exception ignored ... BrokenPipeError" (the signal module's docs, on SIGPIPE)."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or a StringIO
                os.dup2(devnull, stream.fileno())
        os.close(devnull)
