"""A class whose construction shards another module: torch's construction runs it inside the
patched cache's decision, in the same thread. For tests/test_fully_shard.py; prints one JSON
line.

    python tests/programs/shards_while_built.py 'fully_shard'|'DDP replicate'
"""

import json
import sys

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from wrappers import under_test

from fsdp_autopatch import _verify

Wrapper, PREFIX, METHOD, ARGS, wrap = under_test(sys.argv[1])

mesh = _verify.init_process_group()

class Inner(nn.Linear):
    pass

class Outer(nn.Linear):
    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith(PREFIX):
            wrap(Inner(2, 2), mesh)

module = Outer(2, 2)
wrap(module, mesh)
print(json.dumps({"outer": type(module).__name__}))
