"""The ``fsdp-autopatch`` command: check a training environment in one line of a Dockerfile or CI step.

``doctor`` reads installed metadata and site configuration, never importing torch or transformers,
so it answers in well under a second. ``verify`` proves the fix for real: it runs
``python -m fsdp_autopatch._verify`` in child interpreters of this Python, where the installed
``.pth`` start-up file is what patches, exactly as in a training process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import signal
import site
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import IO, Any, ClassVar, Iterator, Optional, Sequence

import fsdp_autopatch
from fsdp_autopatch import _config, _matrix, _verify

PROG = "fsdp-autopatch"
DISTRIBUTION = "fsdp-autopatch"
PTH_NAME = "fsdp_autopatch.pth"
START_NAME = "fsdp_autopatch.start"
PACKAGES = ("torch", "transformers")

EXIT_OK = 0
EXIT_BROKEN = 1  # the bug is present and would not be (doctor --strict) or was not (verify) fixed
EXIT_CANNOT_RUN = 2  # also argparse's exit code for a usage error

# Sharded and unsharded copies see the same weights and batches; anything above rounding noise
# means the patched class computes something different.
LOSS_TOLERANCE = 1e-4
DEFAULT_TIMEOUT = 300.0
STOP_GRACE_SECONDS = 5.0

EXIT_CODES_HELP = """\
exit codes:
  0  fine: doctor ran; verify sharded and trained every model
  1  the bug is present and not fixed: doctor --strict; verify saw a model fail
     (or a rank crash while sharding and training)
  2  usage error, or verify cannot run here (torch or transformers missing, no
     torch.distributed or gloo, the process group did not form, --timeout reached)
"""


class Console:
    """Where output goes: details and progress can be silenced, verdicts and warnings cannot."""

    COLOURS: ClassVar[dict[str, str]] = {"green": "32", "red": "31", "yellow": "33", "bold": "1", "dim": "2"}

    def __init__(self, quiet: bool, out: IO[str] = sys.stdout, err: IO[str] = sys.stderr) -> None:
        self.quiet = quiet
        self.out = out
        self.err = err
        self.out_colour = colour_wanted(out)
        self.err_colour = colour_wanted(err)

    def paint(self, text: str, colour: str, on_err: bool = False) -> str:
        if not (self.err_colour if on_err else self.out_colour):
            return text
        return f"\x1b[{self.COLOURS[colour]}m{text}\x1b[0m"

    def detail(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.out, flush=True)

    def progress(self, text: str) -> None:
        if not self.quiet:
            print(text, file=self.err, flush=True)

    def verdict(self, text: str, colour: str) -> None:
        print(self.paint(text, colour), file=self.out, flush=True)

    def warning(self, text: str) -> None:
        print(self.paint(text, "yellow", on_err=True), file=self.err, flush=True)


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


def same_path(a: Path, b: Path) -> bool:
    return os.path.normcase(os.path.realpath(a)) == os.path.normcase(os.path.realpath(b))


# ---------------------------------------------------------------------------------------------
# doctor


@dataclass
class StartupCheck:
    """Which start-up file this interpreter would use, and whether its site processing reads it."""

    pth: Optional[Path]
    start: Optional[Path]
    used: Optional[Path]
    read: bool
    detail: str


def site_directories() -> list[Path]:
    directories = [Path(path) for path in site.getsitepackages()]
    user = site.getusersitepackages()
    if user:
        directories.append(Path(user))
    return directories


def find_startup_file(name: str) -> Optional[Path]:
    """The installed file, looked for beside the distribution first, then in every site directory."""
    candidates: list[Path] = []
    try:
        candidates.append(Path(str(metadata.distribution(DISTRIBUTION).locate_file(""))))
    except metadata.PackageNotFoundError:
        pass
    candidates.extend(site_directories())
    candidates.extend(Path(entry) for entry in sys.path if entry)
    for directory in candidates:
        if (directory / name).is_file():
            return directory / name
    return None


def site_reads(directory: Path) -> tuple[bool, str]:
    """Whether this interpreter's start-up (site.py) processes start-up files in ``directory``."""
    if sys.flags.no_site:
        return False, ("this interpreter runs with -S, which skips every .pth file; call "
                       "fsdp_autopatch.apply() in the training script")
    if any(same_path(directory, Path(path)) for path in site.getsitepackages()):
        on_path = any(same_path(directory, Path(entry)) for entry in sys.path if entry)
        if on_path:
            return True, f"{directory} is a site-packages directory of this interpreter"
        return False, (f"{directory} is a site-packages directory but is not on sys.path here; "
                       "call fsdp_autopatch.apply() in the training script")
    user = site.getusersitepackages()
    if user and same_path(directory, Path(user)):
        if site.ENABLE_USER_SITE:
            return True, f"{directory} is this interpreter's user site directory, which is enabled"
        return False, (f"{directory} is the user site directory, which this interpreter skips "
                       "(python -s, PYTHONNOUSERSITE or a virtual environment); install "
                       "fsdp-autopatch into the environment itself")
    return False, (f"{directory} is not a site directory of this interpreter (a PYTHONPATH or "
                   "pip install --target directory?); install fsdp-autopatch with pip into the "
                   "environment, or call fsdp_autopatch.apply() in the training script")


