"""``fsdp-autopatch verify``, the parent side: launch the ranks with torchrun, follow them, judge.

The ranks run ``python -m fsdp_autopatch._verify`` under ``python -m torch.distributed.run`` with
this very interpreter, so the installed start-up file patches each of them exactly as it patches
a training process. This process never imports torch: it reads the ranks' JSON lines (rank 0's
results, every rank's list of the classes the patch built), grades the results with
``_verify.grade`` and prints a table, the classes per rank and one verdict line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import util
from pathlib import Path
from typing import Any, Iterator, Optional

import fsdp_autopatch
from fsdp_autopatch import _config, _layout, _verify
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
# Once the deadline or a signal has come, torchrun and the ranks get this long to exit on SIGTERM
# before verify kills whatever is left with SIGKILL. torchrun itself would give its ranks 30 s.
STOP_GRACE_SECONDS = 5.0
# A process killed with SIGKILL is gone at once unless it is in the kernel (writing to a slow
# disk, say); verify does not wait longer than this for that.
KILLED_WAIT_SECONDS = 2.0
# How often verify looks at torchrun, and how long it takes what is left in the pipe.
POLL_SECONDS = 0.5
# How often it looks again for what is left while it stops them.
LOOK_SECONDS = 0.05
# The longest verify takes from the deadline or a signal to its exit (the help states it): the
# pipe's rest, the grace and the wait for the killed.
STOPS_WITHIN_SECONDS = math.ceil(POLL_SECONDS + STOP_GRACE_SECONDS + KILLED_WAIT_SECONDS)
READ_BYTES = 65536
# Set in torchrun's environment, so inherited by every rank and whatever a rank starts. torchrun
# starts each rank in a session of its own, and a torchrun that dies before it stops them leaves
# them to init: verify finds every process of its run by this marker in /proc/<pid>/environ, not
# through torchrun.
RUN_MARKER_VARIABLE = "FSDP_AUTOPATCH_VERIFY_RUN"

# What a model's outcome is called in the table, when it counts (True) and when it does not.
SHOWN = {
    _verify.TRAINED: {True: "sharded"},
    _verify.DRIFTED: {True: "sharded", False: "loss mismatch"},
    _verify.DIVERGED: {True: "sharded", False: "loss mismatch"},
    _verify.UNTRAINED: {True: "sharded only", False: "train failed"},
    _verify.LAYOUT: {False: "layout error"},
    _verify.SHARD_FAILED: {False: "shard failed"},
}
# torchrun's summary of the first rank that failed (the same template in torch 2.4 - 2.15).
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


@dataclass
class RankClasses:
    """What one rank said about the classes the patch built in it (``status().classes``)."""

    rank: int
    classes: list[dict[str, Any]] = field(default_factory=list)
    listed: Optional[int] = None  # None until the rank's closing line arrived
    seen: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "classes": self.classes, "classes_seen": self.seen,
                "reported": self.listed is not None}


@dataclass
class VerifyRun:
    nproc: int
    models: list[str]
    started: float = field(default_factory=time.monotonic)
    status: Optional[dict[str, Any]] = None
    results: list[dict[str, Any]] = field(default_factory=list)
    ranks: dict[int, RankClasses] = field(default_factory=dict)
    timed_out: bool = False
    cannot_run: Optional[str] = None
    crash: Optional[str] = None
    launcher_killed: Optional[str] = None

    def rank(self, number: int) -> RankClasses:
        return self.ranks.setdefault(number, RankClasses(number))

    def grade(self) -> _verify.Grade:
        return _verify.grade({result["model"]: result for result in self.results})

    def shown(self, result: dict[str, Any], grade: _verify.Grade) -> tuple[str, bool]:
        good = grade.ok[result["model"]]
        return SHOWN[grade.outcomes[result["model"]]][good], good


def models_to_run(requested: Optional[list[str]]) -> list[str]:
    """The runs of the models asked for, and of the causal LM, each with fully_shard and with
    composable DDP: without the control, a loss that differs could be torch's own doing or the
    patch's, and verify would have to guess."""
    models = list(dict.fromkeys(requested or _verify.MODELS))
    return _verify.runs(models if _verify.CONTROL in models else [*models, _verify.CONTROL])


