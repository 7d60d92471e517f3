"""Module classes whose creation has side effects, each as a plain class (torch's class fits) and
with abc.ABC first (it does not): descriptors with __set_name__, an __init_subclass__ that
decorates, a metaclass that applies a class decorator and keeps a registry, functools.cache
keyed on the class, cached_property. Every side effect lands in ``events``, in order. For
tests/test_fully_shard.py; prints one JSON line.

    python tests/programs/side_effects.py 'fully_shard'|'DDP replicate'
"""

import abc
import functools
import json
import sys

import torch
import torch.distributed.fsdp
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from wrappers import under_test

import fsdp_autopatch
from fsdp_autopatch import _verify

Wrapper, PREFIX, METHOD, ARGS, wrap = under_test(sys.argv[1])

events = []

class Named:
    def __set_name__(self, owner, name):
        events.append(f"set_name {owner.__name__}.{name}")

    def __get__(self, instance, owner):
        return f"named on {owner.__name__}"

def stamped(cls):
    events.append(f"decorated {cls.__name__}")
    cls.stamp = cls.__name__
    return cls

class Decorating(abc.ABCMeta):
    registry = {}  # noqa: RUF012 (a registry as users write it)

    def __new__(meta, name, bases, namespace, **kwargs):
        cls = stamped(super().__new__(meta, name, bases, namespace, **kwargs))
        Decorating.registry.setdefault(name, []).append(cls)
        return cls

@functools.cache
def describe(cls):
    events.append(f"described {cls.__name__}")
    return [c.__name__ for c in cls.__mro__[:3]]

class Base(nn.Module, metaclass=Decorating):
    named = Named()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        events.append(f"init_subclass {cls.__name__}")

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    @functools.cached_property
    def size(self):
        events.append(f"cached_property on {type(self).__name__}")
        return self.linear.in_features

    def forward(self, x):
        return self.linear(x)

class Plain(Base):
    pass

class Head(abc.ABC, Base):
    pass

mesh = _verify.init_process_group()
report = {}
for cls in (Plain, Head):
    events.clear()
    module = cls()
    try:
        wrap(module, mesh)
        wrap(cls(), mesh)  # the second module of the class: a cache hit for fully_shard
        kind = type(module)
        outcome = {
            "class": kind.__name__, "mro": [c.__name__ for c in kind.__mro__[:3]],
            "is_fsdp": isinstance(module, Wrapper), "named": module.named,
            "stamp": kind.stamp, "describe": describe(kind), "size": [module.size, module.size],
            "output": list(module(torch.ones(1, 4)).shape),
            "registered": len(Decorating.registry.get(kind.__name__, [])),
        }
    except TypeError as error:
        outcome = {"error": str(error)}
    report[cls.__name__] = {"outcome": outcome, "events": list(events)}
report["applied"] = fsdp_autopatch.status().applied
print(json.dumps(report))
