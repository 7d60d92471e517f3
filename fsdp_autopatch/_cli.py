"""The ``fsdp-autopatch`` command: check a training environment in one line of a Dockerfile or CI step.

This module parses the command line, dispatches, and turns a closed pipe and Ctrl-C into quiet
exits. ``doctor`` (``_doctor``) reads installed metadata, site configuration and torch's source
files without importing torch or transformers, so it answers in well under a second.
``verify`` (``_verify_command``) proves the fix for real: it runs ``python -m
fsdp_autopatch._verify`` under torch's own launcher with this Python, where the installed
start-up file is what patches each rank, exactly as in a training process. What the three share
(console, exit codes, names) lives in ``_console``; imports go downward only.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import IO, Any, Optional, Sequence

import fsdp_autopatch
from fsdp_autopatch import _doctor, _matrix, _verify, _verify_command
from fsdp_autopatch._console import (
    EXIT_CANNOT_TELL,
    EXIT_CLOSED_PIPE,
    EXIT_INTERRUPTED,
    INSTALL_COMMAND,
    PROG,
    Console,
    Terminated,
)

EXIT_CODES_HELP = """\
exit codes:
  0    fine: doctor found nothing wrong in what it checked; verify sharded every
       model and trained it as well as torch trains its own classes here
  1    a problem: doctor --strict found the bug present (or FSDP_AUTOPATCH=force
       set) and the patch will not be applied; verify saw a model fail (or a
       rank crash while sharding and training)
  2    no verdict: a usage error; doctor --strict cannot tell from files alone
       (torch newer than the matrix, an FSDP2 layout it does not recognise, a
       source tree instead of an installation); verify cannot run here (torch
       or transformers missing, no torch.distributed or gloo, the process group
       did not form, --timeout reached)
  130  interrupted by Ctrl-C (verify stops its ranks first)
  141  whatever reads the output went away (`| head -1`): the rest is dropped
       silently, and the code is the one a shell reports for coreutils there
  without --strict, doctor exits 0 once it has reported, whatever it found
"""

DOCTOR_EXIT_CODES_HELP = """\
exit codes:
  0    everything doctor checked is fine: the bug is not here, or it is and the
       installed patch is set up to fix it (`fsdp-autopatch verify` is the proof)
  1    with --strict: a problem found: the bug is present (or FSDP_AUTOPATCH=force
       set) and the patch will not be applied (switched off, start-up file not
       read, wrapt missing)
  2    with --strict: cannot tell from files alone: torch newer than the matrix,
       an FSDP2 layout doctor does not recognise, torch's files unreadable, or a
       source tree instead of an installation; also a usage error
  130  interrupted by Ctrl-C
  141  whatever reads the output went away (`| head -1`)
  without --strict, doctor exits 0 once it has reported, whatever it found