def run_verify(options: argparse.Namespace, console: Console) -> int:
    run = VerifyRun(nproc=options.nproc, models=models_to_run(options.model))
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
                         f"fsdp_autopatch._verify under torch.distributed.run, gloo on CPU (torch "
                         f"{installed_version('torch')}, transformers {installed_version('transformers')})")
        launch_and_follow(run, options.timeout, console)
    code, verdict = verify_verdict(run, options.timeout)
    warning = torch_warning(run)
    if options.json:
        print(json.dumps(verify_document(run, code, verdict, warning)), file=console.out)
    else:
        show_table(run, console)
        if warning:
            console.warning(warning)
        console.verdict(verdict, "green" if code == EXIT_OK else "red")
    return code


def launch_and_follow(run: VerifyRun, timeout: float, console: Console) -> None:
    deadline = run.started + timeout
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="fsdp-autopatch-verify-") as logs, \
            tempfile.TemporaryFile() as launcher_stderr, Interruptions() as interruptions:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(run.nproc),
                   # Each rank's stderr to its own file, for the last line of one that fails.
                   "--log-dir", logs, "--redirects", "2",
                   "-m", "fsdp_autopatch._verify", *run.models]
        launcher: Optional[subprocess.Popen[bytes]] = None
        ended: Optional[int] = None
        try:
            # A session of its own: a Ctrl-C at the terminal (SIGINT to the whole foreground
            # group) reaches verify alone, which stops the rest; torchrun, reached too, would
            # end with a failure of its own making.
            launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=launcher_stderr, start_new_session=True,
                                        env={**os.environ, RUN_MARKER_VARIABLE: marker})
            follow(run, launcher, deadline, console)
            ended = launcher.poll()  # None: verify stops it below, so its exit code says nothing
        finally:  # the time-out, Ctrl-C, SIGTERM, a closed pipe: nothing verify started outlives it
            with interruptions.held():
                stop(launcher, marker)
                if launcher is not None and launcher.stdout is not None:
                    launcher.stdout.close()
        # A launcher killed by a signal is said whatever its ranks reported; explain_failure
        # looks no further then.
        if ended is not None and ended != 0 and not run.timed_out and (run.cannot_run is None or ended < 0):
            launcher_stderr.seek(0)
            explain_failure(run, ended, launcher_stderr.read().decode(errors="replace"), Path(logs),
                            deadline)


def follow(run: VerifyRun, launcher: subprocess.Popen[bytes], deadline: float, console: Console) -> None:
    """Take rank 0's JSON lines as they arrive, until torchrun is done or the time is up.

    The pipe is read here, in the main thread, only when it is readable: a thread blocked in
    ``readline`` would keep it until every rank holding its other end had gone, and closing it
    under that thread would wait as long. A time-out with every model's result in is no
    time-out: those results are judged.
    """
    assert launcher.stdout is not None
    with Pipe(launcher.stdout.fileno(), run, console) as pipe:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if launcher.poll() is not None:
                # What torchrun and its ranks wrote before it ended; ranks it left behind
                # (killed before it could stop them) are stopped, not waited for.
                pipe.drain()
                return
            pipe.read(min(remaining, POLL_SECONDS))
            if pipe.ended:
                return wait_for_launcher(run, launcher, deadline)
        pipe.drain()  # what reached the pipe by the deadline arrived in time
    run.timed_out = len(run.results) < len(run.models)


