"""FSDP2 replicate's ``ReplicateModule`` and ``FSDPModule`` monkeypatched (a name replicate did not
define added, FSDPModule's replaced, both restored): what a plain and an ABC module call each
time. For tests/test_replicate.py; prints one JSON line.

    python tests/programs/replicate_monkeypatched.py
"""

import abc
import json

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.fsdp import FSDPModule

from fsdp_autopatch import _verify


class Plain(nn.Linear):
    pass

class Head(abc.ABC, nn.Linear):
    pass

mesh = _verify.init_process_group()
modules = []
for cls in (Plain, Head):
    module = cls(4, 4)
    try:
        replicate(module, mesh=mesh)
        modules.append(module)
    except TypeError:
        modules.append(None)

def calls():
    answers = []
    for module in modules:
        if module is None:
            answers.append("not replicated")
            continue
        answer = module.reshard()
        answers.append(answer if isinstance(answer, str) else "torch's reshard")
    return answers

real = FSDPModule.__dict__["reshard"]
report = {"before": calls()}
ReplicateModule.reshard = lambda self: "replicate's " + type(self).__name__  # a name it did not define
report["added"] = calls()
FSDPModule.reshard = lambda self: "fsdp's " + type(self).__name__
report["both"] = calls()
del ReplicateModule.reshard
report["removed"] = calls()
FSDPModule.reshard = real
report["restored"] = calls()
print(json.dumps(report))
