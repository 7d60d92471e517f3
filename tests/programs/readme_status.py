"""What the README's API section shows, captured by ``tests/matrix.py --capture-cli``: a tiny
sequence classifier sharded on one gloo rank, then the status. The model and the group are the
package's own proof's (fsdp_autopatch._verify).

    python tests/programs/readme_status.py
"""

import json

import torch.distributed as dist
import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch.distributed.fsdp import fully_shard

import fsdp_autopatch
from fsdp_autopatch import _verify

mesh = _verify.init_process_group()
model = _verify.build_model("sequence-classification")
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
print(json.dumps(fsdp_autopatch.status().to_dict(), indent=2))
dist.destroy_process_group()
