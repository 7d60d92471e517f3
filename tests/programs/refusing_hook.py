"""A user's class hook that refuses wrapper classes, and one that warns about them, met through
FSDP2 and composable DDP, for tests/test_invisible.py; one JSON object: per wrapper, the frames
of the traceback the refusal raises (file name and function, innermost last), and the file a
``stacklevel=2`` warning names.

    python tests/programs/refusing_hook.py
"""

import importlib
import json
import os
import sys
import traceback
import warnings

import torch.distributed as dist
import transformers  # noqa: F401 (an affected release arms the patch)
from torch import nn
from torch.distributed.fsdp import fully_shard

from fsdp_autopatch import _verify

ddp = importlib.import_module("torch.distributed._composable.replicate")


class NoWrappers:
    """Refuses a subclass named like a wrapper class: the error is the user's, raised in torch's call."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith(("FSDP", "DDP")):
            raise TypeError(f"{cls.__name__}: no wrapper classes here")


class WarnsOfWrappers:
    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__name__.startswith(("FSDP", "DDP")):
            warnings.warn(f"{cls.__name__} made", stacklevel=2)


mesh = _verify.init_process_group()
report = {}
wrappers = (("fully_shard", lambda module: fully_shard(module, mesh=mesh)), ("DDP replicate", ddp.replicate))
for name, wrap in wrappers:
    try:
        wrap(type("Refusing", (NoWrappers, nn.Linear), {})(2, 2))
        frames = None
    except TypeError:
        frames = [(os.path.basename(frame.filename), frame.name)
                  for frame in traceback.extract_tb(sys.exc_info()[2])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap(type("Warning", (WarnsOfWrappers, nn.Linear), {})(2, 2))
    report[name] = {"frames": frames, "warned_in": [os.path.basename(w.filename) for w in caught
                                                    if "made" in str(w.message)]}
dist.destroy_process_group()
print(json.dumps(report))