def check_startup() -> StartupCheck:
    pth, start = find_startup_file(PTH_NAME), find_startup_file(START_NAME)
    # PEP 829: from Python 3.15 a matching .start file replaces the .pth import line, and from
    # 3.18 .pth import lines are not run at all.
    uses_start = sys.version_info >= (3, 15) and start is not None
    used = start if uses_start else pth
    if used is None:
        return StartupCheck(pth, start, None, False,
                            f"{PTH_NAME} is not installed; reinstall: pip install --force-reinstall "
                            f"{DISTRIBUTION}")
    if not uses_start and sys.version_info >= (3, 18):
        return StartupCheck(pth, start, used, False,
                            f"Python 3.18+ ignores import lines in .pth files and {START_NAME} is "
                            f"missing; reinstall: pip install --force-reinstall {DISTRIBUTION}")
    read, detail = site_reads(used.parent)
    return StartupCheck(pth, start, used, read, detail)


def check_wrapt() -> tuple[Optional[str], Optional[str]]:
    """wrapt's version, or None and why it cannot be imported (the hooks need it)."""
    try:
        import wrapt
    except Exception as error:
        return None, f"{type(error).__name__}: {error}"
    return str(getattr(wrapt, "__version__", "unknown")), None


@dataclass
class DoctorReport:
    version: str
    package_path: str
    python: str
    executable: str
    torch: Optional[str]
    transformers: Optional[str]
    wrapt: Optional[str]
    wrapt_error: Optional[str]
    mode: str
    mode_value: Optional[str]
    mode_problem: Optional[str]
    # True: the matrix lists the pair as having the bug; False: as free of it; None: cannot tell.
    in_matrix: Optional[bool]
    would_apply: Optional[bool]
    reason: str
    pth_installed: Optional[str]
    start_installed: Optional[str]
    startup_file: Optional[str]
    startup_read: bool
    startup_detail: str
    armed_here: bool
    problems: list[str] = field(default_factory=list)
    verdict: str = ""
    ok: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def newer_than_matrix(torch_version: Optional[str]) -> bool:
    try:
        return torch_version is not None and _matrix.row_for(_matrix.TORCH_ROWS, torch_version) is None
    except ValueError:
        return False


