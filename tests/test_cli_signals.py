"""A closed pipe and Ctrl-C end the command quietly, in real subprocesses.

A closed pipe (``fsdp-autopatch doctor | head -1``): exit 141, what a shell reports for a
coreutils command cut off the same way, with nothing on stderr: no traceback, and no "Exception
ignored" from the interpreter's last flush. Ctrl-C: exit 130 and one line on stderr.

The fast tests run ``verify`` on the stand-in torch (tests/stand_in/) whose ``torch.distributed``
is tests/programs/fake_process_group.py: each rank says when it started and waits to be told to go on, so
that the signal or the closed pipe meets verify at a known point, while it follows its ranks;
the slow ones run the real torch.

However verify is stopped (its deadline, Ctrl-C to it or to its whole process group as a
terminal sends it, SIGTERM, a rank killed from outside), it says so with its own exit code,
returns within the bound its help states, and leaves no process running: not even what a rank
started, deaf to SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import (
    PROGRAMS,
    alive,
    ctrl_c_as_at_a_terminal,
    environment,
    fake_torch,
    fake_transformers,
    make_throwaway,
    marked_run,
    needs_proc,
    own_lines,
    processes_marked,
    site_packages,
    verify_at_work,
)

from fsdp_autopatch import _verify
from fsdp_autopatch._verify_command import STOPS_WITHIN_SECONDS

EXIT_CLOSED_PIPE = 141
EXIT_INTERRUPTED = 130

FAKE_PROCESS_GROUP = PROGRAMS / "fake_process_group.py"

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name == "nt",
                                reason="POSIX signals and pipes")


@pytest.fixture(scope="module")
def stand_in(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of an environment whose torch is the stand-in, with tests/programs/fake_process_group.py
    as its ``torch.distributed``."""
    throwaway = make_throwaway(tmp_path_factory.mktemp("stand-in") / "venv", installed)
    fake_torch(throwaway.site_packages)
    distributed = throwaway.site_packages / "torch" / "distributed"
    (distributed / "__init__.py").write_text(FAKE_PROCESS_GROUP.read_text(encoding="utf-8"))
    (distributed / "device_mesh.py").write_text("def init_device_mesh(*args, **kwargs):\n    return None\n")
    fake_transformers(throwaway.site_packages, '__version__ = "4.55.2"\n\n\nclass Qwen2Config:\n    pass\n')
    return str(throwaway.python)


def closed_pipe() -> int:
    """The write end of a pipe whose read end is already closed."""
    read, write = os.pipe()
    os.close(read)
    return write


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 60) -> str:  # type: ignore[type-arg]
    deadline = time.monotonic() + seconds
    while not path.exists() or not path.read_text():
        assert process.poll() is None, f"the command ended first, with {process.returncode}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def stand_in_verify(python: str, tmp_path: Path, *args: str, env: Optional[dict[str, str]] = None,
                    **popen: object) -> tuple[subprocess.Popen, Path, Path]:  # type: ignore[type-arg]
    started, go = tmp_path / "started", tmp_path / "go"
    env = environment(FAKE_RANK_STARTED=str(started), FAKE_RANK_GO=str(go), **(env or {}))
    popen.setdefault("preexec_fn", ctrl_c_as_at_a_terminal)
    process = subprocess.Popen([python, "-m", "fsdp_autopatch", "verify", *args], env=env, cwd=tmp_path,
                               **popen)  # type: ignore[call-overload]
    return process, started, go


# --------------------------------------------------------------------------------------------- closed pipe


@pytest.mark.parametrize("args", [("doctor",), ("doctor", "--json"), ("--help",), ("doctor", "--help"),
                                  ("--version",)])
def test_output_into_a_closed_pipe_exits_141_with_nothing_on_stderr(
    installed: Path, args: tuple[str, ...]
) -> None:
    write = closed_pipe()
    try:
        result = subprocess.run([sys.executable, "-m", "fsdp_autopatch", *args], stdout=write,
                                stderr=subprocess.PIPE, text=True, env=environment(),
                                cwd=site_packages().parent, timeout=120, check=False)
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (EXIT_CLOSED_PIPE, "")


