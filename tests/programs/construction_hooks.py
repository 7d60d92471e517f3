"""A user's module classes whose construction has side effects: a registry that refuses a second
class of one name (its __init_subclass__), a metaclass counting what it builds, and an
empty-__slots__ mixin and metaclass counting every call of their code (``__new__``, ``__init__``,
``__del__``, ``__init_subclass__``, ``__set_name__``, the metaclass's ``__new__``, ``__init__``
and ``__call__``) while the modules are wrapped (what torch reads through a metaclass varies with
its own isinstance caches: tests/test_wrapper_cls.py counts those reads, torch aside). For
tests/test_fully_shard.py; prints one JSON line.

    python tests/programs/construction_hooks.py 'fully_shard'|'DDP replicate'|'FSDP2 replicate'
"""

import abc
import collections
import gc
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
calls = collections.Counter()

class Counting(abc.ABCMeta):
    def __new__(meta, name, bases, namespace, **kwargs):
        built.append(name)
        calls["metaclass __new__"] += 1
        return super().__new__(meta, name, bases, namespace, **kwargs)

    def __init__(cls, *args, **kwargs):
        calls["metaclass __init__"] += 1
        super().__init__(*args, **kwargs)

    def __call__(cls, *args, **kwargs):
        calls["metaclass __call__"] += 1
        return super().__call__(*args, **kwargs)

class Named:
    def __set_name__(self, owner, name):
        calls["__set_name__"] += 1

class Hooks(abc.ABC, metaclass=Counting):
    """Code of its own for every step of a class's and an instance's life."""

    __slots__ = ()
    named = Named()

    def __new__(cls, *args, **kwargs):
        calls["__new__"] += 1
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        calls["__init__"] += 1
        super().__init__(*args, **kwargs)

    def __del__(self):
        calls["__del__"] += 1

    def __init_subclass__(cls, **kwargs):
        calls["__init_subclass__"] += 1
        super().__init_subclass__(**kwargs)

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

# The mixin last (CPython accepts torch's class) and first (it refuses it, where the bug is).
class HooksLastBlock(Registered, Hooks):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

class HooksFirstBlock(Hooks, Registered):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

mesh = _verify.init_process_group()
report = {}
kept = []  # every module lives to the end: only what a wrap runs is counted
for cls in (Block, AbcBlock, HooksLastBlock, HooksFirstBlock):
    modules = [cls(), cls()]  # made before anything is counted
    kept += modules
    gc.collect()
    built.clear()
    calls.clear()
    outcomes = []
    for module in modules:
        try:
            wrap(module, mesh)
            outcomes.append(type(module).__name__)
        except TypeError as error:
            outcomes.append(str(error))
    gc.collect()
    report[cls.__name__] = {"outcomes": outcomes, "built": list(built), "calls": dict(calls),
                            "registered": sorted(Registered.registry)}
report["classes"] = fsdp_autopatch.status().to_dict()["classes"]
print(json.dumps(report))