def diagnose() -> DoctorReport:
    mode = _config.mode_from_environment()
    torch_version, transformers_version = (installed_version(name) for name in PACKAGES)
    wrapt_version, wrapt_error = check_wrapt()
    startup = check_startup()
    try:
        # Whether the pair has the bug does not depend on the switch; whether it gets fixed does.
        pair = _matrix.decide(_config.AUTO, torch_version, transformers_version)
        decision = _matrix.decide(mode.name, torch_version, transformers_version)
    except ValueError as error:
        pair = decision = _matrix.Decision(False, f"unreadable version: {error}", None)
    matrix_apply: Optional[bool] = decision.apply
    reason = pair.reason
    if mode.name == _config.AUTO and pair.in_matrix is None and newer_than_matrix(torch_version) \
            and transformers_version is not None:
        matrix_apply = None
        reason = (f"torch {torch_version} is newer than the matrix: on import the patch probes "
                  "torch's FSDP class construction and applies only if it is still broken; "
                  f"see with: {PROG} verify")

    problems = []
    if mode.name == _config.OFF:
        problems.append(f"{_config.MODE_VARIABLE}={mode.raw} disables the patch; unset "
                        f"{_config.MODE_VARIABLE} (or set it to auto)")
    if not startup.read:
        problems.append(startup.detail)
    if wrapt_version is None:
        problems.append(f"wrapt cannot be imported ({wrapt_error}); install it: pip install wrapt")
    would_apply: Optional[bool] = False if problems else matrix_apply

    report = DoctorReport(
        version=fsdp_autopatch.__version__,
        package_path=str(Path(fsdp_autopatch.__file__).parent),
        python=platform.python_version(),
        executable=sys.executable,
        torch=torch_version,
        transformers=transformers_version,
        wrapt=wrapt_version,
        wrapt_error=wrapt_error,
        mode=mode.name,
        mode_value=mode.raw,
        mode_problem=mode.problem or None,
        in_matrix=pair.in_matrix,
        would_apply=would_apply,
        reason=reason,
        pth_installed=str(startup.pth) if startup.pth else None,
        start_installed=str(startup.start) if startup.start else None,
        startup_file=str(startup.used) if startup.used else None,
        startup_read=startup.read,
        startup_detail=startup.detail,
        armed_here=fsdp_autopatch.armed,
        problems=problems,
    )
    report.verdict, report.ok = doctor_verdict(report, decision.reason)
    return report


def doctor_verdict(report: DoctorReport, mode_reason: str) -> tuple[str, bool]:
    """The one-line summary, and False when the bug is present and would not be fixed."""
    pair = f"torch {report.torch} with transformers {report.transformers}"
    if report.in_matrix:
        if report.would_apply:
            return (f"OK: {pair} has the FSDP2 layout bug, and the patch will fix it in every "
                    f"process of this Python; prove it with: {PROG} verify"), True
        return (f"PROBLEM: {pair} has the FSDP2 layout bug and it will NOT be fixed: "
                f"{report.problems[0]}"), False
    if report.would_apply is None:
        if report.problems:
            return (f"WARNING: torch {report.torch} is newer than the matrix and may still need the "
                    f"patch, but {report.problems[0]}"), True
        return f"OK: {report.reason}", True
    if report.mode == _config.FORCE:
        if report.would_apply:
            return f"OK: {mode_reason}", True
        if report.problems:
            return f"WARNING: {_config.MODE_VARIABLE}=force has no effect: {report.problems[0]}", True
    return f"OK: nothing to fix: {report.reason}", True


def run_doctor(options: argparse.Namespace, console: Console) -> int:
    report = diagnose()
    if report.mode_problem:
        console.warning(report.mode_problem)
    if options.json:
        print(json.dumps(report.to_dict()), file=console.out)
    else:
        show_doctor(report, console)
    if options.strict and not report.ok:
        return EXIT_BROKEN
    return EXIT_OK


