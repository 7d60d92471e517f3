"""Import each module named, twice, catching what it raises, for tests/test_faults.py: a failed
import must fail again the same way when retried. One JSON line: the outcomes (with the frames
outside the import machinery) and the torch and transformers modules loaded; ``--status``: then
a line with the package's status.

    python tests/programs/try_imports.py MODULE... [--status]
"""

import json
import sys
import traceback

# Frames of the import machinery itself, which differ with any import hook in the chain (see below).
HIDDEN = ("fsdp_autopatch", "wrapt", "<frozen importlib")
outcomes = []
for name in (arg for arg in sys.argv[1:] if arg != "--status"):
    for _attempt in range(2):  # a failed import must fail again the same way when retried
        try:
            __import__(name)
            outcomes.append([name, "ok"])
        except BaseException as error:
            outcomes.append([name, type(error).__name__, str(error),
                             [f.name for f in traceback.extract_tb(error.__traceback__)
                              if not any(part in f.filename for part in HIDDEN)]])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"outcomes": outcomes, "loaded": loaded}))
if "--status" in sys.argv:
    import fsdp_autopatch

    print(json.dumps(fsdp_autopatch.status().to_dict()))
