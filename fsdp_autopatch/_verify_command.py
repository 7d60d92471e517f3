"""``fsdp-autopatch verify``, the parent side: start the ranks, follow them, judge.

Each rank is a fresh interpreter of this very Python, started with this process's interpreter
flags (``-S``, ``-I``, ``-E``, ``-s``, ...) and environment, running ``python -m
fsdp_autopatch._verify``: it reads the start-up files, or does not, as a training script run
the same way would, and torch's plugin entry point arms it where it would arm that script. The
ranks form their gloo group from the variables a launcher sets (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), in a process group of their own, which verify stops as one.
No launcher is needed to prove the fix; the launchers users run are proven by the tests.

This process never imports torch: it reads each rank's JSON lines (rank 0's results, every
rank's list of the classes the patch built), grades them with ``_verify.grade`` and prints the
classes per rank and one verdict line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import util
from typing import IO, Any, Iterator, Optional

import fsdp_autopatch
from fsdp_autopatch import _config, _doctor, _layout, _verify
from fsdp_autopatch._console import (
    EXIT_BROKEN,
    EXIT_CANNOT_TELL,
    EXIT_OK,
    PACKAGES,
    PROG,
    Console,
    Terminated,
    installed_version,
)

DEFAULT_TIMEOUT = 300.0
# Once the deadline or a signal has come, the ranks get this long to exit on SIGTERM before
# verify kills whatever is left of their process group with SIGKILL.
STOP_GRACE_SECONDS = 5.0
# A process killed with SIGKILL is gone at once unless it is in the kernel (writing to a slow
# disk, say); verify does not wait longer than this for that.
KILLED_WAIT_SECONDS = 2.0
# How often verify looks at the ranks, and at what is left of them while it stops them.
POLL_SECONDS = 0.5
LOOK_SECONDS = 0.05
# The longest verify takes from the deadline or a signal to its exit (the help states it).
STOPS_WITHIN_SECONDS = math.ceil(POLL_SECONDS + STOP_GRACE_SECONDS + KILLED_WAIT_SECONDS)
READ_BYTES = 65536

# What a model's outcome is called, when it counts (True) and when it does not.
SHOWN = {
    _verify.TRAINED: {True: "wrapped"},
    _verify.DRIFTED: {True: "wrapped", False: "loss mismatch"},
    _verify.DIVERGED: {True: "wrapped", False: "loss mismatch"},
    _verify.UNTRAINED: {True: "wrapped only", False: "train failed"},
    _verify.LAYOUT: {False: "layout error"},
    _verify.SHARD_FAILED: {False: "shard failed"},
}


@dataclass
class VerifyRun:
    nproc: int
    models: list[str]
    started: float = field(default_factory=time.monotonic)
    status: Optional[dict[str, Any]] = None  # rank 0's status() before the first model
    results: list[dict[str, Any]] = field(default_factory=list)
    # Per rank, the classes the patch built there, and how many it saw (None: not reported).
    classes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    timed_out: bool = False
    cannot_run: Optional[str] = None
    crash: Optional[str] = None  # a rank exited before it was done: why, in one line
    killed: Optional[str] = None  # a rank was killed by a signal from outside

    def grade(self) -> _verify.Grade:
        return _verify.grade({result["model"]: result for result in self.results})


def models_to_run(requested: Optional[list[str]]) -> list[str]:
    """The runs of the models asked for, and of the causal LM, each with fully_shard and with
    composable DDP: without the control, a loss that differs could be torch's own doing or the
    patch's, and verify would have to guess."""
    models = list(dict.fromkeys(requested or _verify.MODELS))
    return _verify.runs(models if _verify.CONTROL in models else [*models, _verify.CONTROL])


def rank_command(models: list[str]) -> list[str]:
    """A rank: this Python, with this process's interpreter flags (what multiprocessing passes on
    to the interpreters it spawns), running the proof."""
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    return [sys.executable, *flags, "-m", "fsdp_autopatch._verify", *models]


def run_verify(options: argparse.Namespace, console: Console) -> int:
    run = VerifyRun(nproc=options.nproc, models=models_to_run(options.model))
    installation = _doctor.check_installation()
    missing = [name for name in PACKAGES if util.find_spec(name) is None]
    if installation.kind == _doctor.SOURCE_TREE:
        run.cannot_run = installation.detail
    elif missing:
        run.cannot_run = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                          f"installed for {sys.executable}; install torch and transformers into "
                          "this environment")
    else:
        ranks = "rank" if run.nproc == 1 else "ranks"
        console.progress(f"{PROG} verify: {run.nproc} {ranks} of {' '.join(rank_command([]))}, gloo on "
                         f"CPU (torch {installed_version('torch')}, transformers "
                         f"{installed_version('transformers')})")
        launch_and_follow(run, options.timeout, console)
    code, verdict = verify_verdict(run, options.timeout)
    warning = torch_warning(run)
    if options.json:
        print(json.dumps(verify_document(run, code, verdict, warning)), file=console.out)
    else:
        show_classes(run, console)
        if warning:
            console.warning(warning)
        console.verdict(verdict, "green" if code == EXIT_OK else "red")
    return code