def show_doctor(report: DoctorReport, console: Console) -> None:
    def row(label: str, text: str) -> None:
        console.detail(f"  {label:<14}{text}")

    def missing(version: Optional[str]) -> str:
        return version if version is not None else console.paint("not installed", "dim")

    console.detail(console.paint(f"{PROG} {report.version} doctor", "bold"))
    row("package", report.package_path)
    row("python", f"{report.python} ({report.executable})")
    row("torch", missing(report.torch))
    row("transformers", missing(report.transformers))
    row("wrapt", report.wrapt or console.paint(f"cannot be imported: {report.wrapt_error}", "red"))
    switch = (f"{_config.MODE_VARIABLE} unset" if report.mode_value is None
              else f"{_config.MODE_VARIABLE}={report.mode_value!r}")
    row("mode", f"{report.mode} ({switch})")
    matrix = {True: "has the bug", False: "not affected", None: "not decided by the matrix"}
    row("matrix", f"{matrix[report.in_matrix]}: {report.reason}")
    row(".pth", report.pth_installed or console.paint("not installed", "red"))
    row(".start", report.start_installed or console.paint("not installed", "dim"))
    read = console.paint("read", "green") if report.startup_read else console.paint("NOT read", "red")
    row("start-up", f"{read}: {report.startup_detail}")
    row("this process", "armed by the start-up file" if report.armed_here else "not armed")
    would = {True: "yes", False: "no", None: "decided on import, by a probe"}
    row("would apply", would[report.would_apply])
    colour = "green" if report.verdict.startswith("OK") else "red" if not report.ok else "yellow"
    console.verdict(report.verdict, colour)


# ---------------------------------------------------------------------------------------------
# verify


@dataclass
class Rank:
    number: int
    process: subprocess.Popen  # type: ignore[type-arg]
    stderr: IO[bytes]

    def last_error_line(self) -> str:
        """The last line the child wrote to stderr: a traceback's exception, or its own message."""
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines()]
        lines = [line for line in lines if line]
        return lines[-1] if lines else f"rank {self.number} printed nothing on stderr"


@dataclass
class VerifyRun:
    nproc: int
    models: list[str]
    started: float = field(default_factory=time.monotonic)
    status: Optional[dict[str, Any]] = None
    results: list[dict[str, Any]] = field(default_factory=list)
    timed_out: bool = False
    exit_codes: dict[int, Optional[int]] = field(default_factory=dict)
    cannot_run: Optional[str] = None
    crash: Optional[str] = None


def model_outcome(result: dict[str, Any], untrained_ok: bool = True) -> tuple[str, bool]:
    """A short result for the table, and whether it counts as a success.

    ``untrained_ok``: no sharded model could train, torch's own classes included, so training
    says nothing about the patch (torch 2.4's FSDP2 needs a GPU to run a forward pass).
    """
    if not result.get("sharded"):
        error = str(result.get("error", ""))
        return ("layout error" if _verify.LAYOUT_ERROR in error else "shard failed"), False
    if result.get("trained") is False:
        return ("sharded only", True) if untrained_ok else ("train failed", False)
    difference = result.get("max_loss_difference")
    if isinstance(difference, (int, float)) and difference > LOSS_TOLERANCE:
        return "loss mismatch", False
    return "sharded", True


def start_ranks(nproc: int, models: Sequence[str]) -> list[Rank]:
    base = dict(os.environ)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_verify.free_port()), WORLD_SIZE=str(nproc))
    ranks: list[Rank] = []
    try:
        for number in range(nproc):
            env = dict(base, RANK=str(number), LOCAL_RANK=str(number), LOCAL_WORLD_SIZE=str(nproc))
            stderr = tempfile.TemporaryFile()
            process = subprocess.Popen(
                [sys.executable, "-m", "fsdp_autopatch._verify", *models],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if number == 0 else subprocess.DEVNULL,
                stderr=stderr, env=env,
                # Its own process group, so that stopping a rank stops anything it started too.
                start_new_session=True,
            )
            ranks.append(Rank(number, process, stderr))
    except BaseException:
        stop_ranks(ranks)
        raise
    return ranks