"""

# Measured on this project's machine kind (2 CPU cores, no GPU, torch 2.13.0 + transformers
# 4.55.2, CPython 3.11) on 2026-12-02, with the eight runs (four models, FSDP2 and DDP):
# `fsdp-autopatch verify -q`, three runs, 12.6 - 20.9 s while a test suite loaded both cores.
# Most of it is importing torch and transformers.
VERIFY_SECONDS = "10 - 20 s on 2 CPU cores with one rank"

GRACE, STOPS_WITHIN = _verify_command.STOP_GRACE_SECONDS, _verify_command.STOPS_WITHIN_SECONDS
VERIFY_EXIT_CODES_HELP = f"""\
exit codes:
  0    every model sharded, and trained as well as torch trains its own classes
       here (the causal LM, which the patch never touches, is the control)
  1    a model failed (the layout error, another error, a loss unlike the
       control's), or a rank crashed while sharding and training; never an
       interruption
  2    cannot run here: torch or transformers missing, no torch.distributed or
       gloo, the process group did not form, torchrun killed from outside,
       --timeout reached before every model was done; or a usage error
  130  interrupted by Ctrl-C (to verify alone or its whole process group)
  141  whatever reads the output went away (`| head -1`)
  143  stopped by SIGTERM (129: SIGHUP)
after --timeout, Ctrl-C or a signal, verify stops torchrun, the ranks and
whatever they started (SIGTERM, then SIGKILL {GRACE:g} s later) and returns
within {STOPS_WITHIN:g} s; nothing it started is left running
"""


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that a closed pipe under ``--help`` or ``--version`` is not
    swallowed: argparse ignores OSError when it prints, which would make ``--help | head -1``
    exit 0 where every other output exits 141."""

    def _print_message(self, message: str, file: Optional[IO[str]] = None) -> None:
        if message:
            write_to = file if file is not None else sys.stderr
            if write_to is not None:
                write_to.write(message)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def add_quiet(parser: argparse.ArgumentParser, default: Any) -> None:
    # Accepted before and after the command; SUPPRESS keeps the subcommand from resetting it.
    parser.add_argument("-q", "--quiet", action="store_true", default=default,
                        help="print only the one-line verdict (and warnings)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Check that PyTorch FSDP2 fully_shard, FSDP2 replicate and composable DDP "
                    "replicate work on models with abc.ABC ahead of nn.Module (transformers "
                    f"{_matrix.AFFECTED_TRANSFORMERS} heads) in this Python environment.",
        epilog=EXIT_CODES_HELP + f"\nin a Dockerfile:\n  RUN {INSTALL_COMMAND} && {PROG} verify\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {fsdp_autopatch.__version__}")
    add_quiet(parser, False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor", help="report versions, the switch, the matrix, torch's class-construction sites and the "
                       "start-up files (fast: reads files, imports neither torch nor transformers)",
        description="Report whether this environment has the bug and whether the installed patch "
                    "is set up to fix it, from installed metadata, site configuration and torch's "
                    "source files, without importing torch or transformers. It reads files only: "
                    f"`{PROG} verify` is the proof.",
        epilog=DOCTOR_EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument("--strict", action="store_true",
                        help="exit 1 on a problem found and 2 when doctor cannot tell (see below)")
    add_quiet(doctor, argparse.SUPPRESS)
    doctor.set_defaults(run=_doctor.run_doctor)

    verify = commands.add_parser(
        "verify", help=f"shard and train tiny models with FSDP2 and DDP in child interpreters "
                       f"({VERIFY_SECONDS})",
        description="Build tiny transformers models from configs (the three affected heads and a "
                    "causal LM), fully_shard each layer and the root on a gloo CPU group (and, in "
                    "a run of their own, replicate each with composable DDP), and train next to "
                    "an unwrapped copy, in ranks that torch's own launcher "
                    "(python -m torch.distributed.run) starts with this Python, so that the "
                    "installed start-up file is what patches them. Each rank then reports the "
                    "classes the patch built, which verify prints per rank. It takes "
                    f"{VERIFY_SECONDS} (measured; more ranks and a busy machine take longer).",
        epilog=VERIFY_EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="ranks to spawn (default: 1)")
    verify.add_argument("--model", action="append", choices=list(_verify.MODELS),
                        help="check only this model (repeatable; default: all); the causal LM "
                             "always runs too, as the control")
    timeout = _verify_command.DEFAULT_TIMEOUT
    verify.add_argument("--timeout", type=positive_float, default=timeout, metavar="SECONDS",
                        help=f"stop the ranks and exit 2 after this long, unless every model is "
                             f"done by then (default: {timeout:g})")
    verify.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    add_quiet(verify, argparse.SUPPRESS)
    verify.set_defaults(run=_verify_command.run_verify)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command; a closed pipe and Ctrl-C end it quietly, with their own exit codes."""
    command: list[Optional[str]] = [None]
    try:
        code = dispatch(argv, command)
        # Output still buffered (argparse's --help) meets a closed pipe here, not at exit.
        flush_standard_streams()
        return code
    except BrokenPipeError:
        silence_closed_pipe()
        return EXIT_CLOSED_PIPE
    except KeyboardInterrupt:
        say_stopped(command[0], "interrupted")
        return EXIT_INTERRUPTED
    except Terminated as terminated:  # verify, once it has stopped its ranks
        say_stopped(command[0], f"stopped by {signal.Signals(terminated.signum).name}")
        return int(terminated.code or 0)


def say_stopped(command: Optional[str], how: str) -> None:
    said = f"{PROG} {command}" if command else PROG
    try:
        print(f"{said}: {how}", file=sys.stderr, flush=True)
    except (OSError, ValueError, AttributeError):
        pass


def dispatch(argv: Optional[Sequence[str]], command: list[Optional[str]]) -> int:
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version and usage errors: argparse has printed them
        return exit.code if isinstance(exit.code, int) else EXIT_CANNOT_TELL
    if options.command is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: choose a command: doctor (check this environment) or verify (prove the fix)",
              file=sys.stderr)
        return EXIT_CANNOT_TELL
    command[0] = options.command
    console = Console(quiet=options.quiet or options.json)
    return int(options.run(options, console))


def flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def silence_closed_pipe() -> None:
    """Point stdout and stderr at the null device: Python flushes them again at exit, and the
    closed pipe would make that flush print "Exception ignored ... BrokenPipeError" (the remedy
    the signal module's documentation gives, in its note on SIGPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(devnull, stream.fileno())
            except (AttributeError, OSError, ValueError):  # None, or no descriptor (a StringIO)
                pass
    finally:
        os.close(devnull)
