"""Counts the interpreters a test run starts: copied into the test environment's site-packages by
``.ci/measure-tests --processes`` for one run, with a start-up file that calls ``start(LOG)``,
and removed after it.

Each interpreter that starts there (and so reads the start-up file: a fresh one, not a forked
child) appends a line to LOG; each process that exits through ``atexit`` (fresh or forked)
appends one with its own CPU-seconds and whether it imported torch and FSDP2. Nothing is
imported at start-up but what every interpreter already has.
"""

from __future__ import annotations

import atexit
import os
import sys


def _append(log: str, line: str) -> None:
    # One write on an O_APPEND descriptor: lines from concurrent processes do not interleave.
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line.encode())
    finally:
        os.close(descriptor)


def _at_exit(log: str) -> None:
    import json
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    _append(log, json.dumps({
        "event": "exit", "pid": os.getpid(), "argv": sys.argv[:3],
        "cpu": usage.ru_utime + usage.ru_stime,
        "torch": "torch" in sys.modules, "fsdp2": "torch.distributed.fsdp" in sys.modules,
        "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
    }) + "\n")


_started_in: list[int] = []


def start(log: str) -> None:
    # A process can read the start-up file twice (site.addsitedir of a directory that holds it,
    # as pip's build environments and the README test's linked environment do): count it once.
    if os.getpid() in _started_in:
        return
    _started_in.append(os.getpid())
    try:
        _append(log, f'{{"event": "start", "pid": {os.getpid()}}}\n')
        atexit.register(_at_exit, log)
    except Exception:
        pass  # counting must never change what runs