def stop_ranks(ranks: Sequence[Rank]) -> None:
    """SIGTERM every rank still running, then SIGKILL what is left after a grace period."""
    for rank in ranks:
        signal_rank(rank, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for rank in ranks:
        try:
            rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_rank(rank, getattr(signal, "SIGKILL", signal.SIGTERM))
            rank.process.wait()


def signal_rank(rank: Rank, signum: int) -> None:
    # Only a rank not yet reaped: once reaped, its pid (and process group id) may be reused.
    if rank.process.poll() is not None:
        return
    try:
        if hasattr(os, "killpg"):
            os.killpg(rank.process.pid, signum)
        else:
            rank.process.send_signal(signum)
    except ProcessLookupError:
        pass


def read_lines(stream: IO[bytes], lines: queue.Queue[Optional[str]]) -> None:
    for raw in iter(stream.readline, b""):
        lines.put(raw.decode(errors="replace"))
    lines.put(None)


def watch_ranks(run: VerifyRun, ranks: list[Rank], timeout: float, console: Console) -> None:
    """Collect rank 0's JSON lines as they arrive, and stop every rank on a failure or timeout."""
    lines: queue.Queue[Optional[str]] = queue.Queue()
    assert ranks[0].process.stdout is not None
    reader = threading.Thread(target=read_lines, args=(ranks[0].process.stdout, lines), daemon=True)
    reader.start()
    deadline = run.started + timeout
    stdout_open = True
    try:
        while True:
            if time.monotonic() > deadline:
                run.timed_out = True
                break
            if stdout_open:
                try:
                    line = lines.get(timeout=0.2)
                except queue.Empty:
                    line = ""
                if line is None:
                    stdout_open = False
                elif line.startswith("{"):
                    take_line(run, line, console)
            else:
                time.sleep(0.1)
            codes = [rank.process.poll() for rank in ranks]
            # A rank that failed leaves the others waiting in a collective until gloo times out.
            if any(code not in (None, 0) for code in codes):
                break
            if not stdout_open and all(code is not None for code in codes):
                break
    finally:
        # Before stopping: a rank stopped here must not be mistaken for the one that failed.
        run.exit_codes = {rank.number: rank.process.poll() for rank in ranks}
        stop_ranks(ranks)
        reader.join(timeout=STOP_GRACE_SECONDS)
        while True:  # lines that arrived while the ranks were being stopped
            try:
                line = lines.get_nowait()
            except queue.Empty:
                break
            if line and line.startswith("{"):
                take_line(run, line, console)


def take_line(run: VerifyRun, line: str, console: Console) -> None:
    try:
        record = json.loads(line)
    except ValueError:
        return
    if "status" in record and run.status is None:
        run.status = record["status"]
        applied = "applied" if run.status.get("applied") else "not applied"
        console.progress(f"patch {applied}: {run.status.get('reason')}")
    elif "model" in record:
        run.results.append(record)
        outcome, good = model_outcome(record)
        shown = console.paint(outcome, "green" if good else "red", on_err=True)
        seconds = record.get("seconds") or 0.0
        console.progress(f"[{len(run.results)}/{len(run.models)}] {record['model']}: {shown} "
                         f"({seconds:.1f} s)")


def nothing_trained(run: VerifyRun) -> bool:
    sharded = [result for result in run.results if result.get("sharded")]
    return bool(sharded) and all(result.get("trained") is False for result in sharded)


def outcome_in_run(run: VerifyRun, result: dict[str, Any]) -> tuple[str, bool]:
    return model_outcome(result, untrained_ok=nothing_trained(run))


def verify_verdict(run: VerifyRun, timeout: float) -> tuple[int, str]:
    """The exit code and the one line that says what happened and what to do."""
    if run.cannot_run:
        return EXIT_CANNOT_RUN, f"cannot verify: {run.cannot_run}"
    if run.timed_out:
        return EXIT_CANNOT_RUN, (f"cannot verify: not finished within {timeout:g} s "
                                 f"({len(run.results)} of {len(run.models)} models done); "
                                 "rerun with a larger --timeout on a less loaded machine")
    if run.crash and run.status is None:
        return EXIT_CANNOT_RUN, f"cannot verify: {run.crash}"
    failed = [result for result in run.results if not outcome_in_run(run, result)[1]]
    status = run.status or {}
    if failed:
        first = failed[0]
        what = (first.get("error") or first.get("train_error")
                or f"losses differ by {first.get('max_loss_difference')}")
        head = f"FAIL: {len(failed)} of {len(run.models)} models cannot be used with FSDP2 ({what})"
        if status.get("applied"):
            return EXIT_BROKEN, (f"{head}, although the patch was applied; please report it with "
                                 f"the output of: {PROG} doctor --json")
        return EXIT_BROKEN, f"{head}; the patch was not applied: {status.get('reason')}; {remedy(status)}"
    if run.crash or len(run.results) < len(run.models):
        return EXIT_BROKEN, f"FAIL: {run.crash or 'rank 0 stopped before every model was done'}"
    done = f"{len(run.results)} of {len(run.models)} models sharded with FSDP2 and trained"
    if nothing_trained(run):
        done = (f"{len(run.results)} of {len(run.models)} models sharded with FSDP2, none could "
                f"train in this torch ({run.results[0].get('train_error')})")
    if status.get("applied"):
        return EXIT_OK, (f"OK: {done}; the patch was applied at start-up, as it will be in training "
                         f"processes of this Python (torch {status.get('torch')} with transformers "
                         f"{status.get('transformers')} has the bug)")
    return EXIT_OK, f"OK: {done}; no patch was needed: {status.get('reason')}"


def remedy(status: dict[str, Any]) -> str:
    if status.get("mode") == _config.OFF:
        return f"unset {_config.MODE_VARIABLE} to let the patch run"
    return f"see why with: {PROG} doctor"


def run_verify(options: argparse.Namespace, console: Console) -> int:
    models = options.model or list(_verify.MODELS)
    run = VerifyRun(nproc=options.nproc, models=models)
    mode = _config.mode_from_environment()
    if mode.problem:
        console.warning(mode.problem)
    missing = [name for name in PACKAGES if util.find_spec(name) is None]
    if missing:
        run.cannot_run = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"installed for {sys.executable}; install torch and transformers into "
                          "this environment")
    else:
        ranks_word = "rank" if options.nproc == 1 else "ranks"
        console.progress(f"{PROG} verify: {options.nproc} {ranks_word} of {sys.executable} -m "
                         f"fsdp_autopatch._verify, gloo on CPU (torch {installed_version('torch')}, "
                         f"transformers {installed_version('transformers')})")
        with termination_raises():
            ranks = start_ranks(options.nproc, models)
            try:
                watch_ranks(run, ranks, options.timeout, console)
                explain_exits(run, ranks)
            finally:  # Ctrl-C and SIGTERM included: no rank outlives the command
                stop_ranks(ranks)
                for rank in ranks:
                    rank.stderr.close()
                    if rank.process.stdout is not None:
                        rank.process.stdout.close()
    code, verdict = verify_verdict(run, options.timeout)
    if options.json:
        print(json.dumps(verify_document(run, code, verdict)), file=console.out)
    else:
        show_table(run, console)
        console.verdict(verdict, "green" if code == EXIT_OK else "red")
    return code