class Pipe:
    """torchrun's stdout, shared by its ranks, read only when it is readable."""

    def __init__(self, descriptor: int, run: VerifyRun, console: Console) -> None:
        self.descriptor, self.run, self.console = descriptor, run, console
        self.selector = selectors.DefaultSelector()
        self.selector.register(descriptor, selectors.EVENT_READ)
        self.unfinished = b""  # a line not yet ended, completed by the next read
        self.ended = False  # every holder of the pipe has closed it

    def __enter__(self) -> Pipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.selector.close()

    def read(self, timeout: float) -> bool:
        """Take the lines that arrive within ``timeout``; whether anything came."""
        if self.ended or not self.selector.select(timeout):
            return False
        chunk = os.read(self.descriptor, READ_BYTES)
        self.ended = not chunk
        *lines, self.unfinished = (self.unfinished + chunk).split(b"\n")
        for line in lines:
            take_line(self.run, line.decode(errors="replace"), self.console)
        return not self.ended

    def drain(self) -> None:
        """Take what is in the pipe now, for up to POLL_SECONDS (a rank may go on writing)."""
        until = time.monotonic() + POLL_SECONDS
        while self.read(0) and time.monotonic() < until:
            pass


def wait_for_launcher(run: VerifyRun, launcher: subprocess.Popen[bytes], deadline: float) -> None:
    try:
        launcher.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        run.timed_out = len(run.results) < len(run.models)


def stop(launcher: Optional[subprocess.Popen[bytes]], marker: str) -> None:
    """End torchrun, every rank and whatever they started: SIGTERM, then SIGKILL for whatever
    is left after STOP_GRACE_SECONDS, and a wait of up to KILLED_WAIT_SECONDS for the killed
    to be gone. Finds nothing to do after a run that ended by itself."""
    for signum, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS),
                         (getattr(signal, "SIGKILL", signal.SIGTERM), KILLED_WAIT_SECONDS)):
        signal_all(launcher, marker, signum)
        until = time.monotonic() + wait
        while still_running(launcher, marker) and time.monotonic() < until:
            time.sleep(LOOK_SECONDS)
    if launcher is not None and launcher.poll() is None:
        launcher.wait()  # SIGKILLed: as good as gone


def still_running(launcher: Optional[subprocess.Popen[bytes]], marker: str) -> bool:
    return (launcher is not None and launcher.poll() is None) or bool(processes_marked(marker))


def signal_all(launcher: Optional[subprocess.Popen[bytes]], marker: str, signum: int) -> None:
    if launcher is not None and launcher.poll() is None:
        with contextlib.suppress(OSError):
            if hasattr(os, "killpg"):  # torchrun leads a group of its own (its session)
                os.killpg(launcher.pid, signum)
            else:
                launcher.send_signal(signum)
    for pid in processes_marked(marker):
        with contextlib.suppress(OSError):  # gone since it was found
            os.kill(pid, signum)


def processes_marked(marker: str) -> list[int]:
    """The live processes carrying this run's marker (zombies have no environment left to read);
    none where there is no /proc."""
    entry = f"{RUN_MARKER_VARIABLE}={marker}".encode()
    found = []
    with contextlib.suppress(OSError):
        for process in os.scandir("/proc"):
            if not process.name.isdigit() or int(process.name) == os.getpid():
                continue
            try:
                with open(os.path.join(process.path, "environ"), "rb") as environ:
                    if entry in environ.read().split(b"\0"):
                        found.append(int(process.name))
            except OSError:  # gone, or another user's
                pass
    return found


class Interruptions:
    """Ctrl-C, SIGTERM and SIGHUP (a cancelled CI job, a closed terminal) while verify's
    processes run: the first one ends verify (KeyboardInterrupt, or ``Terminated``: exit
    128 + N), so that it stops them. While it stops them, a signal is held, and raised once
    they are stopped: nothing cuts the stopping short. A signal the parent ignores (``nohup``)
    stays ignored."""

    NAMES = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self.holding = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Interruptions:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            for name in self.NAMES:
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


def take_line(run: VerifyRun, line: str, console: Console) -> None:
    # Two ranks' objects can share one line of the pipe they share: take every one.
    for record in _verify.json_lines(line):
        take_record(run, record, console)


