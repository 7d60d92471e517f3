"""A user's own ABC, Generic, collections.abc and Protocol modules and an ABC container, each
sharded with FSDP2 if CPython allows it, for tests/test_fully_shard.py; one JSON line.

    python tests/programs/user_modules.py
"""

import abc
import collections.abc
import copy
import json
import typing

import torch
import torch.distributed as dist
import torch.distributed._composable.fsdp as composable
import torch.distributed.fsdp
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fully_shard

from fsdp_autopatch import _verify

T = typing.TypeVar("T")

class AbcHead(abc.ABC, nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
    def forward(self, x):
        return self.linear(x)

class GenericHead(typing.Generic[T], nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
    def forward(self, x):
        return self.linear(x)

class SizedHead(collections.abc.Sized, nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
    def __len__(self):
        return 1
    def forward(self, x):
        return self.linear(x)

class Proto(typing.Protocol):
    def f(self) -> int: ...

class ProtoImpl(Proto):
    def f(self) -> int:
        return 1

class ProtoHead(ProtoImpl, nn.Module):
    def __init__(self):
        nn.Module.__init__(self)  # a Protocol subclass's __init__ does not chain to Module's
        self.linear = nn.Linear(4, 4)
    def forward(self, x):
        return self.linear(x)

class AbcSequential(abc.ABC, nn.Sequential):
    pass

mesh = _verify.init_process_group()
report = {}
for cls in (AbcHead, GenericHead, SizedHead, ProtoHead):
    module = cls()
    try:
        fully_shard(module, mesh=mesh)
    except TypeError as error:
        report[cls.__name__] = {"error": str(error)}
        continue
    module(torch.ones(2, 4)).sum().backward()
    module.unshard()
    module.reshard()
    twin = cls()
    fully_shard(twin, mesh=mesh)
    try:
        copy.deepcopy(module)
        deepcopy_guarded = False
    except AssertionError:
        deepcopy_guarded = True
    wrapper = type(module)
    report[cls.__name__] = {
        "aliases": [isinstance(module, alias) for alias in
                    (FSDPModule, composable.FSDPModule, _fully_shard.FSDPModule)],
        "fsdp_methods_resolve_to_fsdpmodule": all(
            getattr(wrapper, name) is getattr(FSDPModule, name)
            for name in ("reshard", "unshard", "set_requires_gradient_sync", "_apply", "__new__")),
        "original_at_index_2": wrapper.__mro__[2] is cls,
        "one_class_per_original": type(twin) is wrapper,
        "cached": _fully_shard.get_cls_to_fsdp_cls()[cls] is wrapper,
        "deepcopy_guarded": deepcopy_guarded,
        "metaclass_as_upstream": type(wrapper) is type(cls),
        "upstream_bases": wrapper.__bases__ == (FSDPModule, cls),
    }
container = AbcSequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
try:
    fully_shard(container, mesh=mesh)
    report["slice"] = type(container[0:2]).__name__
except TypeError as error:
    report["slice"] = str(error)
dist.destroy_process_group()
print(json.dumps(report))
