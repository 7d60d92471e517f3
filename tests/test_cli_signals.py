"""A closed pipe and Ctrl-C end the command quietly, in real subprocesses.

A closed pipe (``fsdp-autopatch doctor | head -1``): exit 141, what a shell reports for a
coreutils command cut off the same way, with nothing on stderr: no traceback, and no "Exception
ignored" from the interpreter's last flush. Ctrl-C: exit 130 and one line on stderr.

The fast tests run ``verify`` against a stand-in for ``torch.distributed.run`` (a fake torch in a
throwaway environment) that says when it started and waits to be told to go on, so that the
signal or the closed pipe meets verify at a known point, while it follows its launcher; the
slow ones run the real torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import environment, make_throwaway, site_packages, verify_at_work
from test_cli import add_distribution, marked_run, processes_marked

EXIT_CLOSED_PIPE = 141
EXIT_INTERRUPTED = 130

# Stands in for torchrun: says it started (its pid), waits for the go-ahead file, then prints the
# status line a rank prints first, and waits to be stopped.
FAKE_TORCHRUN = """\
import json, os, pathlib, time
pathlib.Path(os.environ["FAKE_TORCHRUN_STARTED"]).write_text(str(os.getpid()))
go = pathlib.Path(os.environ["FAKE_TORCHRUN_GO"])
while not go.exists():
    time.sleep(0.02)
print(json.dumps({"status": {"applied": False, "reason": "a stand-in for torchrun"}}), flush=True)
time.sleep(600)
"""

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name == "nt",
                                reason="POSIX signals and pipes")


@pytest.fixture(scope="module")
def stand_in(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The python of an environment whose torch's ``torch.distributed.run`` is FAKE_TORCHRUN."""
    throwaway = make_throwaway(tmp_path_factory.mktemp("stand-in") / "venv", installed)
    add_distribution(throwaway.site, "torch", "2.13.0", {
        "torch/__init__.py": '__version__ = "2.13.0"\n',
        "torch/distributed/__init__.py": "",
        "torch/distributed/run.py": FAKE_TORCHRUN,
    })
    add_distribution(throwaway.site, "transformers", "4.55.2",
                     {"transformers/__init__.py": '__version__ = "4.55.2"\n'})
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


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stand_in_verify(python: str, tmp_path: Path, **popen: object) -> tuple[subprocess.Popen, Path, Path]:  # type: ignore[type-arg]
    started, go = tmp_path / "started", tmp_path / "go"
    env = environment(FAKE_TORCHRUN_STARTED=str(started), FAKE_TORCHRUN_GO=str(go))
    process = subprocess.Popen([python, "-m", "fsdp_autopatch", "verify"], env=env, cwd=tmp_path,
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


def test_verify_whose_reader_left_stops_its_launcher_and_exits_141(stand_in: str, tmp_path: Path) -> None:
    # As `fsdp-autopatch verify 2>&1 | head -1`: the reader takes the first progress line and
    # leaves; verify's next line, once its launcher says the ranks are at work, meets the closed pipe.
    read, write = os.pipe()
    process, started, go = stand_in_verify(stand_in, tmp_path, stdout=write, stderr=write)
    os.close(write)
    with os.fdopen(read) as reader:
        assert reader.readline().startswith("fsdp-autopatch verify: 1 rank of ")
    launcher = int(wait_for(started, process))
    go.touch()
    assert process.wait(timeout=120) == EXIT_CLOSED_PIPE
    assert not alive(launcher)


# --------------------------------------------------------------------------------------------- Ctrl-C


def interrupted(process: subprocess.Popen) -> str:  # type: ignore[type-arg]
    """Send SIGINT, as Ctrl-C does; the command's stderr."""
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == EXIT_INTERRUPTED, stderr
    return str(stderr)


def test_ctrl_c_while_verify_waits_for_its_ranks_exits_130_with_one_line(
    stand_in: str, tmp_path: Path
) -> None:
    process, started, _ = stand_in_verify(stand_in, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
    launcher = int(wait_for(started, process))
    stderr = interrupted(process)
    progress, last = stderr.splitlines()  # the launch line, then the one about the interruption
    assert progress.startswith("fsdp-autopatch verify: 1 rank of ")
    assert last == "fsdp-autopatch verify: interrupted"
    assert not alive(launcher), "verify left its launcher running"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds leftover ranks through /proc")
def test_ctrl_c_during_a_real_verify_stops_every_rank(real_torch: dict[str, str]) -> None:
    marker, env = marked_run()
    process = verify_at_work(env)
    stderr = interrupted(process)
    assert stderr.splitlines()[-1] == "fsdp-autopatch verify: interrupted"
    assert "Traceback" not in stderr
    assert processes_marked(marker) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds leftover ranks through /proc")
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
