"""What torch cached for an ABC module before the patch was installed, in the two orders that
install it late: transformers imported after the failure, and apply(force=True) after auto mode
declined (for a transformers without ABC heads). For tests/test_fully_shard.py; prints one JSON
line.

    python tests/programs/stale_entry.py transformers|force
"""

import abc
import json
import sys

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard

import fsdp_autopatch
from fsdp_autopatch import _verify


class Head(abc.ABC, nn.Linear):
    pass

mesh = _verify.init_process_group()

def shard():
    module = Head(4, 4)
    try:
        fully_shard(module, mesh=mesh)
        return type(module).__name__
    except TypeError as error:
        return str(error)

report = {"before": shard(), "cached_before": Head in _fully_shard.cls_to_fsdp_cls}
if sys.argv[1] == "transformers":
    import transformers
else:
    import transformers  # noqa: F401 (arms the patch now)
    report["auto"] = fsdp_autopatch.status().to_dict()
    fsdp_autopatch.apply(force=True)
report["after"] = shard()
report["status"] = fsdp_autopatch.status().to_dict()
print(json.dumps(report))