def launch_and_follow(run: VerifyRun, timeout: float, console: Console) -> None:
    """Start the ranks, take their lines until they are done or the time is up, and stop
    whatever is left of them, however this ends (a time-out, Ctrl-C, a signal, a closed pipe)."""
    deadline = run.started + timeout
    port = str(_verify.free_port())
    ranks: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as stack:
        interruptions = stack.enter_context(Interruptions())
        errors = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(run.nproc)]
        try:
            for rank, error in enumerate(errors):
                ranks.append(start_rank(run, rank, port, error, group=ranks[0].pid if ranks else 0))
            follow(run, ranks, errors, deadline, console)
        finally:
            with interruptions.held():
                stop(ranks)
                for process in ranks:
                    if process.stdout is not None:
                        process.stdout.close()


def start_rank(run: VerifyRun, rank: int, port: str, error: IO[bytes], group: int) -> subprocess.Popen[bytes]:
    """Rank ``rank``, in the process group ``group`` (0: a new one, led by this rank). Not in
    verify's own group: a Ctrl-C at the terminal reaches verify alone, which stops them."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(run.nproc),
           "LOCAL_WORLD_SIZE": str(run.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    into_group = (lambda: os.setpgid(0, group)) if hasattr(os, "setpgid") else None
    return subprocess.Popen(rank_command(run.models), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=error, env=env, preexec_fn=into_group)


def follow(run: VerifyRun, ranks: list[subprocess.Popen[bytes]], errors: list[IO[bytes]], deadline: float,
           console: Console) -> None:
    """Take the ranks' lines as they arrive, until every rank is done, one failed, or the time
    is up. A time-out with every model's result in is no time-out: those results are judged."""
    pipes = Pipes(run, ranks, console)
    with pipes.selector:
        while pipes.open or any(process.poll() is None for process in ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                run.timed_out = len(run.results) < len(run.models)
                return
            if not pipes.read(min(remaining, POLL_SECONDS)):
                time.sleep(LOOK_SECONDS)  # every pipe closed: the ranks are exiting
            for rank, process in enumerate(ranks):
                if process.poll() not in (None, 0):  # the others may wait for it forever: stop
                    pipes.read(0)  # what it wrote before it ended
                    if run.cannot_run is None:
                        explain_failure(run, rank, process.returncode, errors[rank])
                    return


class Pipes:
    """The ranks' stdout pipes, read only when readable, each line taken as its rank's."""

    def __init__(self, run: VerifyRun, ranks: list[subprocess.Popen[bytes]], console: Console) -> None:
        self.run, self.console = run, console
        self.selector = selectors.DefaultSelector()
        self.open: dict[int, bytes] = {}  # per rank still writing, a line not yet ended
        for rank, process in enumerate(ranks):
            assert process.stdout is not None
            self.selector.register(process.stdout, selectors.EVENT_READ, rank)
            self.open[rank] = b""

    def read(self, timeout: float) -> bool:
        """Take what arrives within ``timeout``, then all that is there; whether any pipe is open."""
        while self.open:
            ready = self.selector.select(timeout)
            if not ready:
                break
            timeout = 0
            for key, _ in ready:
                rank = key.data
                chunk = os.read(key.fd, READ_BYTES)
                if not chunk:
                    self.selector.unregister(key.fileobj)
                    del self.open[rank]
                    continue
                *lines, self.open[rank] = (self.open[rank] + chunk).split(b"\n")
                for line in lines:
                    for record in _verify.json_lines(line.decode(errors="replace")):
                        take_record(self.run, rank, record, self.console)
        return bool(self.open)


def take_record(run: VerifyRun, rank: int, record: dict[str, Any], console: Console) -> None:
    if "cannot_run" in record and run.cannot_run is None:
        run.cannot_run = str(record["cannot_run"])
    elif "status" in record and run.status is None:
        run.status = record["status"]
        applied = "applied" if run.status.get("applied") else "not applied"
        console.progress(f"patch {applied}: {run.status.get('reason')}")
    elif "class_record" in record:
        run.classes.setdefault(rank, []).append(dict(record["class_record"]))
    elif "classes_listed" in record:
        run.classes.setdefault(rank, [])
        run.seen[rank] = int(record.get("classes_seen") or 0)
    elif "model" in record:
        run.results.append(record)
        # Graded against the control only at the end: it runs last.
        seen = _verify.outcome(record)
        word = SHOWN[seen].get(True, SHOWN[seen].get(False, seen))
        shown = console.paint(word, "green" if seen in _verify.SHARDED_OUTCOMES else "red", on_err=True)
        console.progress(f"[{len(run.results)}/{len(run.models)}] {record['model']}: {shown} "
                         f"({record.get('seconds') or 0.0:.1f} s)")


def explain_failure(run: VerifyRun, rank: int, code: int, error: IO[bytes]) -> None:
    """Why a rank ended before it was done: killed from outside, or failed (its last line)."""
    during = (f" during {run.models[len(run.results)]}" if run.status is not None
              and len(run.results) < len(run.models) else "")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        run.killed = f"rank {rank} was killed by {name}{hint}{during}; rerun it, with less else running"
        return
    error.seek(0)
    lines = [line.strip() for line in error.read().decode(errors="replace").splitlines() if line.strip()]
    last = lines[-1] if lines else "it printed nothing on stderr"
    run.crash = (f"rank {rank} exited with code {code}{during}: {last}; report it with the output of: "
                 f"{PROG} doctor --json")


def stop(ranks: list[subprocess.Popen[bytes]]) -> None:
    """End the ranks and whatever they started, their process group as one: SIGTERM, then
    SIGKILL for whatever is left after STOP_GRACE_SECONDS, and a wait of up to
    KILLED_WAIT_SECONDS for the killed to be gone. Finds nothing to do after ranks that ended."""
    if not ranks:
        return
    group = ranks[0].pid
    for signum, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS),
                         (getattr(signal, "SIGKILL", signal.SIGTERM), KILLED_WAIT_SECONDS)):
        if not group_alive(group, ranks):
            break
        with contextlib.suppress(OSError):  # gone since
            if hasattr(os, "killpg"):
                os.killpg(group, signum)
            else:
                for process in ranks:
                    process.send_signal(signum)
        until = time.monotonic() + wait
        while group_alive(group, ranks) and time.monotonic() < until:
            time.sleep(LOOK_SECONDS)
    for process in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=LOOK_SECONDS)  # reaped: no zombie is left behind


