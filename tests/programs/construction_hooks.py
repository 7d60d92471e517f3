"""A user's module classes whose construction has side effects: a registry that refuses a second
class of one name (its __init_subclass__) and a metaclass counting what it builds. For
tests/test_fully_shard.py; prints one JSON line.

    python tests/programs/construction_hooks.py 'fully_shard'|'DDP replicate'
"""

import abc
import json
import sys

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from wrappers import under_test

import fsdp_autopatch
from fsdp_autopatch import _verify

Wrapper, PREFIX, METHOD, ARGS, wrap = under_test(sys.argv[1])

built = []

class Counting(abc.ABCMeta):
    def __new__(meta, name, bases, namespace, **kwargs):
        built.append(name)
        return super().__new__(meta, name, bases, namespace, **kwargs)

class Registered(nn.Module):
    registry = {}  # noqa: RUF012 (a registry as users write it)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__name__ in Registered.registry:
            raise TypeError(f"duplicate registration {cls.__name__}")
        Registered.registry[cls.__name__] = cls

class Block(Registered, metaclass=Counting):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

class AbcBlock(abc.ABC, Registered, metaclass=Counting):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

mesh = _verify.init_process_group()
report = {}
for cls in (Block, AbcBlock):
    built.clear()
    outcomes = []
    for _ in range(2):
        module = cls()
        try:
            wrap(module, mesh)
            outcomes.append(type(module).__name__)
        except TypeError as error:
            outcomes.append(str(error))
    report[cls.__name__] = {"outcomes": outcomes, "built": list(built),
                            "registered": sorted(Registered.registry)}
report["classes"] = fsdp_autopatch.status().to_dict()["classes"]
print(json.dumps(report))
