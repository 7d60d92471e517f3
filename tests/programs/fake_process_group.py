"""Stands in for torch.distributed in tests/test_cli_signals.py (installed over the stand-in
torch as ``torch/distributed/__init__.py``), so that a signal or a closed pipe meets ``verify``
at a known point while its ranks work.

A rank's ``init_process_group`` says it started (its pid, in FAKE_RANK_STARTED), waits for the
go-ahead file (FAKE_RANK_GO), prints the status line a rank prints first and the lines of
FAKE_RANK_RESULTS, and waits to be stopped. With FAKE_RANK_DEAF_CHILD (a file) it first starts
a child in its own process group, deaf to SIGTERM and holding the rank's stdout, which writes
its pid there.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

DEAF_CHILD = ("import os, pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)")


def is_available() -> bool:
    return True


def is_gloo_available() -> bool:
    return True


def init_process_group(backend: str) -> None:
    if os.environ.get("FAKE_RANK_DEAF_CHILD"):
        subprocess.Popen([sys.executable, "-c", DEAF_CHILD, os.environ["FAKE_RANK_DEAF_CHILD"]])
    pathlib.Path(os.environ["FAKE_RANK_STARTED"]).write_text(str(os.getpid()))
    go = pathlib.Path(os.environ["FAKE_RANK_GO"])
    while not go.exists():
        time.sleep(0.02)
    status = {"applied": False, "reason": "a stand-in for torch.distributed"}
    print(json.dumps({"status": status}), flush=True)
    print(os.environ.get("FAKE_RANK_RESULTS", ""), flush=True)
    time.sleep(600)
