"""The namespace torch passes in a call, for tests/test_invisible.py: after the imports, a user
rebinds the deep-copy stub torch looks up at each call (to allow ``copy.deepcopy`` of a wrapped
model for an EMA copy), then wraps an ABC-first head and its ABC-last twin with FSDP2 and with
composable DDP. One JSON object: per wrapper and head, whether its class holds the user's stub.

    python tests/programs/namespace_of_the_call.py
"""

import abc
import importlib
import json

import torch.distributed as dist
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard

from fsdp_autopatch import _verify

# The module: torch.distributed._composable exports a function of the same name.
composable_ddp = importlib.import_module("torch.distributed._composable.replicate")


def allow_deepcopy(self: nn.Module, memo: dict) -> nn.Module:
    return self


_fully_shard._unimplemented_deepcopy = allow_deepcopy  # type: ignore[attr-defined]
composable_ddp.unimplemented_deepcopy = allow_deepcopy  # type: ignore[attr-defined]

mesh = _verify.init_process_group()
report = {}
for wrapper, wrap in (("fully_shard", lambda module: fully_shard(module, mesh=mesh)),
                      ("DDP replicate", composable_ddp.replicate)):
    for name, bases in (("abc first", (abc.ABC, nn.Linear)), ("abc last", (nn.Linear, abc.ABC))):
        module = type("Head", bases, {})(2, 2)
        try:
            wrap(module)
        except TypeError as error:
            report[f"{wrapper} {name}"] = str(error)
            continue
        report[f"{wrapper} {name}"] = type(module).__dict__.get("__deepcopy__") is allow_deepcopy
dist.destroy_process_group()
print(json.dumps(report))
