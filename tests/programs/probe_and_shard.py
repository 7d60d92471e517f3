"""The package's probe next to the real thing, for tests/test_hooks.py: fully_shard, unpatched,
on a class (ABC, nn.Module); the probe through torch's helper, an inline construction, a helper
of an unknown signature and one with reordered parameters. One JSON line.

    FSDP_AUTOPATCH=0 python tests/programs/probe_and_shard.py
"""

import abc
import json

from probe_layout_bug import layout_bug
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard

from fsdp_autopatch import _patch, _sites, _verify

report = {"helper": layout_bug()}
report["cache_untouched"] = not any(
    "LayoutProbe" in cls.__name__ for cls in _fully_shard.cls_to_fsdp_cls)
# Composable DDP builds its class inline, as torch 2.4 - 2.10's fully_shard does.
report["inline"] = layout_bug(_patch.resolve_api(_sites.DDP_REPLICATE))
helper = _fully_shard._apply_to_module
# A helper that wants an argument the package does not know: it cannot tell, and says so.
def unknown(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
            unimplemented_deepcopy, placement):
    raise AssertionError("never called")
_fully_shard._apply_to_module = unknown
report["unknown_signature"] = layout_bug()
# Keyword-only and reordered parameters are matched by name, not position.
def reordered(*, unimplemented_deepcopy, wrapper_cls_prefix, wrapper_module_cls,
              cls_to_wrapper_cls, modules, extra=None):
    return helper(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
                  unimplemented_deepcopy)
_fully_shard._apply_to_module = reordered
report["reordered"] = layout_bug()
_fully_shard._apply_to_module = helper

class Head(abc.ABC, nn.Linear):
    pass

try:
    fully_shard(Head(4, 4), mesh=_verify.init_process_group())
    report["error"] = None
except TypeError as error:
    report["error"] = str(error)
print(json.dumps(report))
