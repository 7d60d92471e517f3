"""Copied into a throwaway site-packages as ``_startup_audit`` by tests/test_faults.py and imported
by the first start-up file: records audit events until ``stop()``, which a start-up file sorted
after the package's calls.
"""

# What site imports for .start files (3.15+), imported here so that it is not counted as ours.
import importlib.util  # noqa: F401
import pkgutil  # noqa: F401
import sys

events = []
recording = True


def _record(event, args):
    if recording:
        events.append([event, [a if isinstance(a, (str, int)) or a is None else repr(a) for a in args]])


def stop():
    global recording
    recording = False


sys.addaudithook(_record)
