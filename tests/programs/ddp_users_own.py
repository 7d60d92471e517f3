"""A user's own ``class Head(abc.ABC, nn.Linear)``, a ``Generic[T]``-first module and a plain one,
each replicated with composable DDP and run (the plain one twice), after the imports given; for
tests/test_ddp.py. Prints one JSON line: per class, its class names and ids or errors, and the
status.

    python tests/programs/ddp_users_own.py IMPORTS    # as tests/programs/import_order.py reads them
"""

from __future__ import annotations

import abc
import json
import sys
import typing

import torch
from import_order import import_modules
from torch import nn

import fsdp_autopatch
from fsdp_autopatch import DDP_MODULE, _verify

import_modules(sys.argv[1])
composable_ddp = sys.modules[DDP_MODULE]
T = typing.TypeVar("T")


class Head(abc.ABC, nn.Linear):
    pass


class GenericHead(typing.Generic[T], nn.Linear):
    pass


class Plain(nn.Linear):
    pass


mesh = _verify.init_process_group()
report: dict[str, typing.Any] = {}
for cls in (Head, GenericHead, Plain, Plain):
    module = cls(4, 4)
    try:
        composable_ddp.replicate(module)
        out = module(torch.ones(2, 4)).sum()
        out.backward()
        report.setdefault(cls.__name__, []).append([type(module).__name__, id(type(module))])
    except TypeError as error:
        report.setdefault(cls.__name__, []).append(str(error))
report["status"] = fsdp_autopatch.status().to_dict()
print(json.dumps(report))
