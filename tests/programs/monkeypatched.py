"""A method of the wrapper class (FSDPModule.reshard, DDP.set_requires_gradient_sync) replaced
(before and after the ABC class is built), restored, deleted: what a plain module and an ABC
module call each time. For tests/test_fully_shard.py; prints one JSON line.

    python tests/programs/monkeypatched.py 'fully_shard'|'DDP replicate'
"""

import abc
import json
import sys

import torch.distributed.fsdp  # noqa: F401 (FSDP2, and composable DDP through it)
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from wrappers import under_test

from fsdp_autopatch import _verify

Wrapper, PREFIX, METHOD, ARGS, wrap = under_test(sys.argv[1])

class Plain(nn.Linear):
    pass

class Head(abc.ABC, nn.Linear):
    pass

class Late(abc.ABC, nn.Linear):
    pass

mesh = _verify.init_process_group()
real = Wrapper.__dict__[METHOD]

def traced(self, *args):
    return "traced " + type(self).__name__

def shard(cls):
    module = cls(4, 4)
    try:
        wrap(module, mesh)
        return module
    except TypeError as error:
        return str(error)

def calls(*modules):
    answers = []
    for module in modules:
        if isinstance(module, str):
            answers.append("not sharded")
            continue
        try:
            answer = getattr(module, METHOD)(*ARGS)
            answers.append(answer if isinstance(answer, str) else "torch's method")
        except AttributeError:
            answers.append("no method")
    return answers

plain, head = shard(Plain), shard(Head)
report = {"before": calls(plain, head)}
setattr(Wrapper, METHOD, traced)
late = shard(Late)
report["replaced"] = calls(plain, head, late)
setattr(Wrapper, METHOD, real)
report["restored"] = calls(plain, head, late)
delattr(Wrapper, METHOD)
report["deleted"] = calls(plain, head, late)
report["hasattr"] = [hasattr(type(m), METHOD) for m in (plain, head, late) if not isinstance(m, str)]
setattr(Wrapper, METHOD, real)
print(json.dumps(report))
