"""The one line where the fix cannot run: said once per launch and machine, by one process,
with no file written anywhere (the rule: fsdp_autopatch/_speaker.py).

Each process here imports the stand-in torch's FSDP2 and transformers (tests/stand_in/) in a
throwaway environment without wrapt, so that each would say the line; the programs are
tests/programs/speak.py and the launchers around it. Real torch under real launchers:
tests/test_processes.py (torchrun, spawn, fork, subprocess) and tests/stacks/ (accelerate, Ray).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest
from conftest import (
    PROGRAMS,
    Throwaway,
    environment,
    fake_torch,
    fake_transformers,
    json_lines,
    make_throwaway,
    own_lines,
)
from test_faults import cannot_fix

from fsdp_autopatch import _hooks, _speaker

SPEAK = PROGRAMS / "speak.py"
STARTS = PROGRAMS / "starts_processes.py"
TIMEOUT = 120
WAIT_SECONDS = 60.0
# Another user, where the tests run as root (CI does): nobody.
NOBODY = 65534
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="runs a process as another user, which needs root")
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                reason="the one line per launch is Linux's (abstract sockets, /proc)")
pytestmark = linux_only


@pytest.fixture(scope="module")
def speaking(installed: Path, tmp_path_factory: pytest.TempPathFactory) -> Throwaway:
    """An environment with the package, the stand-in torch and transformers, and no wrapt."""
    throwaway = make_throwaway(tmp_path_factory.mktemp("speaking") / "venv", installed, wrapt=False)
    fake_torch(throwaway.site_packages)
    fake_transformers(throwaway.site_packages)
    return throwaway


def said(throwaway: Throwaway) -> list[str]:
    """The one line, with the remedy naming that environment's interpreter."""
    remedy = f"{shlex.quote(str(throwaway.python))} -m pip install wrapt"
    return cannot_fix(f"wrapt is not installed ({remedy})")


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """The TMPDIR of the processes a test starts: empty before, and after."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    yield directory
    assert sorted(directory.iterdir()) == [], "the package wrote into the temporary directory"


def run(throwaway: Throwaway, program: Path, *args: str, scratch: Path, **variables: str) -> list[str]:
    """The package's lines on stderr of ``program`` run in ``throwaway`` by this process."""
    result = throwaway.run_program(program, *args, TMPDIR=str(scratch), **variables)
    assert result.returncode == 0, result.stderr[-3000:]
    return own_lines(result.stderr)


def old_marker(directory: Path) -> Path:
    """Where 0.2.0 kept the marker for the processes this one starts: ``speaker-<pid>-<start
    time>`` of their parent, in ``$TMPDIR/fsdp-autopatch-<uid>``."""
    start = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    return directory / f"speaker-{os.getpid()}-{start}"


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_SECONDS:g} s for {what}"
        time.sleep(0.01)


# --- 1. Security: nothing written where another user can write, no link followed ------------------