def test_doctor_piped_into_a_reader_of_one_line_leaves_no_traceback(installed: Path) -> None:
    # As `fsdp-autopatch doctor | head -1`: whether the reader is gone before doctor's last line
    # is a race, so either ending is right, and neither prints anything.
    process = subprocess.Popen([sys.executable, "-m", "fsdp_autopatch", "doctor"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment(),
                               cwd=site_packages().parent)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith("fsdp-autopatch ")
    process.stdout.close()
    assert process.wait(timeout=120) in (0, EXIT_CLOSED_PIPE)
    assert process.stderr.read() == ""
    process.stderr.close()


def test_verify_whose_reader_left_stops_its_ranks_and_exits_141(stand_in: str, tmp_path: Path) -> None:
    # As `fsdp-autopatch verify 2>&1 | head -1`: the reader takes the first progress line and
    # leaves; verify's next line, once the rank says it is at work, meets the closed pipe.
    read, write = os.pipe()
    process, started, go = stand_in_verify(stand_in, tmp_path, stdout=write, stderr=write)
    os.close(write)
    with os.fdopen(read) as reader:
        assert reader.readline().startswith("fsdp-autopatch verify: 1 rank of ")
    rank = int(wait_for(started, process))
    go.touch()
    assert process.wait(timeout=120) == EXIT_CLOSED_PIPE
    assert not alive(rank)


# --------------------------------------------------------------------------------------------- Ctrl-C


def interrupted(process: subprocess.Popen, whole_group: bool = False) -> str:  # type: ignore[type-arg]
    """Send SIGINT, as Ctrl-C does: to the command alone, or to its whole process group as a
    terminal does (the command must have been started in a session of its own); its stderr."""
    if whole_group:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    return str(stderr)


@pytest.mark.parametrize("whole_group", [False, True], ids=["to verify", "to its process group"])
def test_ctrl_c_while_verify_waits_for_its_ranks_exits_130_with_one_line(
    stand_in: str, tmp_path: Path, whole_group: bool
) -> None:
    process, started, _ = stand_in_verify(stand_in, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=whole_group)
    rank = int(wait_for(started, process))
    stderr = interrupted(process, whole_group)
    progress, last = stderr.splitlines()  # the start line, then the one about the interruption
    assert progress.startswith("fsdp-autopatch verify: 1 rank of ")
    assert last == "fsdp-autopatch verify: interrupted"
    assert not alive(rank), "verify left its rank running"


def ignore_ctrl_c() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_ctrl_c_its_parent_ignores_leaves_verify_running(stand_in: str, tmp_path: Path) -> None:
    """As ``verify &`` in a script, which starts it with SIGINT ignored: Ctrl-C is not for it."""
    process, started, go = stand_in_verify(stand_in, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True, start_new_session=True, preexec_fn=ignore_ctrl_c)
    rank = int(wait_for(started, process))
    os.killpg(process.pid, signal.SIGINT)
    go.touch()
    assert process.stderr is not None
    for line in process.stderr:  # still at work: it takes the status line printed after the go
        if line.startswith("patch "):
            break
    assert process.poll() is None and alive(rank)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    assert own_lines(stderr) == ["fsdp-autopatch verify: stopped by SIGTERM"]
    assert not alive(rank)


def trained(model: str) -> str:
    """rank 0's line for a model that sharded and trained as an unsharded copy does."""
    return json.dumps({"model": model, "sharded": True, "trained": True, "losses": [1.0, 0.9],
                       "reference_losses": [1.0, 0.9], "max_loss_difference": 0.0, "seconds": 0.1})


def test_a_time_out_after_every_model_reported_judges_the_results(stand_in: str, tmp_path: Path) -> None:
    (tmp_path / "go").touch()  # every line at once, then the stand-in hangs, as a rank in teardown may
    runs = _verify.runs(_verify.MODELS)  # every model with fully_shard and with composable DDP
    env = {"FAKE_RANK_RESULTS": "\n".join(trained(run) for run in runs)}
    process, started, _ = stand_in_verify(stand_in, tmp_path, "--timeout", "10", env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stdout + stderr
    done = len(runs)
    assert stdout.splitlines()[-1] == (
        f"OK: {done} of {done} runs wrapped and trained; no patch was needed: a stand-in for "
        "torch.distributed")
    assert not alive(int(started.read_text()))


RUNS = len(_verify.runs(_verify.MODELS))
# How each case stops verify: the exit code, and the last line it prints there: the verdict on
# stdout, or on stderr the one line a signal gets.
STOPPED = {
    "time-out": (2, "stdout", f"cannot verify: not finished within 10 s (0 of {RUNS} runs done); rerun with "
                              "a larger --timeout on a less loaded machine"),
    "SIGTERM": (128 + signal.SIGTERM, "stderr", "fsdp-autopatch verify: stopped by SIGTERM"),
    "Ctrl-C to the group": (EXIT_INTERRUPTED, "stderr", "fsdp-autopatch verify: interrupted"),
    "rank killed": (2, "stdout", "cannot verify: rank 0 was killed by SIGKILL (out of memory?); rerun it, "
                                 "with less else running"),
}


@needs_proc
@pytest.mark.parametrize("how", list(STOPPED))
def test_verify_stopped_any_way_returns_in_time_and_leaves_no_rank(
    stand_in: str, tmp_path: Path, how: str
) -> None:
    """What a rank started, deaf to SIGTERM and holding the rank's pipe, is killed too, within the
    stated bound."""
    deaf_child = tmp_path / "deaf-child"
    timeout = ("--timeout", "10", "--json") if how == "time-out" else ()
    process, started, _ = stand_in_verify(stand_in, tmp_path, *timeout,
                                          env={"FAKE_RANK_DEAF_CHILD": str(deaf_child)},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          start_new_session=True)
    rank = int(wait_for(started, process))
    child = int(wait_for(deaf_child, process))
    stopped = time.monotonic()
    if how == "SIGTERM":
        process.send_signal(signal.SIGTERM)
    elif how == "Ctrl-C to the group":
        os.killpg(process.pid, signal.SIGINT)
    elif how == "rank killed":
        os.kill(rank, signal.SIGKILL)
    stdout, stderr = process.communicate(timeout=120)
    took = time.monotonic() - stopped
    if how == "time-out":  # timed on verify's own clock, whose deadline is 10 s after its start
        document = json.loads(stdout)
        took, stdout = document["seconds"] - 10, document["verdict"]
    code, stream, last = STOPPED[how]
    printed = {"stdout": stdout, "stderr": stderr}[stream]
    assert (process.returncode, printed.splitlines()[-1:]) == (code, [last]), stdout + stderr
    assert took < STOPS_WITHIN_SECONDS, f"verify returned {took:.1f} s after it was stopped"
    assert not alive(rank) and not alive(child)
    assert "Traceback" not in stderr


@pytest.mark.slow
@needs_proc
@pytest.mark.ci_tier  # the README's tests stop verify on the stand-in torch, every way
@pytest.mark.parametrize("whole_group", [False, True], ids=["to verify", "to its process group"])
def test_ctrl_c_during_a_real_verify_stops_every_rank(real_torch: dict[str, str], whole_group: bool) -> None:
    marker, env = marked_run()
    process = verify_at_work(env, start_new_session=whole_group)
    stderr = interrupted(process, whole_group)
    assert own_lines(stderr)[-1] == "fsdp-autopatch verify: interrupted"
    assert "Traceback" not in stderr
    assert processes_marked(marker) == []


@pytest.mark.slow
@pytest.mark.ci_tier
@needs_proc
def test_a_real_verify_whose_reader_left_exits_141_and_stops_every_rank(real_torch: dict[str, str]) -> None:
    marker, env = marked_run()
    read, write = os.pipe()
    process = subprocess.Popen([sys.executable, "-m", "fsdp_autopatch", "verify", "--nproc", "2"],
                               stdout=write, stderr=write, env=env, cwd=site_packages().parent)
    os.close(write)
    with os.fdopen(read) as reader:
        first = reader.readline()
    assert first.startswith("fsdp-autopatch verify: 2 ranks of ")
    assert process.wait(timeout=300) == EXIT_CLOSED_PIPE
    assert processes_marked(marker) == []
