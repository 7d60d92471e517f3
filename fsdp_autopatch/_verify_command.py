"""``fsdp-autopatch verify``, the parent side: start the ranks, follow them, judge.

Each rank runs ``_verify`` in this very Python with this process's interpreter flags and
environment, so it is armed, or not, as a training script run the same way would be; the
launchers users run are proven by the tests. This process never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from importlib import util
from pathlib import Path
from typing import IO, Any, Iterator, Optional

import fsdp_autopatch
from fsdp_autopatch import _classes, _config, _console, _doctor, _verify
from fsdp_autopatch._console import (
    EXIT_CANNOT_TELL,
    EXIT_NOT_FIXED,
    EXIT_OK,
    PROG,
    Console,
    installed_version,
)

DEFAULT_TIMEOUT = 300.0
# Once the deadline or a signal has come, the ranks get this long to exit on SIGTERM before
# verify kills whatever is left of their process group with SIGKILL; a process killed so is gone
# at once unless it is in the kernel (writing to a slow disk), which verify waits no longer for.
STOP_GRACE_SECONDS = 5.0
KILLED_WAIT_SECONDS = 2.0
# How often verify looks at the ranks and what they wrote.
LOOK_SECONDS = 0.05
# The longest verify takes from the deadline or a signal to its exit (the help states it).
STOPS_WITHIN_SECONDS = math.ceil(LOOK_SECONDS + STOP_GRACE_SECONDS + KILLED_WAIT_SECONDS)
HELD_SIGNALS = {getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)}
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
    # Per rank, the classes the patch built there, and how many it saw, once it said.
    classes: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    seen: dict[int, int] = field(default_factory=dict)
    timed_out: bool = False
    cannot_run: Optional[str] = None
    crash: Optional[str] = None  # a rank failed before it was done: why, in one line

    def grade(self) -> _verify.Grade:
        return _verify.grade({result["model"]: result for result in self.results})


def models_to_run(requested: Optional[list[str]]) -> list[str]:
    """The runs of the models asked for and of the causal LM, with fully_shard and composable DDP:
    without the control, a loss that differs could be torch's doing or the patch's."""
    models = list(dict.fromkeys(requested or _verify.MODELS))
    return _verify.runs(models if _verify.CONTROL in models else [*models, _verify.CONTROL])


def rank_command(models: list[str]) -> list[str]:
    """A rank: this Python with this process's interpreter flags (as multiprocessing passes them on)."""
    flags = subprocess._args_from_interpreter_flags()  # type: ignore[attr-defined]
    return [sys.executable, *flags, "-m", "fsdp_autopatch._verify", *models]


def run_verify(options: argparse.Namespace, console: Console) -> int:
    run = VerifyRun(nproc=options.nproc, models=models_to_run(options.model))
    kind, detail = _doctor.check_installation()
    missing = [name for name in _console.TRAINING_PACKAGES if util.find_spec(name) is None]
    if kind == _doctor.SOURCE_TREE:
        run.cannot_run = detail
    elif missing:
        run.cannot_run = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                          f"for {sys.executable}; install torch and transformers into this environment")
    else:
        try:  # the ranks' output goes to files there
            scratch = tempfile.TemporaryDirectory(prefix="fsdp-autopatch-verify-")
        except OSError as error:  # a read-only root, as in some containers: no verdict, and why
            run.cannot_run = f"no temporary directory for the ranks' output ({error}); set TMPDIR to a " \
                             "writable directory"
        else:
            versions = f"torch {installed_version('torch')}, transformers {installed_version('transformers')}"
            console.progress(f"{PROG} verify: {run.nproc} rank{'s' * (run.nproc > 1)} of "
                             f"{' '.join(rank_command([]))}, gloo on CPU ({versions})")
            with scratch:
                launch_and_follow(run, options.timeout, console, Path(scratch.name))
    code, verdict = verify_verdict(run, options.timeout)
    warning = torch_warning(run)
    if options.json:
        print(json.dumps(verify_document(run, code, verdict, warning)), flush=True)
        return code
    if run.status is not None:  # a rank got as far as the models
        console.detail(console.paint("classes the patch built, per rank:", "bold"))
        for rank in range(run.nproc):
            for line in class_lines(rank, run):
                console.detail(f"  {line}")
    if warning:
        console.warning(warning)
    console.verdict(verdict, "green" if code == EXIT_OK else "red")
    return code


