"""FSDP2 imported with no stderr to warn on (``sys.stderr`` None, as under pythonw), for
tests/test_faults.py; one JSON line: the status's reason and the hooks still waiting.

    FSDP_AUTOPATCH=garbage python tests/programs/no_stderr.py
"""

import json
import sys

stderr = sys.stderr
sys.stderr = sys.__stderr__ = None  # as under pythonw
import torch.distributed.fsdp  # noqa: E402, F401 (the import that arms, with no stderr)

sys.stderr = sys.__stderr__ = stderr
import wrapt  # noqa: E402

import fsdp_autopatch  # noqa: E402

print(json.dumps({"reason": fsdp_autopatch.status().reason,
                  "waiting_hooks": sorted(wrapt.importer._post_import_hooks)}))
