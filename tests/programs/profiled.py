"""A training script's imports and two calls of ``fully_shard`` under cProfile, for
tests/test_invisible.py; one JSON object: per function of torch's FSDP2 builder and entry (by the
label cProfile gives it: file, line, name), its calls and its callers' names.

    python tests/programs/profiled.py
"""

import cProfile
import json
import os
import pstats

profile = cProfile.Profile()
profile.enable()
import torch.distributed as dist  # noqa: E402 (the imports are profiled too, where the probe runs)
import torch.distributed.fsdp  # noqa: E402
import transformers  # noqa: E402, F401 (an affected release arms the patch)
from torch import nn  # noqa: E402

from fsdp_autopatch import _verify  # noqa: E402

mesh = _verify.init_process_group()
for _ in range(2):
    torch.distributed.fsdp.fully_shard(nn.Linear(2, 2), mesh=mesh)
profile.disable()
dist.destroy_process_group()
stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
report = {}
for (filename, line, name), (_, calls, _, _, callers) in stats.items():
    if os.path.basename(filename) in ("_fsdp_init.py", "_fully_shard.py") and "_apply_to_module" in name:
        report[f"{os.path.basename(filename)}:{line}:{name}"] = {
            "calls": calls, "callers": sorted({caller[2] for caller in callers})}
print(json.dumps(report, sort_keys=True))
