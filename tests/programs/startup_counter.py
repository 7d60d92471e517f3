"""Copied into a throwaway site-packages as ``_startup_counter`` by tests/test_uninstall.py. Counts
how often site.py runs our start-up line, and how often it reads site-packages at all: CPython
3.11 reads a venv's site-packages twice, running every .pth line twice, and the package's arm()
makes the repeat a no-op. One line of ours runs once per reading, never more.
"""

import sys

ours = 0
passes = 0


def _record(event, args):
    global ours
    source = args[0] if event == "compile" else None
    if isinstance(source, str):
        source = source.encode()
    # The .pth line itself (the bootstrap it execs is compiled separately and not counted).
    if isinstance(source, bytes) and source.startswith(b"import") and b"fsdp_autopatch" in source:
        ours += 1


sys.addaudithook(_record)
