"""The classes a training run lists in its status: shards an affected head and a causal LM layer by
layer (the classes each site built, and what became of each), then more new classes than the status
keeps (it keeps the first ``_classes.CLASS_RECORD_LIMIT`` and counts every one). For
tests/test_fully_shard.py; prints one JSON line: ``{"heads": <status>, "many": {"kept", "seen",
"limit"}}``.

    python tests/programs/classes_of_a_run.py
"""

import json

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed.fsdp import fully_shard

import fsdp_autopatch
from fsdp_autopatch import _classes, _verify

mesh = _verify.init_process_group()
for kind in ("token-classification", "causal-lm"):
    model = _verify.build_model(kind)
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
before = fsdp_autopatch.status().to_dict()
# More classes than the status keeps.
for index in range(_classes.CLASS_RECORD_LIMIT + 20):
    fully_shard(type(f"Block{index}", (nn.Linear,), {})(2, 2), mesh=mesh)
after = fsdp_autopatch.status().to_dict()
print(json.dumps({"heads": before, "many": {"kept": len(after["classes"]), "seen": after["classes_seen"],
                  "limit": _classes.CLASS_RECORD_LIMIT}}))
