"""The installed package's version and file, how often its start-up line ran (counted by
``_startup_counter``, which tests/test_uninstall.py puts beside it), and its watchers; one JSON
line.

    python tests/programs/startup_report.py
"""

import json
import sys

import _startup_counter

import fsdp_autopatch

print(json.dumps({
    "version": fsdp_autopatch.__version__,
    "runs": _startup_counter.ours,
    "passes": _startup_counter.passes,
    "watchers": sum(type(f).__name__ == "FirstImportWatcher" for f in sys.meta_path),
    "file": fsdp_autopatch.__file__,
}))