def group_alive(group: int, ranks: list[subprocess.Popen[bytes]]) -> bool:
    """Is any process of the ranks' group still running (a rank, or what a rank started)?"""
    running = [process for process in ranks if process.poll() is None]
    if running or not hasattr(os, "killpg"):
        return bool(running)
    try:
        os.killpg(group, 0)  # the reaped ranks are gone from it: what answers, a rank started
    except OSError:
        return False
    return True


class Interruptions:
    """Ctrl-C, SIGTERM and SIGHUP (a cancelled CI job, a closed terminal) while the ranks run:
    the first one ends verify (KeyboardInterrupt, or ``Terminated``: exit 128 + N), so that it
    stops them. While it stops them, a signal is held, and raised once they are stopped:
    nothing cuts the stopping short. A signal the parent ignores (``nohup``) stays ignored."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.holding = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Interruptions:
        for name in self.NAMES if threading.current_thread() is threading.main_thread() else ():
            number = getattr(signal, name, None)
            if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
                self.previous[number] = signal.signal(number, self.handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum
        if not self.holding:
            self.raise_received()

    def raise_received(self) -> None:
        if self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if self.received is not None:
            raise Terminated(self.received)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        self.raise_received()


def verify_verdict(run: VerifyRun, timeout: float) -> tuple[int, str]:
    """The exit code and the one line that says what happened and what to do."""
    if run.cannot_run:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.cannot_run}"
    if run.killed:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.killed}"
    if run.timed_out:
        return EXIT_CANNOT_TELL, (f"cannot verify: not finished within {timeout:g} s "
                                 f"({len(run.results)} of {len(run.models)} runs done); "
                                 "rerun with a larger --timeout on a less loaded machine")
    if run.crash and run.status is None:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.crash}"
    grade = run.grade()
    failed = [result for result in run.results if not grade.ok[result["model"]]]
    status = run.status or {}
    if failed:
        if all(grade.outcomes[result["model"]] == _verify.LAYOUT for result in failed):
            head = f"FAIL: {len(failed)} of {len(run.models)} runs hit the layout error"
        else:
            first = failed[0]
            what = (first.get("error") or first.get("train_error")
                    or f"losses differ by {first.get('max_loss_difference')}")
            head = f"FAIL: {len(failed)} of {len(run.models)} runs cannot be used ({first['model']}: {what})"
        if status.get("applied"):
            return EXIT_BROKEN, (f"{head}, although the patch was applied; please report it with the "
                                 f"output of: {PROG} doctor --json")
        return EXIT_BROKEN, f"{head}; the patch was not applied: {status.get('reason')}{remedy(status)}"
    if run.crash or len(run.results) < len(run.models):
        return EXIT_BROKEN, f"FAIL: {run.crash or 'rank 0 stopped before every model was done'}"
    done = f"{len(run.results)} of {len(run.models)} runs wrapped and trained"
    if grade.control == _verify.UNTRAINED:
        done = (f"{len(run.results)} of {len(run.models)} runs wrapped; FSDP2 cannot train in this torch "
                f"({control_result(run).get('train_error')})")
    if status.get("applied"):
        return EXIT_OK, f"OK: {done}; fixed by the patch, armed by {status.get('armed_by')}"
    return EXIT_OK, f"OK: {done}; no patch was needed: {status.get('reason')}"


def remedy(status: dict[str, Any]) -> str:
    """What to do, where the status's reason does not say it already."""
    if status.get("mode") == _config.OFF:
        return f"; unset {_config.MODE_VARIABLE} to let the patch run"
    if "fsdp_autopatch.apply()" in str(status.get("reason")):
        return ""
    return f"; see why with: {PROG} doctor"


