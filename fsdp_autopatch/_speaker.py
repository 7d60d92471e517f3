"""The one line on stderr: which process speaks it, one per launch and machine.

One launch is a process started from outside Python (a shell, a terminal, a service manager, a
notebook server's new session) with every process it starts and they start in turn, on this
machine. The rule, with the CPython and Linux facts it relies on:

- torchrun and accelerate set LOCAL_RANK (0, 1, ... on each node) before a rank's interpreter
  starts; Ray actors of verl and OpenRLHF set it in __init__, before they import FSDP2. A process
  whose LOCAL_RANK is set and not 0 is silent: read when the line is due, not at start-up.
- A process is a rank of its parent, in its parent's launch, where the parent runs the same
  Python executable (/proc/<pid>/exe is the same file: torch.multiprocessing's spawn, fork and
  forkserver, start_processes, a script that starts ranks with subprocess, the torchrun agent,
  accelerate's launcher) or is Ray's raylet, which starts a machine's workers; except where it
  leads a session of its own without LOCAL_RANK: jupyter_client starts each notebook kernel
  with start_new_session, while torchrun's agent starts its ranks so too and numbers them.
  Any other process starts a launch of its own: two runs from one shell are two launches.
- A launch's voice is a Linux abstract-namespace Unix socket named after the process that
  started the launch (its pid and start time in clock ticks, /proc/<pid>/stat, so that a reused
  pid names another process) and the user. bind() on it is atomic: of any number of siblings
  claiming at the same instant exactly one succeeds, and speaks. The kernel removes the name
  when the socket's last descriptor closes, at any exit (os._exit and SIGKILL too): no file is
  written anywhere, nothing outlives the process, nothing is left for pip uninstall.
- A process is silent where a process of its user holds the name of any of its ancestors: its
  launcher spoke before starting it (accelerate's launcher imports FSDP2 and transformers
  itself; so does an mp.spawn parent whose main module imports them at the top), or a rank did
  before starting DataLoader workers that import them again.
- Another user may bind a name first to silence this one: a name counts only where its holder's
  uid (SO_PEERCRED, given on connect) is this process's. Where it is not, this process speaks,
  and so does each sibling that claims it: a squatter can make a launch say more, never less.
- The speaker holds the name while it lives: a member of the launch that asks after the
  speaker has exited speaks again (a rank restarted by torchrun's --max-restarts).
- Without /proc or Unix sockets (macOS, Windows) nothing is claimed and no file is written:
  every process whose LOCAL_RANK is unset or 0 speaks, once.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Optional

LOCAL_RANK_VARIABLE = "LOCAL_RANK"
# Executables other than Python whose children are one launch: Ray's raylet starts the workers.
LAUNCHER_EXECUTABLES = ("raylet",)
# How long a claim waits for the sibling that bound the launch's name to listen on it, the next
# call after bind(), between which a loaded machine may run other processes.
CLAIM_WAIT_SECONDS = 2.0
CLAIM_RETRY_SECONDS = 0.001
# Pending connections a speaker's socket keeps for the processes that ask who holds it (never
# accepted: each asker only reads the holder's credentials); the kernel caps it at somaxconn.
ASKERS = 4096
# A bound on the walk up the process tree (a tree deeper than this is not a launch's).
ANCESTOR_LIMIT = 128
# Whether this process speaks for its launch; None until it first has something to say.
_speaks_here: Optional[bool] = None
# The socket that holds this launch's name, in the process that speaks for it.
_voice: Optional[Any] = None


def write_line(line: str) -> None:
    """One line on stderr, if there is one (pythonw and some services have ``sys.stderr = None``),
    from the one process that speaks for its launch on this machine (``speaks``)."""
    stream = sys.stderr
    if stream is None or not speaks():
        return
    try:
        stream.write(line + "\n")
    except Exception:  # a closed or unencodable stream must not keep the hooks from registering
        pass


def speaks() -> bool:
    """Does this process speak for its launch on this machine? (The rule: the module's doc.)"""
    global _speaks_here
    if os.environ.get(LOCAL_RANK_VARIABLE, "").strip() not in ("", "0"):
        return False
    if _speaks_here is None:
        try:
            _speaks_here = _claim_speaker()
        except Exception:  # no /proc, no AF_UNIX, a kernel that refuses: better twice than never
            _speaks_here = True
    return _speaks_here


def _claim_speaker() -> bool:
    """Claim this launch's name; True where this process is to speak."""
    if not hasattr(os, "getuid") or not os.path.isfile("/proc/self/stat"):
        return True  # not Linux: see above
    import socket

    if not hasattr(socket, "AF_UNIX"):
        return True
    ancestors = _ancestors()
    if any(_held(_name(ancestor)) for ancestor in ancestors):
        return False
    launch = ancestors[0] if ancestors and _rank_of_parent(ancestors[0][0]) else _process(os.getpid())
    return True if launch is None else _claim(_name(launch))


def _process(pid: int) -> Optional[tuple[int, str, int]]:
    """Process ``pid`` as (pid, start time in clock ticks since boot, parent pid), read from
    /proc/<pid>/stat (the name in parentheses may hold spaces and parentheses itself); None where
    it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return pid, fields[19], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def _ancestors() -> list[tuple[int, str, int]]:
    """This process's parent, its parent, ... up to the first that is gone or unreadable."""
    found: list[tuple[int, str, int]] = []
    pid = os.getppid()
    while pid > 0 and len(found) < ANCESTOR_LIMIT:
        process = _process(pid)
        if process is None:
            break
        found.append(process)
        pid = process[2]
    return found


def _rank_of_parent(parent: int) -> bool:
    """Did process ``parent`` start this one as a rank of its launch? (The rule: the module's doc.)"""
    numbered = os.environ.get(LOCAL_RANK_VARIABLE, "").strip() != ""
    if os.getsid(0) == os.getpid() and not numbered:
        return False
    try:
        if os.path.basename(os.readlink(f"/proc/{parent}/exe")) in LAUNCHER_EXECUTABLES:
            return True
        theirs, ours = os.stat(f"/proc/{parent}/exe"), os.stat("/proc/self/exe")
    except OSError:  # another user's process, or gone
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _name(process: tuple[int, str, int]) -> str:
    """The abstract socket name of the launch started by ``process`` (``_process``), for this user."""
    pid, start, _ = process
    return f"\0fsdp-autopatch-{os.getuid()}-{pid}-{start}"


def _held(name: str) -> Optional[bool]:
    """Whether a process of this user holds ``name``: True; another user's: False; None where
    nothing listens on it (unbound, or bound by a claim that has not listened yet) or its holder
    cannot be asked."""
    import socket
    import struct

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as asker:
        asker.setblocking(False)
        try:
            asker.connect(name)
            credentials = asker.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:  # ECONNREFUSED: nobody listens; EAGAIN: its queue is full
            return None
    return struct.unpack("3i", credentials)[1] == os.getuid()


def _claim(name: str) -> bool:
    """Bind ``name`` and hold it while this process lives; True where this process is to speak:
    it holds the name, or another user squats it."""
    global _voice
    import atexit
    import errno
    import socket

    deadline = time.monotonic() + CLAIM_WAIT_SECONDS
    while True:
        voice = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not inherited by exec (PEP 446)
        try:
            voice.bind(name)
            voice.listen(ASKERS)
        except OSError as error:
            voice.close()
            if error.errno != errno.EADDRINUSE:
                raise
            holder = _held(name)
            if holder is not None:
                return not holder
            if time.monotonic() >= deadline:  # bound and never listened on: not a claim of ours
                return True
            time.sleep(CLAIM_RETRY_SECONDS)
            continue
        _voice = voice
        atexit.register(_release_voice)
        return True


def _release_voice() -> None:
    """Close the speaker's socket: at exit, before the interpreter's teardown would warn of it
    (ResourceWarning), and in a child forked from the speaker, so the name lives as long as the
    speaker does."""
    global _voice
    voice, _voice = _voice, None
    if voice is not None:
        voice.close()


def after_fork_in_child() -> None:
    """A forked rank asks anew whether it speaks for its launch, and does not hold the name its
    parent holds: the name lives as long as the speaker does."""
    global _speaks_here
    _speaks_here = None
    _release_voice()
