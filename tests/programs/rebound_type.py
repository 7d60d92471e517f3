"""A user's logging wrapper of ``type`` bound in torch's builder modules before the patch
installs, for tests/test_api.py; one JSON line: the status once FSDP2, composable DDP and
transformers are imported.

    python tests/programs/rebound_type.py
"""

import builtins
import importlib
import json

import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init

import fsdp_autopatch

ddp = importlib.import_module("torch.distributed._composable.replicate")
made = []


def logging_type(*args: object) -> object:
    made.append(args[0] if len(args) == 3 else None)
    return builtins.type(*args)


fsdp_init.type = logging_type  # type: ignore[attr-defined]
ddp.type = logging_type  # type: ignore[attr-defined]
import transformers  # noqa: E402, F401 (the decision, and the install, come with it)

print(json.dumps(fsdp_autopatch.status().to_dict()))