@contextlib.contextmanager
def termination_raises() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP (a cancelled CI job, a closed terminal) into SystemExit, so that
    cleanup runs: the ranks live in their own sessions and would not receive these signals."""
    names = [name for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)]
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return
    previous = {name: signal.signal(getattr(signal, name), raise_system_exit) for name in names}
    try:
        yield
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)


def raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def explain_exits(run: VerifyRun, ranks: Sequence[Rank]) -> None:
    """Record why a rank that ended on its own failed: it could not run, or it crashed."""
    if run.timed_out:
        return
    failed = [rank for rank in ranks if run.exit_codes.get(rank.number) not in (0, None)]
    for rank in failed:
        if run.exit_codes[rank.number] == EXIT_CANNOT_RUN:
            run.cannot_run = rank.last_error_line().split("cannot verify: ", 1)[-1]
            return
    if failed:
        rank = failed[0]
        code = run.exit_codes[rank.number]
        assert code is not None
        during = (f" during {run.models[len(run.results)]}" if run.status is not None
                  and len(run.results) < len(run.models) else "")
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            run.crash = (f"rank {rank.number} was killed by {name}{hint}{during}; rerun it, with "
                         "less else running on the machine")
        else:
            run.crash = (f"rank {rank.number} exited with code {code}{during}: {rank.last_error_line()}; "
                         f"report it with the output of: {PROG} doctor --json")


def show_table(run: VerifyRun, console: Console) -> None:
    if run.status is None:  # no rank got as far as the models
        return
    width = max(len("model"), *(len(name) for name in run.models))
    console.detail(console.paint(f"{'model':<{width}}  {'result':<13}  {'seconds':>7}", "bold"))
    done = {result["model"]: result for result in run.results}
    for name in run.models:
        if name in done:
            outcome, good = outcome_in_run(run, done[name])
            seconds = f"{done[name].get('seconds', 0.0):7.2f}"
        else:
            outcome, good, seconds = "not run", False, f"{'-':>7}"
        console.detail(f"{name:<{width}}  {console.paint(f'{outcome:<13}', 'green' if good else 'red')}"
                       f"  {seconds}")


def verify_document(run: VerifyRun, code: int, verdict: str) -> dict[str, Any]:
    return {
        "exit_code": code,
        "ok": code == EXIT_OK,
        "verdict": verdict,
        "version": fsdp_autopatch.__version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": installed_version("torch"),
        "transformers": installed_version("transformers"),
        "nproc": run.nproc,
        "status": run.status,
        "models": [
            dict(result, result=outcome_in_run(run, result)[0], ok=outcome_in_run(run, result)[1])
            for result in run.results
        ],
        "timed_out": run.timed_out,
        "seconds": round(time.monotonic() - run.started, 2),
    }


# ---------------------------------------------------------------------------------------------
# the command line


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
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Check that PyTorch FSDP2 fully_shard works on models with abc.ABC ahead of "
                    "nn.Module (transformers 4.54.0-4.55.2 heads) in this Python environment.",
        epilog=EXIT_CODES_HELP + f"\nin a Dockerfile:  RUN pip install {DISTRIBUTION} && {PROG} verify\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version",
                        version=f"{PROG} {fsdp_autopatch.__version__}")
    add_quiet(parser, False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor", help="report versions, the switch, the matrix and the start-up files (fast, "
                       "imports neither torch nor transformers)",
        description="Report whether this environment has the bug and whether the installed patch "
                    "will fix it, without importing torch or transformers.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument("--strict", action="store_true",
                        help="exit 1 when the bug is present and would not be fixed")
    add_quiet(doctor, argparse.SUPPRESS)
    doctor.set_defaults(run=run_doctor)

    verify = commands.add_parser(
        "verify", help="shard and train tiny models with FSDP2 in child interpreters (about 30 s)",
        description="Build tiny transformers models from configs (the three affected heads and a "
                    "causal LM), fully_shard each layer and the root on a gloo CPU group, and "
                    "train one step each, in child interpreters of this Python so that the "
                    "installed start-up file is what patches them.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("--nproc", type=positive_int, default=1, metavar="N",
                        help="ranks to spawn (default: 1)")
    verify.add_argument("--model", action="append", choices=list(_verify.MODELS),
                        help="check only this model (repeatable; default: all)")
    verify.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"stop the ranks and exit 2 after this long (default: {DEFAULT_TIMEOUT:g})")
    verify.add_argument("--json", action="store_true", help="print one JSON object, no progress")
    add_quiet(verify, argparse.SUPPRESS)
    verify.set_defaults(run=run_verify)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit:  # --help, --version and usage errors: argparse has printed them
        return exit.code if isinstance(exit.code, int) else EXIT_CANNOT_RUN
    if options.command is None:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: choose a command: doctor (check this environment) or verify (prove the fix)",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    console = Console(quiet=options.quiet or options.json)
    try:
        return int(options.run(options, console))
    except KeyboardInterrupt:
        return 130