def take_record(run: VerifyRun, record: dict[str, Any], console: Console) -> None:
    if "cannot_run" in record and run.cannot_run is None:
        run.cannot_run = str(record["cannot_run"])
    elif "status" in record and run.status is None:
        run.status = record["status"]
        applied = "applied" if run.status.get("applied") else "not applied"
        console.progress(f"patch {applied}: {run.status.get('reason')}")
    elif "class_record" in record and isinstance(record.get("rank"), int):
        run.rank(record["rank"]).classes.append(dict(record["class_record"]))
    elif "classes_listed" in record and isinstance(record.get("rank"), int):
        ranked = run.rank(record["rank"])
        ranked.listed, ranked.seen = int(record["classes_listed"]), int(record.get("classes_seen") or 0)
    elif "model" in record:
        run.results.append(record)
        # Graded against the control only at the end: it runs last.
        seen = _verify.outcome(record)
        word = SHOWN[seen].get(True, SHOWN[seen].get(False, seen))
        shown = console.paint(word, "green" if seen in _verify.SHARDED_OUTCOMES else "red", on_err=True)
        console.progress(f"[{len(run.results)}/{len(run.models)}] {record['model']}: {shown} "
                         f"({record.get('seconds') or 0.0:.1f} s)")


def explain_failure(run: VerifyRun, code: int, launcher_stderr: str, logs: Path, deadline: float) -> None:
    """Why torchrun failed: this interpreter cannot run the proof, a rank crashed, or something
    outside killed torchrun itself."""
    during = (f" during {run.models[len(run.results)]}" if run.status is not None
              and len(run.results) < len(run.models) else "")
    if code < 0:  # not the ranks' doing: torchrun that stops its ranks exits with a code of its own
        run.launcher_killed = (f"torch.distributed.run was killed by {killed_by(-code)}{during}; "
                               "rerun it, with less else running on the machine")
        return
    if run.status is None:
        # No rank got as far as the models: torchrun itself may be missing (a torch built
        # without torch.distributed). Only now is the price of a separate check worth paying.
        try:
            check = subprocess.run([sys.executable, "-m", "fsdp_autopatch._verify", "--check"],
                                   capture_output=True, text=True, check=False,
                                   timeout=max(POLL_SECONDS, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            run.timed_out = True
            return
        (problem,) = [line["cannot_run"] for line in _verify.json_lines(check.stdout)][:1] or [None]
        if problem is not None:
            run.cannot_run = problem
            return
    cause = ROOT_CAUSE.search(launcher_stderr)
    if cause is None:
        run.crash = (f"torch.distributed.run exited with code {code}{during}: "
                     f"{last_line(launcher_stderr, 'it printed nothing on stderr')}; report it with "
                     f"the output of: {PROG} doctor --json")
        return
    rank, rank_code = int(cause.group(1)), int(cause.group(2))
    if rank_code < 0:
        run.crash = (f"rank {rank} was killed by {killed_by(-rank_code)}{during}; rerun it, with less "
                     "else running on the machine")
        return
    stderr = "".join(path.read_text(errors="replace") for path in logs.rglob(f"{rank}/stderr.log"))
    run.crash = (f"rank {rank} exited with code {rank_code}{during}: "
                 f"{last_line(stderr, f'rank {rank} printed nothing on stderr')}; report it with the "
                 f"output of: {PROG} doctor --json")


def killed_by(number: int) -> str:
    name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
    return f"{name} (out of memory?)" if name == "SIGKILL" else name


def last_line(text: str, otherwise: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else otherwise


def verify_verdict(run: VerifyRun, timeout: float) -> tuple[int, str]:
    """The exit code and the one line that says what happened and what to do."""
    # A launcher killed from outside comes first: its ranks then fail in ways of their own (a
    # process group that loses its store says it "did not form").
    if run.launcher_killed:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.launcher_killed}"
    if run.cannot_run:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.cannot_run}"
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
        first = failed[0]
        what = (first.get("error") or first.get("train_error")
                or f"losses differ by {first.get('max_loss_difference')}")
        head = (f"FAIL: {len(failed)} of {len(run.models)} runs cannot be used with FSDP2 or DDP "
                f"({failed[0]['model']}: {what})")
        if status.get("applied"):
            return EXIT_BROKEN, (f"{head}, although the patch was applied; please report it with "
                                 f"the output of: {PROG} doctor --json")
        return EXIT_BROKEN, f"{head}; the patch was not applied: {status.get('reason')}; {remedy(status)}"
    if run.crash or len(run.results) < len(run.models):
        return EXIT_BROKEN, f"FAIL: {run.crash or 'rank 0 stopped before every model was done'}"
    done = (f"{len(run.results)} of {len(run.models)} runs wrapped (FSDP2 fully_shard, composable DDP "
            "replicate) and trained")
    if grade.control == _verify.UNTRAINED:
        done = (f"{len(run.results)} of {len(run.models)} runs wrapped with FSDP2 and DDP; FSDP2 cannot "
                f"train in this torch ({control_result(run).get('train_error')})")
    if status.get("applied"):
        return EXIT_OK, (f"OK: {done}; the patch was applied at start-up, as it will be in training "
                         f"processes of this Python (torch {status.get('torch')} with transformers "
                         f"{status.get('transformers')} has the bug)")
    return EXIT_OK, f"OK: {done}; no patch was needed: {status.get('reason')}"


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


def remedy(status: dict[str, Any]) -> str:
    if status.get("mode") == _config.OFF:
        return f"unset {_config.MODE_VARIABLE} to let the patch run"
    return f"see why with: {PROG} doctor"


def show_table(run: VerifyRun, console: Console) -> None:
    if run.status is None:  # no rank got as far as the models
        return
    grade = run.grade()
    width = max(len("model"), *(len(name) for name in run.models))
    console.detail(console.paint(f"{'model':<{width}}  {'result':<13}  {'seconds':>7}", "bold"))
    done = {result["model"]: result for result in run.results}
    for name in run.models:
        if name in done:
            shown, good = run.shown(done[name], grade)
            seconds = f"{done[name].get('seconds', 0.0):7.2f}"
        else:
            shown, good, seconds = "not run", False, f"{'-':>7}"
        console.detail(f"{name:<{width}}  {console.paint(f'{shown:<13}', 'green' if good else 'red')}"
                       f"  {seconds}")
    show_classes(run, console)


def show_classes(run: VerifyRun, console: Console) -> None:
    """Per rank, the classes that got a layout-compatible class (and on which parent), those
    for which none could be built, and how many kept torch's own class."""
    applied = bool((run.status or {}).get("applied"))
    console.detail(console.paint("classes the patch built, per rank:", "bold"))
    for number in range(run.nproc):
        for line in class_lines(run.ranks.get(number, RankClasses(number)), applied):
            console.detail(f"  {line}")


def class_lines(ranked: RankClasses, applied: bool) -> list[str]:
    head = f"rank {ranked.rank}:"
    if ranked.listed is None and not ranked.classes:
        return [f"{head} did not report its classes (it stopped before the end)"]
    lines = []
    kept = []
    for record in ranked.classes:
        original = record.get("name")
        if record.get("outcome") == _layout.COMPATIBLE:
            lines.append(f"{head} {original} -> {record.get('wrapper')} on {record.get('parent')}")
        elif record.get("outcome") == _layout.REFUSED:
            lines.append(f"{head} {original} -> none that CPython accepts: {record.get('reason')}")
        else:
            kept.append(str(record.get("wrapper")))  # FSDPX and DDPX: one class per site
    if kept:
        lines.append(f"{head} torch's own class kept for {len(kept)}: {', '.join(kept)}")
    unlisted = (ranked.seen or 0) - len(ranked.classes)
    if unlisted > 0:
        lines.append(f"{head} {unlisted} more not listed (status().classes keeps the first "
                     f"{len(ranked.classes)})")
    if not lines:
        why = "" if applied else " (the patch was not applied)"
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
        "torch": installed_version("torch"),
        "transformers": installed_version("transformers"),
        "nproc": run.nproc,
        "status": run.status,
        "models": [
            dict(result, result=run.shown(result, grade)[0], outcome=grade.outcomes[result["model"]],
                 ok=grade.ok[result["model"]])
            for result in run.results
        ],
        # Every rank's classes, as status().classes lists them there; a rank that stopped
        # before reporting has "reported": false.
        "ranks": [run.rank(number).to_dict() for number in range(run.nproc)],
        "timed_out": run.timed_out,
        "seconds": round(time.monotonic() - run.started, 2),
    }
