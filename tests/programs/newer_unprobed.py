"""A torch newer than every row of the matrix whose construction cannot be probed at any site
while transformers arms the patch (FSDP2's helper has a signature the package does not know,
and composable DDP's wrapper class refuses to be subclassed), for tests/test_hooks.py; the
status as one JSON line.

    python tests/programs/newer_unprobed.py
"""

import importlib
import json

import torch

torch.__version__ = "2.99.0"  # newer than every row of the matrix
import torch.distributed.fsdp  # noqa: E402 (after the version is changed)
from torch.distributed.fsdp._fully_shard import _fully_shard  # noqa: E402

# the module (torch.distributed._composable exports a function of the same name)
ddp = importlib.import_module("torch.distributed._composable.replicate")


def unknown(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
            unimplemented_deepcopy, placement):
    raise AssertionError("never called")


class Unprobed(ddp.DDP):
    def __init_subclass__(cls, **kwargs):
        raise RuntimeError("not while the package decides")


helper, _fully_shard._apply_to_module = _fully_shard._apply_to_module, unknown
wrapper, ddp.DDP = ddp.DDP, Unprobed
import transformers  # noqa: E402, F401 (arms the patch while no site can be probed)

_fully_shard._apply_to_module, ddp.DDP = helper, wrapper
import fsdp_autopatch  # noqa: E402

print(json.dumps(fsdp_autopatch.status().to_dict()))
