"""torch's fully_shard made to call a copy of its helper with globals of its own, as a torch that
moved the helper would: the stand-in in the helper's module no longer reaches it. Then
transformers arms the patch, and an ABC module is sharded. For tests/test_hooks.py; one JSON
line.

    python tests/programs/calls_a_copy.py [--untouched]    # --untouched: the copy made, torch left as it is
"""

import abc
import json
import sys
import types

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard

helper = _fully_shard._apply_to_module
copy = types.FunctionType(helper.__code__, dict(helper.__globals__))
if "--untouched" not in sys.argv:
    _fully_shard._apply_to_module = copy

import transformers  # noqa: E402, F401 (arms the patch, after torch was changed)

import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _verify  # noqa: E402


class Head(abc.ABC, nn.Linear):
    pass

try:
    fully_shard(Head(4, 4), mesh=_verify.init_process_group())
    error = None
except TypeError as caught:
    error = str(caught)
stand_in = helper.__globals__.get("_fsdp_autopatch_type")
print(json.dumps({"status": fsdp_autopatch.status().to_dict(), "error": error,
                  "stand_in": [type(stand_in).__name__, len(getattr(stand_in, "constructions", ()))]}))