def torch_warning(run: VerifyRun) -> Optional[str]:
    """One line when torch's own classes do not train as an unsharded copy does here: that is
    torch's behaviour, graded against but never blamed on the patch."""
    grade = run.grade()
    if grade.control not in (_verify.DRIFTED, _verify.DIVERGED) or run.cannot_run or run.timed_out:
        return None
    torch = (run.status or {}).get("torch") or installed_version("torch")
    return (f"warning: torch {torch}'s FSDP2 on {run.nproc} gloo CPU rank{'s' * (run.nproc > 1)} "
            f"trains differently from an unsharded copy even for the causal LM, which the patch never "
            f"touches (losses differ by {control_result(run).get('max_loss_difference'):.2g}); this is "
            "torch's own behaviour, not the layout bug, and does not decide the exit code")


def control_result(run: VerifyRun) -> dict[str, Any]:
    return next((result for result in run.results if result["model"] == _verify.CONTROL), {})


def show_classes(run: VerifyRun, console: Console) -> None:
    """Per rank, the classes that got a layout-compatible class (and on which parent), those
    for which none could be built, and how many kept torch's own class."""
    if run.status is None:  # no rank got as far as the models
        return
    console.detail(console.paint("classes the patch built, per rank:", "bold"))
    for rank in range(run.nproc):
        for line in class_lines(rank, run):
            console.detail(f"  {line}")


def class_lines(rank: int, run: VerifyRun) -> list[str]:
    head = f"rank {rank}:"
    if rank not in run.classes:
        return [f"{head} did not report its classes (it stopped before the end)"]
    lines, kept = [], []
    for record in run.classes[rank]:
        original = record.get("name")
        if record.get("outcome") == _layout.COMPATIBLE:
            lines.append(f"{head} {original} -> {record.get('wrapper')} on {record.get('parent')}")
        elif record.get("outcome") == _layout.REFUSED:
            lines.append(f"{head} {original} -> none that CPython accepts: {record.get('reason')}")
        else:
            kept.append(str(record.get("wrapper")))  # FSDPX and DDPX: one class per site
    if kept:
        lines.append(f"{head} torch's own class kept for {len(kept)}: {', '.join(kept)}")
    unlisted = run.seen.get(rank, 0) - len(run.classes[rank])
    if unlisted > 0:
        lines.append(f"{head} {unlisted} more not listed (status().classes keeps the first "
                     f"{len(run.classes[rank])})")
    if not lines:
        why = "" if (run.status or {}).get("applied") else " (the patch was not applied)"
        lines.append(f"{head} no class went through a patched site{why}")
    return lines


def verify_document(run: VerifyRun, code: int, verdict: str, warning: Optional[str]) -> dict[str, Any]:
    grade = run.grade()
    return {
        "exit_code": code,
        "ok": code == EXIT_OK,
        "verdict": verdict,
        "warning": warning,
        "version": fsdp_autopatch.__version__,
        "python": platform.python_version(),
        "executable": sys.executable,
        "command": rank_command([]),
        "torch": installed_version("torch"),
        "transformers": installed_version("transformers"),
        "nproc": run.nproc,
        "status": run.status,
        "models": [
            dict(result, result=SHOWN[grade.outcomes[result["model"]]][grade.ok[result["model"]]],
                 outcome=grade.outcomes[result["model"]], ok=grade.ok[result["model"]])
            for result in run.results
        ],
        # Every rank's classes, as status().classes lists them there; a rank that stopped
        # before reporting has "reported": false.
        "ranks": [{"rank": rank, "classes": run.classes.get(rank, []), "classes_seen": run.seen.get(rank),
                   "reported": rank in run.seen} for rank in range(run.nproc)],
        "timed_out": run.timed_out,
        "seconds": round(time.monotonic() - run.started, 2),
    }