def launch_and_follow(run: VerifyRun, timeout: float, console: Console, scratch: Path) -> None:
    """Start the ranks (their output into files in ``scratch``), follow them, and stop what is
    left of them however this ends: a time-out, Ctrl-C, a signal, a closed pipe."""
    port = str(_verify.free_port())
    ranks: list[subprocess.Popen[bytes]] = []
    with signals_end_verify(), contextlib.ExitStack() as files:
        try:
            outputs = []
            for rank in range(run.nproc):
                out, err = (scratch / f"{rank}.{name}" for name in ("out", "err"))
                env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(run.nproc),
                       "LOCAL_WORLD_SIZE": str(run.nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
                with out.open("wb") as stdout, err.open("wb") as stderr:
                    ranks.append(subprocess.Popen(
                        rank_command(run.models), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                        env=env, preexec_fn=into_group(ranks[0].pid if ranks else 0)))
                outputs.append(files.enter_context(out.open("rb")))
            follow(run, ranks, outputs, run.started + timeout, console, scratch)
        finally:
            stop(ranks)


def into_group(group: int) -> Any:
    """For ``preexec_fn``: the rank joins process group ``group`` (0: a new one, which it leads),
    not verify's: a Ctrl-C at the terminal reaches verify alone, which stops them."""
    return (lambda: os.setpgid(0, group)) if hasattr(os, "setpgid") else None


def follow(run: VerifyRun, ranks: list[subprocess.Popen[bytes]], outputs: list[IO[bytes]], deadline: float,
           console: Console, scratch: Path) -> None:
    """Take the ranks' lines as they are written. A time-out with every model's result in is no
    time-out: those results are judged."""
    unfinished = [b""] * len(ranks)
    while True:
        ended = [process.poll() for process in ranks]  # what they wrote before that is read now
        for rank, output in enumerate(outputs):
            *lines, unfinished[rank] = (unfinished[rank] + output.read()).split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):  # what else a rank printed on stdout
                    take_record(run, rank, json.loads(line), console)
        failed = next(((rank, code) for rank, code in enumerate(ended) if code not in (None, 0)), None)
        if failed is not None:  # the others may wait for it forever: stop them
            if run.cannot_run is None:
                explain_failure(run, *failed, scratch / f"{failed[0]}.err")
            return
        if all(code == 0 for code in ended):
            return
        if time.monotonic() >= deadline:
            run.timed_out = len(run.results) < len(run.models)
            return
        time.sleep(LOOK_SECONDS)


def take_record(run: VerifyRun, rank: int, record: Any, console: Console) -> None:
    if not isinstance(record, dict):
        return
    if "cannot_run" in record and run.cannot_run is None:
        run.cannot_run = str(record["cannot_run"])
    elif "status" in record and run.status is None:
        run.status = record["status"]
        console.progress(f"patch {'applied' if run.status.get('applied') else 'not applied'}: "
                         f"{run.status.get('reason')}")
    elif "classes" in record:
        run.classes[rank], run.seen[rank] = list(record["classes"]), int(record.get("classes_seen") or 0)
    elif "model" in record:
        run.results.append(record)
        # Graded against the control only at the end: it runs last.
        seen = _verify.outcome(record)
        word = SHOWN[seen].get(True, SHOWN[seen].get(False, seen))
        shown = console.paint(word, "green" if seen in _verify.SHARDED_OUTCOMES else "red", on_err=True)
        console.progress(f"[{len(run.results)}/{len(run.models)}] {record['model']}: {shown} "
                         f"({record.get('seconds') or 0.0:.1f} s)")


def explain_failure(run: VerifyRun, rank: int, code: int, stderr: Path) -> None:
    """Why a rank ended before it was done: killed from outside, or failed (its last line)."""
    during = (f" during {run.models[len(run.results)]}" if run.status is not None
              and len(run.results) < len(run.models) else "")
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        run.cannot_run = f"rank {rank} was killed by {name}{hint}{during}; rerun it, with less else running"
        return
    lines = [line.strip() for line in stderr.read_text(errors="replace").splitlines() if line.strip()]
    run.crash = (f"rank {rank} exited with code {code}{during}: "
                 f"{lines[-1] if lines else 'it printed nothing on stderr'}; report it with the output of: "
                 f"{PROG} doctor --json")


def stop(ranks: list[subprocess.Popen[bytes]]) -> None:
    """End the ranks' process group as one: SIGTERM, then SIGKILL after STOP_GRACE_SECONDS; leave
    no zombie. Meanwhile Ctrl-C and signals wait (the kernel keeps them pending), and end verify
    once it is done: nothing cuts the stopping short."""
    hold = getattr(signal, "pthread_sigmask", None)  # POSIX
    if hold is not None:
        hold(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        for signum, wait in ((signal.SIGTERM, STOP_GRACE_SECONDS),
                             (getattr(signal, "SIGKILL", signal.SIGTERM), KILLED_WAIT_SECONDS)):
            until = time.monotonic() + wait
            if group_alive(ranks, signum):
                while group_alive(ranks) and time.monotonic() < until:
                    time.sleep(LOOK_SECONDS)
        for process in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=LOOK_SECONDS)
    finally:
        if hold is not None:
            hold(signal.SIG_UNBLOCK, HELD_SIGNALS)


def group_alive(ranks: list[subprocess.Popen[bytes]], signum: int = 0) -> bool:
    """Is any process of the ranks' group still running (a rank, or what a rank started)? With
    ``signum``, send it to them all first."""
    running = [process for process in ranks if process.poll() is None]
    if not ranks or not hasattr(os, "killpg"):
        for process in running if signum else ():
            process.send_signal(signum)
        return bool(running)
    try:
        os.killpg(ranks[0].pid, signum)  # reaped ranks are gone from it: what answers, a rank started
    except OSError:
        return False
    return True


