"""A torch newer than every row of the matrix whose construction cannot be probed (its helper has
a signature the package does not know while transformers arms the patch), for
tests/test_hooks.py; the status as one JSON line.

    python tests/newer_unprobed.py
"""

import json

import torch

torch.__version__ = "2.99.0"  # newer than every row of the matrix
import torch.distributed.fsdp  # noqa: E402 (after the version is changed)
from torch.distributed.fsdp._fully_shard import _fully_shard  # noqa: E402


def unknown(modules, cls_to_wrapper_cls, wrapper_module_cls, wrapper_cls_prefix,
            unimplemented_deepcopy, placement):
    raise AssertionError("never called")

helper, _fully_shard._apply_to_module = _fully_shard._apply_to_module, unknown
import transformers  # noqa: E402, F401 (arms the patch while the helper is unknown)

_fully_shard._apply_to_module = helper
import fsdp_autopatch  # noqa: E402

print(json.dumps(fsdp_autopatch.status().to_dict()))
