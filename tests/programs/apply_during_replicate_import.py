"""``apply()`` (no start-up file) while another thread is inside replicate_with_fsdp's import, for
tests/test_hooks.py: wrapt calls the hook at once, on the half-run module, and never again; the
patch must wait for that import to finish. The status at apply() and after, as one JSON line.

    FSDP_AUTOPATCH_LOG=warning python tests/programs/apply_during_replicate_import.py
"""

import importlib
import json
import threading
import time

from intercept_import import intercept

import fsdp_autopatch

fsdp_autopatch.disarm()  # as in an interpreter that read no start-up file
import torch.distributed.fsdp  # noqa: E402, F401 (after disarm: nothing watches these imports)
import transformers  # noqa: E402, F401

NAME = "torch.distributed._composable.replicate_with_fsdp"
entered, release = threading.Event(), threading.Event()
# The worker's import stops before the module runs, until this thread releases it.
intercept(NAME, before=lambda module: (entered.set(), release.wait()))
worker = threading.Thread(target=importlib.import_module, args=(NAME,))
worker.start()
entered.wait()
at_apply = fsdp_autopatch.apply().to_dict()
release.set()
worker.join()
deadline = time.monotonic() + 30
while len(fsdp_autopatch.status().sites) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps({"at_apply": at_apply, "after": fsdp_autopatch.status().to_dict()}))
