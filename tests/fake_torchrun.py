"""Stands in for torchrun in tests/test_cli_signals.py, installed there as a fake torch's
``torch.distributed.run``: says it started (its pid), waits for the go-ahead file, then prints
the status line a rank prints first, and the lines of FAKE_TORCHRUN_RESULTS, and waits to be
stopped. With FAKE_TORCHRUN_DEAF_RANK (a file) it first starts a "rank" as torchrun does, in a
session of its own and holding the pipe, but deaf to SIGTERM; the rank writes its pid there.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

DEAF_RANK = ("import os, pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(600)")
if os.environ.get("FAKE_TORCHRUN_DEAF_RANK"):
    subprocess.Popen([sys.executable, "-c", DEAF_RANK, os.environ["FAKE_TORCHRUN_DEAF_RANK"]],
                     start_new_session=True)
pathlib.Path(os.environ["FAKE_TORCHRUN_STARTED"]).write_text(str(os.getpid()))
go = pathlib.Path(os.environ["FAKE_TORCHRUN_GO"])
while not go.exists():
    time.sleep(0.02)
print(json.dumps({"status": {"applied": False, "reason": "a stand-in for torchrun"}}), flush=True)
print(os.environ.get("FAKE_TORCHRUN_RESULTS", ""), flush=True)
time.sleep(600)
