"""16 threads racing through the first imports of FSDP2 and transformers (tests/programs/scenario.py's
race, in an order drawn from SEED), for tests/test_concurrency.py; one JSON line: the status,
the type of torch's class cache, whether the hooks loaded.

    python tests/programs/threaded_imports.py SEED
"""

import json
import sys

from scenario import import_in_threads

import_in_threads(seed=int(sys.argv[1]))  # exits non-zero if an import fails or a thread hangs

import torch.distributed.fsdp._fully_shard._fully_shard as site  # noqa: E402 (after the race)

import fsdp_autopatch  # noqa: E402

print(json.dumps({
    "status": fsdp_autopatch.status().to_dict(),
    "cache": type(site.cls_to_fsdp_cls).__name__,
    "hooks_loaded": "fsdp_autopatch._hooks" in sys.modules,
}))
