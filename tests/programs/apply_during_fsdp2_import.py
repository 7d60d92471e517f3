"""``python -S`` (no start-up file): apply() while another thread is in the middle of importing
torch.distributed.fsdp, for tests/test_hooks.py; the hooks then see that import end. The status
as one JSON line.

    python -S tests/programs/apply_during_fsdp2_import.py DELAY PATH...    # PATH: site-packages first
"""

import importlib
import json
import sys
import threading
import time

sys.path[:0] = sys.argv[2:]
import transformers  # noqa: E402, F401 (after the path is set)

worker = threading.Thread(target=importlib.import_module, args=("torch.distributed.fsdp",))
worker.start()
time.sleep(float(sys.argv[1]))
import fsdp_autopatch  # noqa: E402

fsdp_autopatch.apply()
worker.join()
deadline = time.monotonic() + 30
while not fsdp_autopatch.status().applied and time.monotonic() < deadline:
    time.sleep(0.01)
print(json.dumps(fsdp_autopatch.status().to_dict()))
