"""How often the start-up entry ran and armed, counted by ``_arm_counter`` (a start-up file that
tests/test_startup.py puts beside the package's), for that test; one JSON line.

    python tests/programs/arm_counted.py
"""

import json
import sys

import _arm_counter

import fsdp_autopatch

print(json.dumps({"calls": _arm_counter.calls, "passes": _arm_counter.passes,
                  "armed": fsdp_autopatch.armed,
                  "watchers": sum(type(f).__name__ == "FirstImportWatcher" for f in sys.meta_path)}))