def test_a_planted_directory_and_link_are_neither_used_nor_followed(
    tmp_path: Path, speaking: Throwaway, scratch: Path
) -> None:
    """0.2.0 kept a marker per parent process in $TMPDIR/fsdp-autopatch-<uid>: here another user
    (nobody, where the tests run as root) has made that directory, writable by all, and put a
    link where the marker of a process started by this one would be, to a file of ours."""
    scratch.chmod(0o1777)
    planted = scratch / f"fsdp-autopatch-{os.getuid()}"
    planted.mkdir()
    if os.geteuid() == 0:
        os.chown(planted, NOBODY, NOBODY)
    planted.chmod(0o777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = old_marker(planted)
    link.symlink_to(victim)
    try:
        assert run(speaking, SPEAK, scratch=scratch) == said(speaking)
        assert victim.read_text() == "precious\n"
        assert sorted(planted.iterdir()) == [link] and sorted(scratch.iterdir()) == [planted]
    finally:
        link.unlink()
        planted.rmdir()


# Hold an abstract socket name (as another user, where given one).
Holder = Callable[[str, Optional[int]], None]


@pytest.fixture
def hold_name() -> Iterator[Holder]:
    """Hold names from forked children of this process, as a speaker (or a squatter) does: this
    process's interpreter may be one another user cannot run (a Python under /root)."""
    children: list[tuple[int, int]] = []

    def hold(name: str, user: Optional[int]) -> None:
        ready_read, ready_write = os.pipe()
        leave_read, leave_write = os.pipe()
        pid = os.fork()
        if pid == 0:  # as little as can be: bind, listen, say so, wait for the end of the pipe
            try:
                os.close(leave_write)
                os.close(ready_read)
                if user is not None:
                    os.setgroups([])
                    os.setgid(user)
                    os.setuid(user)
                held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                held.bind(name)
                held.listen(8)
                os.write(ready_write, b".")
                os.read(leave_read, 1)
            finally:
                os._exit(0)
        os.close(ready_write)
        os.close(leave_read)
        children.append((pid, leave_write))
        assert os.read(ready_read, 1) == b".", "the holder did not bind the name"
        os.close(ready_read)

    yield hold
    for pid, leave in children:
        os.close(leave)
        os.waitpid(pid, 0)


@as_root
def test_another_users_socket_on_the_launchs_name_does_not_silence_it(
    speaking: Throwaway, scratch: Path, hold_name: Holder
) -> None:
    """The launch's name is public (pids and start times are): another user can bind it first.
    Its holder's uid is not ours, so the process speaks; where a process of ours holds it, the
    launch has spoken."""
    me = _speaker._process(os.getpid())
    assert me is not None
    launch = _speaker._name(me)  # the processes this one starts are ranks of its launch
    hold_name(launch, NOBODY)
    assert run(speaking, SPEAK, scratch=scratch) == said(speaking)


def test_a_launch_whose_name_a_process_of_ours_holds_is_silent(
    speaking: Throwaway, scratch: Path, hold_name: Holder
) -> None:
    me = _speaker._process(os.getpid())
    assert me is not None
    hold_name(_speaker._name(me), None)
    assert run(speaking, SPEAK, scratch=scratch) == []


# --- 2. Races: siblings that start at the same instant -------------------------------------------


def test_siblings_that_import_at_the_same_instant_print_one_line_in_every_round(
    speaking: Throwaway, scratch: Path
) -> None:
    """Six forked siblings released at once, thirty rounds (0.2.0: more than one line in 9 of 30)."""
    result = speaking.run_program(PROGRAMS / "sibling_rounds.py", "30", "6", TMPDIR=str(scratch))
    assert result.returncode == 0, result.stderr[-3000:]
    rounds = json_lines(result.stdout)
    assert len(rounds) == 30
    assert [own_lines("\n".join(found["lines"])) for found in rounds] == [said(speaking)] * 30


# --- 3. Every launch speaks, and nothing is left after any exit ------------------------------------


def test_a_stale_marker_naming_a_live_process_silences_nothing(speaking: Throwaway, scratch: Path) -> None:
    """0.2.0's marker, left by a run that ended without removing it, naming a pid that lives on."""
    private = scratch / f"fsdp-autopatch-{os.getuid()}"
    private.mkdir(mode=0o700)
    marker = old_marker(private)
    marker.write_text(str(os.getpid()))
    try:
        assert run(speaking, SPEAK, scratch=scratch) == said(speaking)
    finally:
        marker.unlink()
        private.rmdir()


def test_two_runs_started_at_once_from_one_shell_each_speak(
    tmp_path: Path, speaking: Throwaway, scratch: Path
) -> None:
    """``python train.py & python train.py`` from one shell: two launches, both alive at once."""
    meeting = tmp_path / "meeting"
    meeting.mkdir()
    both = '"$1" "$2" --meet "$3" 2 & "$1" "$2" --meet "$3" 2 & wait'
    result = subprocess.run(["sh", "-c", both, "sh", str(speaking.python), str(SPEAK), str(meeting)],
                            capture_output=True, text=True, env=environment(TMPDIR=str(scratch)),
                            timeout=TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert own_lines(result.stderr) == said(speaking) * 2


@pytest.mark.parametrize(("kind", "count", "lines"), [
    ("sessions", 2, 2),  # a notebook server's kernels: each is a launch
    ("ranks", 3, 1),  # a script that starts its ranks with subprocess
    ("numbered", 3, 1),  # torchrun's agent: each rank in a session of its own, numbered
])
def test_what_a_python_process_starts(
    speaking: Throwaway, scratch: Path, kind: str, count: int, lines: int
) -> None:
    assert run(speaking, STARTS, kind, str(count), scratch=scratch) == said(speaking) * lines


@pytest.mark.parametrize("ending", ["exit", "os._exit", "SIGKILL"])
def test_nothing_is_left_after_any_exit_and_the_next_run_speaks(
    tmp_path: Path, speaking: Throwaway, scratch: Path, ending: str
) -> None:
    """The speaker ends normally, through os._exit (as forked ranks do) or killed; the temporary
    directory stays empty (the fixture checks), and the next run of the same launch speaks."""
    if ending == "SIGKILL":
        held = tmp_path / "held"
        speaker = subprocess.Popen([str(speaking.python), str(SPEAK), "--hold", str(held)], text=True,
                                   stderr=subprocess.PIPE, env=environment(TMPDIR=str(scratch)))
        wait_for(lambda: held.exists() or speaker.poll() is not None, "the speaker to say its line")
        speaker.send_signal(signal.SIGKILL)
        _, stderr = speaker.communicate(timeout=TIMEOUT)
        assert own_lines(stderr) == said(speaking)
    else:
        assert run(speaking, SPEAK, *(["--os-exit"] if ending == "os._exit" else []),
                   scratch=scratch) == said(speaking)
    assert run(speaking, SPEAK, scratch=scratch) == said(speaking)


# --- 4. Once: launchers that import FSDP2 and transformers themselves, and logging at INFO ----------


def test_a_launcher_that_spoke_before_starting_its_ranks_is_the_only_one(
    speaking: Throwaway, scratch: Path
) -> None:
    """accelerate's launcher imports FSDP2 and transformers, then starts its ranks as torchrun's
    agent does: each in a session of its own, with LOCAL_RANK."""
    assert run(speaking, STARTS, "numbered", "2", "--speak-first", scratch=scratch) == said(speaking)


def test_spawned_ranks_of_a_main_module_that_imports_fsdp2_at_the_top_are_silent(
    speaking: Throwaway, scratch: Path
) -> None:
    """The ranks import the main module again (as ``__mp_main__``), after the parent spoke."""
    assert run(speaking, PROGRAMS / "spawn_after_imports.py", "2", scratch=scratch) == said(speaking)


def test_logging_basic_config_at_info_adds_nothing(speaking: Throwaway, scratch: Path) -> None:
    """Two ranks whose script calls ``logging.basicConfig(level=logging.INFO)`` first: one line in
    all, and no record of the package's through the script's handler."""
    result = speaking.run_program(STARTS, "ranks", "2", "--", "--basic-config", TMPDIR=str(scratch))
    assert result.returncode == 0, result.stderr[-3000:]
    assert own_lines(result.stderr) == said(speaking)
    assert f":{_hooks.logger.name}:" not in result.stderr, result.stderr
    assert logging.getLevelName(logging.INFO) not in result.stderr, result.stderr
