"""A pytest plugin: "still running <test> (N s)" every 30 s while a test runs, so that a long run
never goes quiet (conftest.py loads it; ``-p progress`` loads it elsewhere).

The lines go to a copy of the terminal's file descriptor taken before any test runs, from a
background thread: the test's own stdout and stderr, and pytest's capture of them, are never
touched. Under pytest-xdist the controller, which hears every worker's tests start and finish,
prints them; the workers print nothing.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import pytest

# The interval; a variable so that the plugin's own test need not wait 30 s.
INTERVAL_VARIABLE = "FSDP_AUTOPATCH_TEST_HEARTBEAT"
DEFAULT_INTERVAL = 30.0


class Heartbeat:
    """Tracks running tests and reports each one every ``interval`` seconds while it runs."""

    def __init__(self, fd: int, interval: float) -> None:
        self.fd = fd
        self.interval = interval
        self.running: dict[str, tuple[float, float]] = {}  # nodeid: (started, last reported)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.beat, name="pytest-progress", daemon=True)

    def start(self, nodeid: str) -> None:
        now = time.monotonic()
        with self.lock:
            self.running[nodeid] = (now, now)

    def finish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)

    def beat(self) -> None:
        while not self.stopped.wait(min(1.0, self.interval / 4)):
            now = time.monotonic()
            lines = []
            with self.lock:
                for nodeid, (started, reported) in self.running.items():
                    if now - reported >= self.interval:
                        self.running[nodeid] = (started, now)
                        # On a line of its own: pytest -v leaves "path::test " (or, under
                        # xdist, "[gw0] PASSED path::test ") open until it writes the next one.
                        lines.append(f"\nstill running {nodeid} ({now - started:.0f} s)\n")
            for line in lines:
                try:
                    os.write(self.fd, line.encode())
                except OSError:
                    return  # the terminal went away; the tests go on without progress lines

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        os.close(self.fd)


_heartbeat: Optional[Heartbeat] = None


def pytest_sessionstart(session: pytest.Session) -> None:
    global _heartbeat
    config = session.config
    if hasattr(config, "workerinput"):
        return  # an xdist worker: its controller reports
    interval = float(os.environ.get(INTERVAL_VARIABLE) or DEFAULT_INTERVAL)
    capture = config.pluginmanager.getplugin("capturemanager")
    try:
        if capture is not None:
            with capture.global_and_fixture_disabled():
                fd = os.dup(1)
        else:
            fd = os.dup(1)
    except OSError:
        return  # no terminal file descriptor to copy (an embedding runner): no progress lines
    _heartbeat = Heartbeat(fd, interval)
    _heartbeat.thread.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    global _heartbeat
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None


def pytest_runtest_logstart(nodeid: str, location: tuple[str, Optional[int], str]) -> None:
    if _heartbeat is not None:
        _heartbeat.start(nodeid)


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, Optional[int], str]) -> None:
    if _heartbeat is not None:
        _heartbeat.finish(nodeid)