@contextlib.contextmanager
def signals_end_verify() -> Iterator[None]:
    """SIGTERM and SIGHUP (a cancelled CI job, a closed terminal) end verify as Ctrl-C does, by an
    exception (exit 128 + N) once it has stopped its ranks; one its parent ignores (nohup) stays so."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only it may set handlers
        for name in ("SIGTERM", "SIGHUP"):
            number = getattr(signal, name, None)
            if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
                previous[number] = signal.signal(number, raise_terminated)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def raise_terminated(signum: int, frame: object) -> None:
    raise _console.Terminated(signum)


def verify_verdict(run: VerifyRun, timeout: float) -> tuple[int, str]:
    """The exit code and the one line that says what happened and what to do."""
    done = f"{len(run.results)} of {len(run.models)} runs"
    if run.cannot_run:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.cannot_run}"
    if run.timed_out:
        return EXIT_CANNOT_TELL, (f"cannot verify: not finished within {timeout:g} s ({done} done); rerun "
                                  "with a larger --timeout on a less loaded machine")
    if run.crash and run.status is None:
        return EXIT_CANNOT_TELL, f"cannot verify: {run.crash}"
    grade = run.grade()
    failed = [result for result in run.results if not grade.ok[result["model"]]]
    status = run.status or {}
    if failed:
        head = f"FAIL: {len(failed)} of {len(run.models)} runs"
        if all(grade.outcomes[result["model"]] == _verify.LAYOUT for result in failed):
            head += " hit the layout error"
        else:
            first = failed[0]
            what = (first.get("error") or first.get("train_error")
                    or f"losses differ by {first.get('max_loss_difference')}")
            head += f" cannot be used ({first['model']}: {what})"
        if status.get("applied"):
            return EXIT_NOT_FIXED, (f"{head}, although the patch was applied; please report it with the "
                                    f"output of: {PROG} doctor --json")
        reason = str(status.get("reason"))
        remedy = (f"; unset {_config.MODE_VARIABLE} to let the patch run" if status.get("mode") == _config.OFF
                  else "" if "fsdp_autopatch.apply()" in reason else f"; see why: {PROG} doctor")
        return EXIT_NOT_FIXED, f"{head}; the patch was not applied: {reason}{remedy}"
    if run.crash or len(run.results) < len(run.models):
        return EXIT_NOT_FIXED, f"FAIL: {run.crash or 'rank 0 stopped before every model was done'}"
    done += " wrapped and trained"
    if grade.control == _verify.UNTRAINED:
        done = f"{len(run.results)} of {len(run.models)} runs wrapped; FSDP2 cannot train in this torch " \
               f"({control_result(run).get('train_error')})"
    if status.get("applied"):
        return EXIT_OK, f"OK: {done}; fixed by the patch, armed by {status.get('armed_by')}"
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


def class_lines(rank: int, run: VerifyRun) -> list[str]:
    """A rank's classes: each that got a layout-compatible class (on which parent) or none, and
    how many kept torch's own class (FSDPX and DDPX: one per site)."""
    records = run.classes.get(rank)
    if records is None:
        return [f"rank {rank}: did not report its classes (it stopped before the end)"]
    lines = [f"rank {rank}: {record['name']} -> " + (f"{record['wrapper']} on {record['parent']}"
             if record["outcome"] == _classes.COMPATIBLE
             else f"none that CPython accepts: {record['reason']}")
             for record in records if record["outcome"] != _classes.TORCH]
    kept = [record["wrapper"] for record in records if record["outcome"] == _classes.TORCH]
    if kept:
        lines.append(f"rank {rank}: torch's own class kept for {len(kept)}: {', '.join(kept)}")
    if run.seen.get(rank, 0) > len(records):
        lines.append(f"rank {rank}: {run.seen[rank] - len(records)} more not listed (status().classes "
                     f"keeps the first {len(records)})")
    why = "" if (run.status or {}).get("applied") else " (the patch was not applied)"
    return lines or [f"rank {rank}: no class went through a patched site{why}"]


def verify_document(run: VerifyRun, code: int, verdict: str, warning: Optional[str]) -> dict[str, Any]:
    grade = run.grade()
    return {
        "exit_code": code, "ok": code == EXIT_OK, "verdict": verdict, "warning": warning,
        "version": fsdp_autopatch.__version__, "python": platform.python_version(),
        "executable": sys.executable, "command": rank_command([]),
        "torch": installed_version("torch"), "transformers": installed_version("transformers"),
        "nproc": run.nproc, "status": run.status,
        "models": [dict(result, result=SHOWN[grade.outcomes[result["model"]]][grade.ok[result["model"]]],
                        outcome=grade.outcomes[result["model"]], ok=grade.ok[result["model"]])
                   for result in run.results],
        # Per rank, status().classes there; "reported": false for a rank that stopped before saying.
        "ranks": [{"rank": rank, "classes": run.classes.get(rank, []), "classes_seen": run.seen.get(rank),
                   "reported": rank in run.seen} for rank in range(run.nproc)],
        "timed_out": run.timed_out, "seconds": round(time.monotonic() - run.started, 2),
    }
