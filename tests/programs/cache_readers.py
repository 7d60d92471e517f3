"""What any reader of torch's class caches sees (torch's own _dynamo/guards.py reads
get_cls_to_fsdp_cls()): a plain dict, answering exactly as the dict torch made, patched or not.
For tests/test_fully_shard.py; prints one JSON line.

    python tests/programs/cache_readers.py
"""

import abc
import copy
import json
import sys

import torch.distributed._composable.replicate_with_fsdp
import torch.distributed.fsdp
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn

import fsdp_autopatch
from fsdp_autopatch import _verify


class Plain(nn.Linear):
    pass

class Head(abc.ABC, nn.Linear):
    pass

caches = {
    "cls_to_fsdp_cls": sys.modules["torch.distributed.fsdp._fully_shard._fully_shard"],
    "cls_to_replicate_cls": sys.modules["torch.distributed._composable.replicate_with_fsdp"],
}
report = {}
for name, module in caches.items():
    cache = getattr(module, name)
    try:
        cache[Plain]
        item = "found"
    except KeyError:
        item = "KeyError"
    report[name] = {
        "type": type(cache).__name__, "get": repr(cache.get(Plain)),
        "default": cache.get(Plain, "default"), "in": Plain in cache, "item": item, "len": len(cache),
        "iter": [c.__name__ for c in cache],
        "copy": type(copy.copy(cache)).__name__, "dict": len(dict(cache)), "after": len(cache),
    }
getter = getattr(caches["cls_to_fsdp_cls"], "get_cls_to_fsdp_cls", None)
if getter is not None:
    same = getter() is caches["cls_to_fsdp_cls"].cls_to_fsdp_cls
    report["getter"] = [same, getter().get(Plain, "default"), len(getter())]
mesh = _verify.init_process_group()
for cls in (Plain, Head):
    try:
        torch.distributed.fsdp.fully_shard(cls(4, 4), mesh=mesh)
    except TypeError:
        pass
cache = caches["cls_to_fsdp_cls"].cls_to_fsdp_cls
report["after sharding"] = {"type": type(cache).__name__, "keys": sorted(c.__name__ for c in cache),
                            "values": sorted(c.__name__ for c in cache.values())}
report["applied"] = fsdp_autopatch.status().applied
print(json.dumps(report))
